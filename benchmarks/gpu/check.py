"""The GPU check (docs/gpu.md): one command that builds llama-cpp-python with CUDA (build.py, from a
bundle made here with --prepare: bundle.py), measures the shaped default pair's cost curve
(measure.py) and `localspec bench` of every verifier on it, and runs the test suite with
TESTS_N_GPU_LAYERS=-1, within --budget seconds. Each step runs in a child process (a crash inside
llama.cpp is reported and the next step runs); what the budget cuts off is named; a second run on
the same machine reuses the build and the models. The report: gpu_check.md and .json in $OUT (or
--out), the markdown on stdout. Exit status 0 when all of it ran and passed, 1 otherwise, 2 for a
usage error."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Sequence

from benchmarks.gpu import build, bundle, report

ROOT = build.ROOT
BUDGET = 540.0  # seconds: 9 minutes, the build included
BENCH = "--shapes k4,p3k4,t3x2x1 --temperatures 0,0.8 --prompts code --raw -n 64"  # and every verifier
log = logging.getLogger("gpu_check")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], epilog="See docs/gpu.md.")
    p.add_argument("--prepare", type=Path, metavar="DIR", help="make the bundle in DIR (needs network) and stop")
    p.add_argument("--bundle", type=Path, default=ROOT / ".gpu-bundle", help="the bundle (default: .gpu-bundle)")
    p.add_argument("--work", type=Path, default=ROOT / ".gpu-build", help="what is built and written, kept for a "
                   "later run (default: .gpu-build)")
    p.add_argument("--out", type=Path, help="where the report goes (default: $OUT, else WORK/out)")
    p.add_argument("--no-build", action="store_true", help="use the llama-cpp-python installed here")
    p.add_argument("--cpu", action="store_true", help="expect no GPU, build for the CPU: a dry run")
    p.add_argument("--shapes", choices=("default", "small"), default="default",
                   help="the measured pair: the default pair's shapes, or small ones for a dry run")
    p.add_argument("--budget", type=float, default=BUDGET, help=f"seconds for all of it (default {BUDGET:.0f})")
    p.add_argument("--bench", metavar="ARGS", help=f"localspec bench's arguments (default: every verifier, {BENCH})")
    p.add_argument("--tests", default="tests", metavar="ARGS", help="pytest's arguments (default: tests)")
    args = p.parse_args(argv)
    if not 60 <= args.budget <= 86400:
        p.error(f"--budget must lie in [60, 86400] seconds, got {args.budget:g}")
    if args.prepare is None and not args.no_build and not (args.bundle / bundle.MANIFEST).exists():
        p.error(f"--bundle: no bundle in {args.bundle}: make one with --prepare {args.bundle} where pip can "
                "download, or give --no-build to use the llama-cpp-python installed here")
    return args


def failure(what: str, rc: int | None, log_path: Path) -> str:
    """A line saying how a step's process ended, and why from its log."""
    how = ("stopped at the time limit" if rc is None else f"killed by {signal.Signals(-rc).name}" if rc < 0
           else f"exited {rc}: {build.failure_excerpt(log_path.read_text(errors='replace'))}")
    return f"{what}: {how} (log: {log_path.name})"


def build_step(args: argparse.Namespace, work: Path, env: dict, deadline: float, result: dict) -> Path | None:
    """The build, while a child writes the pair's F32 files: the Python of the other steps (None: failed)."""
    if args.no_build:
        result["build"] = {"installed": True}
        return Path(sys.executable)
    writer = None
    try:
        python, extra, cmake_args, facts = build.install(args.bundle.resolve(), work, cuda=not args.cpu)
        env.update(extra)
        with (work / "writer.log").open("w") as sink:
            writer = subprocess.Popen([python, "-m", "benchmarks.gpu.measure", work / "models", "--shapes", args.shapes,
                                       "--write-only"], stdout=sink, stderr=sink, cwd=ROOT, env=env)
        seconds = build.build_llama_cpp(python, work, env, cmake_args, deadline)
        result["build"] = {"seconds": seconds, "cmake_args": cmake_args, **facts}
        return python
    except (build.BuildFailed, bundle.BundleError, OSError) as exc:  # OSError: a tool that would not start
        result["problems"].append(f"build: {exc}")
        return None
    finally:
        if writer is not None:  # done before the measurement writes the same files
            try:
                writer.wait(timeout=max(0.1, deadline - time.time()) if "build" in result else 0.1)
            except subprocess.TimeoutExpired:
                writer.kill()
                writer.wait()


def measure_step(python: Path, args: argparse.Namespace, work: Path, out: Path, env: dict, deadline: float,
                 result: dict) -> dict | None:
    path = work / "measure.json"
    path.unlink(missing_ok=True)
    rc = build.run_logged([python, "-m", "benchmarks.gpu.measure", work / "models", "--shapes", args.shapes,
                           "--json", path], out / "measure.log", env, deadline)
    if rc != 0:
        result["problems"].append(failure("the cost curve", rc, out / "measure.log"))
        return None
    m = result["measure"] = json.loads(path.read_text())
    weights = [(k, v) for w in m["weights_mib"].values() for k, v in w.items()]
    on_device = sum(v for k, v in weights if not k.upper().startswith("CPU"))
    if not args.cpu and not (m["gpu_offload"] and on_device > 0.5 * sum(v for _, v in weights)):
        result["problems"].append(f"no offload: llama.cpp {'has' if m['gpu_offload'] else 'has no'} GPU backend, and "
                                  f"{on_device:.0f} of {sum(v for _, v in weights):.0f} MiB of weights are on a device")
    return m


def bench_step(python: Path, args: argparse.Namespace, m: dict, work: Path, out: Path, env: dict, deadline: float,
               result: dict) -> None:
    from localspec.settings.generation import VERIFIERS

    shutil.rmtree(work / "bench", ignore_errors=True)
    bench = shlex.split(args.bench) if args.bench is not None else ["--verifiers", ",".join(VERIFIERS), *BENCH.split()]
    cmd = [python, "-m", "localspec", "bench", "-m", m["target"], "-d", m["draft"], "--n-gpu-layers", "-1",
           *bench, "--out", work / "bench"]
    rc = build.run_logged(cmd, out / "bench.log", env, deadline, stdout=work / "bench.md")
    if rc != 0:
        result["problems"].append(failure("localspec bench", rc, out / "bench.log"))
        return
    table = [line for line in (work / "bench.md").read_text().splitlines() if line.startswith("|")]
    rows = json.loads((work / "bench" / "bench.json").read_text())["results"]
    result["bench"] = {"args": bench, "table": table, "results": rows}


def tests_step(python: Path, args: argparse.Namespace, out: Path, env: dict, deadline: float, result: dict) -> None:
    workers = min(12, (os.cpu_count() or 1) - 2)  # pytest-xdist, where the machine has it
    xdist = ["-n", str(workers)] if find_spec("xdist") is not None and workers >= 2 else []
    cmd = [python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--continue-on-collection-errors", *xdist,
           *shlex.split(args.tests)]
    env = {**env, "TESTS_N_GPU_LAYERS": "-1", "TESTS_SKIP_REAL_MODELS": "1", "COLUMNS": "240"}  # whole FAILED lines
    rc = build.run_logged(cmd, out / "tests.log", env, deadline - build.GRACE - 5, interrupt=True)
    t = result["tests"] = report.pytest_summary((out / "tests.log").read_text(errors="replace"), rc is None)
    if rc != 0:
        result["problems"].append(f"the test suite: {t['line']}" if t["line"] and rc is not None
                                  else failure("the test suite", rc, out / "tests.log"))


def check_main(args: argparse.Namespace) -> int:
    t0 = time.time()
    deadline, work = t0 + args.budget, args.work.resolve()
    out = (args.out or Path(os.environ.get("OUT") or work / "out")).resolve()
    for d in (work, out):
        d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LOCALSPEC_KEEP_ALIVE": "0", "LOCALSPEC_CACHE_DIR": str(work / "cache"),
           "LOCALSPEC_PROFILE_DIR": str(work / "profiles"), "LOCALSPEC_PROMPT_CACHE": "off", "PYTHONUNBUFFERED": "1"}
    result: dict = {"host": report.host(), "budget_s": args.budget, "argv": sys.argv[1:], "problems": []}

    def save(step: str) -> None:  # after every step: a run stopped from outside leaves what it had
        result["seconds"] = time.time() - t0
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "gpu_check.md").write_text(report.render(result))
        log.info("%s done, %.0f s left", step, deadline - time.time())

    python = build_step(args, work, env, deadline, result)
    save("build")
    if python is None:
        for path in work.glob("*.log"):  # the logs come back with the report
            shutil.copy(path, out / path.name)
    else:
        m = measure_step(python, args, work, out, env, deadline, result)
        save("the cost curve")
        if m is not None:
            bench_step(python, args, m, work, out, env, deadline, result)
            save("localspec bench")
        tests_step(python, args, out, env, deadline, result)
        save("the test suite")
    print(report.render(result), end="", flush=True)
    return 1 if result["problems"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="gpu_check: %(message)s")
    if args.prepare is None:
        return check_main(args)
    try:
        manifest = bundle.prepare(args.prepare)
    except (bundle.BundleError, subprocess.CalledProcessError) as exc:
        print(f"gpu_check --prepare: {exc}", file=sys.stderr)
        return 1
    print(bundle.summary(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
