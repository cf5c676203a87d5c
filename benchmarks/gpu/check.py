#!/usr/bin/env python3
"""GPU offload, verified: one prepared command that builds, tests and measures localspec on a CUDA machine.

Here (with network), once per llama-cpp-python pin:

    python benchmarks/gpu_check.py --prepare .gpu-bundle        # trimmed source + wheels, < 64 MiB, git-ignored

On a bare, offline CUDA machine (nvcc, CMake, ninja, scikit-build-core, Python 3.12), from the
repository root, with .gpu-bundle carried:

    python3 benchmarks/gpu_check.py                             # or: bash benchmarks/gpu/check.sh

builds llama-cpp-python from the bundle with CUDA for the card it finds (into .gpu-build/, a
virtual environment that also sees the machine's own packages), installs localspec there, then
runs the steps of benchmarks/gpu/steps.py, features.py and measure.py in a child process with every layer
of target and draft offloaded, and writes gpu_check.json and gpu_check.md to $OUT (or --out) and
prints the table. A failing step never stops the others; a step that crashes its process is
recorded as failed and the rest go on in a fresh one; the whole run keeps to --budget seconds
(default 540, the build included): steps that no longer fit are skipped, and running the command
again on the same machine reuses the build and the models and does what is left (--steps NAMES).

The dry run, on a CPU build:

    python benchmarks/gpu_check.py --cpu                        # builds the bundle's source for the CPU
    python benchmarks/gpu_check.py --cpu --no-build             # the installed llama-cpp-python (CI)

Exit status: 0 when no step failed, 1 otherwise, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Sequence

from benchmarks.gpu import report

ROOT = Path(__file__).resolve().parents[2]  # the repository
BUDGET = 540.0  # seconds: 9 minutes, the build included
# the quick checks, then the measurements (what a GPU run is for), then the two long checks
CHECK_STEPS = ("tiny_models", "info", "greedy", "constrained", "tool_call", "server", "prompt_cache", "shaped_models",
               "cost_curve", "decode_speed", "verifier_share", "planner", "prediction", "lossless", "loading",
               "gpu_tests")
ESTIMATES = {"tiny_models": 5, "info": 15, "greedy": 30, "lossless": 60, "constrained": 10, "tool_call": 10,
             "server": 10, "prompt_cache": 10, "shaped_models": 60, "cost_curve": 30, "decode_speed": 15,
             "verifier_share": 30, "planner": 30, "prediction": 5, "loading": 60, "gpu_tests": 40}  # GPU seconds, full scale
QUICK_FACTOR = 0.2
CRASH_ENV = "GPU_CHECK_CRASH_AT"  # tests: the step runner aborts (SIGABRT) when it starts this step
GRACE = 20.0  # seconds past the deadline a runner may take to finish its step before it is stopped

log = logging.getLogger("gpu_check")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See docs/gpu.md.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepare", type=Path, metavar="DIR", help="make the bundle in DIR here (needs network) and stop")
    p.add_argument("--python-version", default="3.12", help="with --prepare: the device's Python (default 3.12)")
    p.add_argument("--sdist", type=Path, help="with --prepare: a llama-cpp-python source archive instead of downloading")
    p.add_argument("--bundle", type=Path, default=ROOT / ".gpu-bundle", help="the bundle (default .gpu-bundle)")
    p.add_argument("--work", type=Path, default=ROOT / ".gpu-build",
                   help="build tree, virtual environment, models (default .gpu-build; reused by a later run)")
    p.add_argument("--out", type=Path, default=None, help="where the JSON and markdown go (default $OUT, else WORK/out)")
    p.add_argument("--cpu", action="store_true", help="a CPU build: the same steps, no GPU expected (dry run)")
    p.add_argument("--no-build", action="store_true", help="use the llama-cpp-python and localspec installed here")
    p.add_argument("--arch", default=None, help="CUDA architecture (default: the card's compute capability, else native)")
    p.add_argument("--scale", choices=("full", "quick"), default=None,
                   help="how much each step does (default: full; quick with --cpu)")
    p.add_argument("--budget", type=float, default=BUDGET, help=f"seconds for the whole run (default {BUDGET:.0f})")
    p.add_argument("--steps", default=None, help=f"comma list of check steps to run (default all: {','.join(CHECK_STEPS)})")
    p.add_argument("--runner", type=Path, default=None, help=argparse.SUPPRESS)  # internal: run the steps of a state file
    args = p.parse_args(argv)
    if args.runner is not None:
        return args
    if args.budget < 30:
        p.error(f"--budget must be at least 30 seconds, got {args.budget:g}")
    if args.steps is not None:
        names = [s for s in args.steps.split(",") if s]
        unknown = [s for s in names if s not in CHECK_STEPS]
        if unknown or not names:
            p.error(f"--steps: unknown step(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(CHECK_STEPS)}")
        args.steps = names
    else:
        args.steps = list(CHECK_STEPS)
    args.scale = args.scale or ("quick" if args.cpu else "full")
    return args


# ---------------------------------------------------------------- the runner (a child process)


def step_functions() -> dict:
    from benchmarks.gpu import features, measure, steps

    return {"tiny_models": steps.step_tiny_models, "info": steps.step_info, "greedy": steps.step_greedy,
            "lossless": steps.step_lossless, "constrained": features.step_constrained,
            "tool_call": features.step_tool_call, "server": features.step_server,
            "prompt_cache": features.step_prompt_cache, "shaped_models": measure.step_shaped_models,
            "cost_curve": measure.step_cost_curve, "decode_speed": measure.step_decode_speed,
            "verifier_share": measure.step_verifier_share, "planner": measure.step_planner,
            "prediction": measure.step_prediction,
            "loading": measure.step_loading, "gpu_tests": step_gpu_tests}


def step_gpu_tests(ctx) -> tuple[str, dict]:
    """The test suite's GPU-only tests (tests/test_gpu_check.py), which skip on a CPU build."""
    from benchmarks.gpu.steps import StepFailed, StepSkipped

    if not ctx.gpu:
        raise StepSkipped("a CPU build: the GPU-only tests skip here (the test suite runs them)")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/test_gpu_check.py", "-k", "gpu_only"], cwd=ROOT, capture_output=True, text=True,
                         timeout=max(30, int(ctx.left())), stdin=subprocess.DEVNULL)
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr.strip()[-300:]
    if out.returncode != 0:
        raise StepFailed(f"pytest exited {out.returncode}: {tail}", {"output": out.stdout[-4000:]})
    return tail, {"output": out.stdout[-4000:]}


def runner_main(state_path: Path) -> int:
    """Run the pending steps of the state file in order, saving it after each."""
    from benchmarks.gpu.steps import SCALES, Context, StepFailed, StepSkipped

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    state = report.load(state_path)
    functions = step_functions()
    ctx = Context(work=Path(state["work"]), scale=SCALES[state["scale"]], gpu=state["mode"] == "cuda",
                  deadline=state["deadline"], paths=state["paths"], facts=state["facts"])
    factor = 1.0 if state["scale"] == "full" else QUICK_FACTOR
    try:
        for name in report.pending(state):
            if ctx.left() < ESTIMATES[name] * factor:
                report.record(state, name, "skipped", 0.0, f"time budget: {ctx.left():.0f} s left, the step takes "
                                                            f"about {ESTIMATES[name] * factor:.0f} s")
                report.save(state, state_path)
                continue
            report.record(state, name, "running")
            report.save(state, state_path)
            print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
            if os.environ.get(CRASH_ENV) == name:
                os.abort()  # tests: a crash inside llama.cpp, as the earlier report saw
            t0 = time.perf_counter()
            try:
                summary, data = functions[name](ctx)
                status = "partial" if data.get("partial") else "ok"
            except StepSkipped as exc:
                status, summary, data = "skipped", str(exc), {}
            except StepFailed as exc:
                status, summary, data = "failed", str(exc), exc.data
            except Exception as exc:  # a fault of the step itself: recorded, the others go on
                status, summary, data = "failed", f"{type(exc).__name__}: {exc}", {"traceback": traceback.format_exc()}
            report.record(state, name, status, time.perf_counter() - t0, summary, data)
            print(f"gpu_check: {name}: {status}: {summary}", file=sys.stderr, flush=True)
            report.save(state, state_path)
    finally:
        ctx.close_models()
    return 0


def run_steps(python: str, state: dict, state_path: Path, env: dict) -> None:
    """Run the pending steps in child processes: one that dies (a crash in llama.cpp) fails its
    step, and a fresh one takes the rest; one past the deadline is stopped."""
    report.save(state, state_path)
    while report.pending(state):
        timeout = max(5.0, state["deadline"] - time.time() + GRACE)
        proc = subprocess.Popen([python, "-m", "benchmarks.gpu.check", "--runner", str(state_path)], cwd=ROOT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            why = None if rc == 0 else (f"its process was killed by {signal.Signals(-rc).name}" if rc < 0
                                        else f"its process exited {rc}")
        except (subprocess.TimeoutExpired, Terminated) as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(exc, Terminated):
                fresh = report.load(state_path)
                state.update(steps=fresh["steps"], paths=fresh["paths"], facts=fresh["facts"])
                raise
            why = "timed out: stopped at the end of the time budget"
        fresh = report.load(state_path)
        state.update(steps=fresh["steps"], paths=fresh["paths"], facts=fresh["facts"])
        left = report.pending(state)
        if not left:
            break
        if why is None:  # a clean exit with steps left: the runner could not start them
            why = "the step runner stopped before this step"
        report.record(state, left[0], "failed", None, why)
        if why.startswith("timed out"):
            report.skip_rest(state, "time budget")
        report.save(state, state_path)


# ---------------------------------------------------------------- main


class Terminated(Exception):
    """SIGTERM or SIGINT (an outer `timeout`, Ctrl-C): the report is still written."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signal.Signals(signum).name)


def out_dir(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return args.out
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return args.work / "out"


def check_env(work: Path, extra: dict | None = None) -> dict:
    """The environment of the steps: no resident services, localspec's state inside WORK."""
    env = dict(os.environ, LOCALSPEC_KEEP_ALIVE="0", LOCALSPEC_CACHE_DIR=str(work / "cache"),
               LOCALSPEC_PROFILE_DIR=str(work / "profiles"), LOCALSPEC_PROMPT_CACHE="off", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def check_main(args: argparse.Namespace) -> int:
    work = args.work.resolve()
    out = out_dir(args).resolve()
    for d in (work, out):
        d.mkdir(parents=True, exist_ok=True)
    mode = "cpu" if args.cpu else "cuda"
    build_steps = [] if args.no_build else list(gpu_build_steps())
    state = report.new_state(mode, args.scale, args.budget, build_steps + args.steps, sys.argv, work)
    state_path = out / report.JSON_NAME
    report.save(state, state_path)
    python, env_extra = sys.executable, {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _terminate)
    try:
        if build_steps:
            from benchmarks.gpu import build

            built = build.build(args, state, state_path)
            python, env_extra = (built.python, built.env) if built else (None, {})
        if python is None:
            report.skip_rest(state, "the build failed")
        else:
            run_steps(python, state, state_path, check_env(work, env_extra))
    except Terminated as exc:
        running = [s for s in state["steps"] if s["status"] == "running"]
        for s in running:
            report.record(state, s["name"], "failed", None, f"stopped by {exc} while it ran")
        report.skip_rest(state, f"stopped by {exc}")
    state["finished"] = time.time()
    report.save(state, state_path)
    text = report.render(state)
    (out / report.MD_NAME).write_text(text)
    print(text, flush=True)
    print(f"written: {state_path} and {out / report.MD_NAME}", file=sys.stderr)
    return 1 if any(s["status"] == "failed" for s in state["steps"]) else 0


def gpu_build_steps() -> tuple[str, ...]:
    from benchmarks.gpu import build

    return build.STEPS


def prepare_main(args: argparse.Namespace) -> int:
    from benchmarks.gpu import bundle

    try:
        manifest = bundle.prepare(args.prepare, python_version=args.python_version, sdist=args.sdist)
    except (bundle.BundleError, subprocess.CalledProcessError) as exc:
        print(f"gpu_check --prepare: {exc}", file=sys.stderr)
        return 1
    print(bundle.summary(manifest))
    print(f"bundle ready in {args.prepare}; carry it with the working tree and run benchmarks/gpu_check.py there")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.runner is not None:
        return runner_main(args.runner)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.prepare is not None:
        return prepare_main(args)
    return check_main(args)


if __name__ == "__main__":
    sys.exit(main())
