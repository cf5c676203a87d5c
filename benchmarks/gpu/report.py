"""The GPU check's report (benchmarks/gpu/check.py): the host, pytest's outcome read from its
output, and the markdown made from one run's result."""

from __future__ import annotations

import os
import platform
import re
import subprocess

COUNTS = r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b"


def gpus(fields: tuple[str, ...] = ("name", "driver_version", "memory.total", "compute_cap")) -> list[str]:
    """A line of `fields` for each GPU nvidia-smi sees (none without it)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def host() -> dict:
    """The CPU, cores, memory and Python of this machine, and its GPUs."""
    from localspec.llama.host import cpuinfo

    return {"cpu": cpuinfo("model name") or platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30), "gpus": gpus()}


def pytest_summary(output: str, stopped: bool) -> dict:
    """What a pytest run's output says: its last summary line, the counts in it, the FAILED and
    ERROR lines of its short summary, and whether the time limit `stopped` it."""
    lines = output.splitlines()
    last = next((line for line in reversed(lines) if re.search(COUNTS, line)), "")
    counts = {("error" if kind.startswith("error") else kind): int(n) for n, kind in re.findall(COUNTS, last)}
    return {"line": last.strip(" ="), "counts": counts, "stopped": stopped,
            "failed": [line for line in lines if line.startswith(("FAILED ", "ERROR "))]}


def _mib(buffers: dict[str, float]) -> str:
    return ", ".join(f"{name} {mib:.0f} MiB" for name, mib in sorted(buffers.items())) or "none reported"


def _curve(m: dict) -> list[str]:
    curve = {int(n): s for n, s in m["curve"].items()}
    pair = "The default pair's shapes" if m["shapes"] == "default" else "A small pair (a dry run)"
    lines = ["## Cost of one target pass", "",
             f"{pair}, Q4_K_M, every layer offloaded (target weights: {_mib(m['weights_mib']['target'])}; draft: "
             f"{_mib(m['weights_mib']['draft'])}). c(n): one pass of n tokens with every row's logits, what verifying "
             f"n - 1 drafted tokens costs; the median of {m['rounds']}.", "",
             "| n | c(n) | c(n)/c(1) |", "| ---: | ---: | ---: |"]
    lines += [f"| {n} | {s * 1e3:.2f} ms | {s / curve[1]:.2f} |" for n, s in sorted(curve.items())]
    return lines + ["", f"The draft's c(1): {m['draft_c1'] * 1e3:.2f} ms, {m['draft_c1'] / curve[1]:.2f} of the target's."]


def render(result: dict) -> str:
    """The report of one run (check.py's result: host, build, measure, bench, tests, problems)."""
    h, build, m = result["host"], result.get("build") or {}, result.get("measure")
    how = "by an earlier run" if build.get("seconds") is None else f"in {build.get('seconds', 0):.0f} s"
    built = ("installed" if build.get("installed") else
             f"built {how} with {' '.join(build['cmake_args'])}" if "cmake_args" in build else "not built")
    lines = ["# localspec GPU check", "",
             f"Host: {h['cpu']}, {h['cores']} cores, {h['memory_gib']} GiB; GPU: {'; '.join(h['gpus']) or 'none seen'}. "
             + (f"llama-cpp-python {m['llama_cpp']} ({built}): {m['build']}. " if m else f"llama-cpp-python {built}. ")
             + f"{result.get('seconds', 0):.0f} s of a {result['budget_s']:.0f} s budget.", ""]
    if m:
        lines += _curve(m) + [""]
    if result.get("bench"):
        lines += ["## Speedups per verifier", "",
                  f"`localspec bench` on that pair, both models offloaded. Its draft predicts the target's next token "
                  f"after {m['agreement']:.0%} of tokens (acceptance below): the speedups at that "
                  "acceptance on this machine, not the real pair's.", "", *result["bench"]["table"], ""]
    t = result.get("tests")
    if t:
        lines += ["## The test suite, every layer offloaded", "",
                  (t["line"] or "no summary") + (" (stopped at the time limit: the rest did not run)" * t["stopped"]),
                  "", *(f"- {line}" for line in t["failed"]), ""]
    if result["problems"]:
        lines += ["## Problems", "", *(f"- {p}" for p in result["problems"]), ""]
    return "\n".join(lines).rstrip() + "\n"
