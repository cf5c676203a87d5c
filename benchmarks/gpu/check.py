"""The GPU check (docs/gpu.md): builds llama-cpp-python with CUDA from the bundle made with --prepare,
measures the shaped default pair's cost curve and `localspec bench` of every verifier on it, and runs
the test suite with TESTS_N_GPU_LAYERS=-1, within --budget seconds. Each step is a child process, so
a crash inside llama.cpp is reported and the next step still runs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from benchmarks.gpu import build

ROOT = build.ROOT
BUDGET = 540.0  # seconds: 9 minutes, the build included
BENCH = "--shapes k4,p3k4,t3x2x1 --temperatures 0,0.8 --prompts code --raw -n 64"  # and every verifier
COUNTS = r"\d+ (passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b"  # in pytest's summary line
log = logging.getLogger("gpu_check")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0], epilog="See docs/gpu.md.")
    p.add_argument("--prepare", type=Path, metavar="DIR", help="make the bundle in DIR (needs network) and stop")
    p.add_argument("--bundle", type=Path, default=ROOT / ".gpu-bundle", help="the bundle (default: .gpu-bundle)")
    p.add_argument("--work", type=Path, default=ROOT / ".gpu-build", help="what is built, kept (default: .gpu-build)")
    p.add_argument("--no-build", action="store_true", help="use the llama-cpp-python installed here")
    p.add_argument("--cpu", action="store_true", help="a dry run: a CPU build, a small pair, no GPU")
    p.add_argument("--budget", type=float, default=BUDGET, help=f"seconds for all of it (default {BUDGET:.0f})")
    p.add_argument("--bench", metavar="ARGS", help=f"localspec bench's arguments (default: every verifier, {BENCH})")
    p.add_argument("--tests", default="tests", metavar="ARGS", help="pytest's arguments (default: tests)")
    args = p.parse_args(argv)
    if not 60 <= args.budget <= 86400:
        p.error(f"--budget must lie in [60, 86400] seconds, got {args.budget:g}")
    if args.prepare is None and not args.no_build and not (args.bundle / build.MANIFEST).exists():
        p.error(f"--bundle: no bundle in {args.bundle}: make one with --prepare {args.bundle} where pip can "
                "download, or give --no-build to use the llama-cpp-python installed here")
    args.shapes = "small" if args.cpu else "default"  # of the measured pair (measure.SHAPES)
    return args


@dataclass
class Check:
    """One run: its options, folders, children's environment, deadline and result (the report's data)."""
    args: argparse.Namespace
    work: Path
    out: Path
    env: dict[str, str]
    deadline: float
    result: dict

    def run(self, what: str, cmd: list, log_name: str, ok: tuple[int, ...] = (0,),
            stdout: Path | None = None) -> int | None:
        """A step's command (build.run): its exit status, recorded as a problem unless `ok`."""
        rc = build.run(cmd, self.out / log_name, self.env, self.deadline, stdout)
        if rc not in ok:
            self.result["problems"].append(build.failure(what, rc, self.out / log_name))
        return rc


def build_step(c: Check) -> Path | None:
    """The build, while a child writes the pair's F32 files: the Python of the other steps (None: failed)."""
    if c.args.no_build:
        c.result["build"] = {"installed": True}
        return Path(sys.executable)
    writer = None
    try:
        python, extra, cmake_args = build.install(c.args.bundle.resolve(), c.work, not c.args.cpu)
        c.env.update(extra)
        writer = subprocess.Popen([python, "-m", "benchmarks.gpu.measure", c.work / "models", c.args.shapes],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=c.env)
        seconds = build.compile_llama_cpp(python, c.work, c.env, cmake_args, c.deadline)
        c.result["build"] = {"seconds": seconds, "cmake_args": cmake_args}
        return python
    except (build.BuildFailed, OSError) as exc:  # OSError: a tool that would not start
        c.result["problems"].append(f"build: {exc}")
        for path in c.work.glob("*.log"):  # the logs come back with the report
            shutil.copy(path, c.out / path.name)
        return None
    finally:
        if writer is not None:  # done before the measurement writes the same files; not needed if the build failed
            if "build" not in c.result:
                writer.kill()
            writer.wait()


def measure_and_bench(c: Check, python: Path) -> None:
    """The cost curve, then `localspec bench` of every verifier on the measured pair."""
    from localspec.settings.generation import VERIFIERS

    path = c.work / "measure.json"
    if c.run("the cost curve", [python, "-m", "benchmarks.gpu.measure", c.work / "models", c.args.shapes, path],
             "measure.log") != 0:
        return
    m = c.result["measure"] = json.loads(path.read_text())
    mib = [(k, v) for w in m["weights_mib"].values() for k, v in w.items()]  # k: CPU, CPU_Mapped, CUDA0, ...
    on_gpu, total = sum(v for k, v in mib if not k.upper().startswith("CPU")), sum(v for _, v in mib)
    if not c.args.cpu and on_gpu <= 0.5 * total:
        c.result["problems"].append(f"no offload: {on_gpu:.0f} of {total:.0f} MiB of weights are on a GPU")
    bench = ["--verifiers", ",".join(VERIFIERS), *BENCH.split()] if c.args.bench is None else shlex.split(c.args.bench)
    if c.run("localspec bench", [python, "-m", "localspec", "bench", "-m", m["target"], "-d", m["draft"],
                                 "--n-gpu-layers", "-1", *bench, "--out", c.work / "bench"], "bench.log",
             stdout=c.work / "bench.md") == 0:
        c.result["bench"] = {"args": bench, "results": json.loads((c.work / "bench/bench.json").read_text())["results"],
                             "table": [t for t in (c.work / "bench.md").read_text().splitlines() if t.startswith("|")]}


def tests_step(c: Check, python: Path) -> None:
    """The test suite, every layer offloaded, in parallel where pytest-xdist is there."""
    workers = min(12, (os.cpu_count() or 1) - 2)
    xdist = ["-n", str(workers)] if find_spec("xdist") is not None and workers >= 2 else []
    cmd = [python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--continue-on-collection-errors", *xdist,
           *shlex.split(c.args.tests)]
    rc = c.run("the test suite", cmd, "tests.log", ok=(0, 1))
    t = c.result["tests"] = pytest_summary((c.out / "tests.log").read_text(errors="replace"), rc is None)
    if rc == 1:  # tests failed
        c.result["problems"].append(f"the test suite: {t['line']}")


def pytest_summary(output: str, stopped: bool) -> dict:
    """A pytest run's summary line, its FAILED and ERROR lines, and whether the time limit `stopped` it."""
    lines = output.splitlines()
    last = next((line for line in reversed(lines) if re.search(COUNTS, line)), "")
    return {"line": last.strip(" ="), "stopped": stopped,
            "failed": [line for line in lines if line.startswith(("FAILED ", "ERROR "))]}


def render(result: dict) -> str:
    """The markdown report of one run's result (docs/gpu.md, "Reading its output")."""
    b, m, t = result.get("build") or {}, result.get("measure"), result.get("tests")
    built = ("installed here" if b.get("installed") else "not built" if "seconds" not in b else
             f"built in {b['seconds']:.0f} s with {' '.join(b['cmake_args'])}")
    lines = ["# localspec GPU check", "", f"Host: {result['host']}. llama-cpp-python "
             + (f"{m['llama_cpp']} ({built}): {m['build']}. " if m else f"{built}. ")
             + f"{result.get('seconds', 0):.0f} s of a {result['budget_s']:.0f} s budget.", ""]
    if m:
        c1 = m["curve"]["1"]
        mib = {k: ", ".join(f"{n} {v:.0f} MiB" for n, v in sorted(w.items())) for k, w in m["weights_mib"].items()}
        lines += ["## Cost of one pass", "", f"The {m['shapes']} pair's shapes in Q4_K_M, every layer offloaded "
                  f"(target weights: {mib['target']}; draft: {mib['draft']}); the median of {m['rounds']} passes.", "",
                  "| model | n | c(n) | c(n) / the target's c(1) |", "| --- | ---: | ---: | ---: |",
                  *(f"| target | {n} | {s * 1e3:.2f} ms | {s / c1:.2f} |" for n, s in m["curve"].items()),
                  f"| draft | 1 | {m['draft_c1'] * 1e3:.2f} ms | {m['draft_c1'] / c1:.2f} |", ""]
    if m and result.get("bench"):
        lines += ["## Speedups per verifier", "", f"`localspec bench` on that pair, whose draft predicts the "
                  f"target's next token after {m['agreement']:.0%} of tokens.", "", *result["bench"]["table"], ""]
    if t:
        lines += ["## The test suite, every layer offloaded", "",
                  (t["line"] or "no summary") + (" (stopped at the time limit: the rest did not run)" * t["stopped"]),
                  "", *(f"- {line}" for line in t["failed"]), ""]
    if result["problems"]:
        lines += ["## Problems", "", *(f"- {p}" for p in result["problems"]), ""]
    return "\n".join(lines).rstrip() + "\n"


def check(args: argparse.Namespace) -> int:
    """The steps in turn, the report saved after each; 0 when every step ran and every test passed, else 1."""
    from localspec.llama.host import cpuinfo

    t0, work = time.time(), args.work.resolve()
    out = Path(os.environ.get("OUT") or work / "out").resolve()
    for d in (work, out):
        d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LOCALSPEC_KEEP_ALIVE": "0", "LOCALSPEC_CACHE_DIR": str(work / "cache"),
           "LOCALSPEC_PROFILE_DIR": str(work / "profiles"), "LOCALSPEC_PROMPT_CACHE": "off", "PYTHONUNBUFFERED": "1",
           "TESTS_N_GPU_LAYERS": "-1", "TESTS_SKIP_REAL_MODELS": "1", "COLUMNS": "240"}  # COLUMNS: whole FAILED lines
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30
    host = f"{cpuinfo('model name')}, {os.cpu_count()} cores, {memory} GiB; GPU: {'; '.join(build.gpus()) or 'none'}"
    c = Check(args, work, out, env, t0 + args.budget, {"host": host, "budget_s": args.budget, "problems": []})

    def save(step: str) -> None:
        c.result["seconds"] = time.time() - t0
        (out / "gpu_check.json").write_text(json.dumps(c.result, indent=1) + "\n")
        (out / "gpu_check.md").write_text(render(c.result))
        log.info("%s done, %.0f s left", step, c.deadline - time.time())

    python = build_step(c)
    save("the build")
    if python is not None:
        measure_and_bench(c, python)
        save("the cost curve and localspec bench")
        tests_step(c, python)
        save("the test suite")
    print(render(c.result), end="", flush=True)
    return 1 if c.result["problems"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="gpu_check: %(message)s")
    if args.prepare is None:
        return check(args)
    try:
        m = build.prepare(args.prepare)
    except (build.BuildFailed, subprocess.CalledProcessError) as exc:
        print(f"gpu_check --prepare: {exc}", file=sys.stderr)
        return 1
    mib = (m["source"]["bytes"] + sum(w["bytes"] for w in m["wheels"])) / 2**20
    print(f"{args.prepare}: llama-cpp-python {m['llama_cpp_python']}'s source, {m['source']['files']} files, and "
          f"{len(m['wheels'])} wheels: {mib:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
