"""The GPU check's record: one JSON state file (written after every step, so a crash loses
nothing done before it) and the markdown report made from it (benchmarks/gpu_check.py)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

JSON_NAME = "gpu_check.json"
MD_NAME = "gpu_check.md"
STATUSES = ("pending", "running", "ok", "partial", "failed", "skipped")
INT_KEYED = ("curve_target", "curve_draft")  # facts whose keys are pass sizes (JSON makes them strings)


def new_state(mode: str, scale: str, budget: float, steps: Iterable[str], argv: list[str], work: Path) -> dict:
    now = time.time()
    return {"version": 1, "mode": mode, "scale": scale, "started": now, "deadline": now + budget, "budget_s": budget,
            "argv": argv, "work": str(work), "machine": machine(), "paths": {}, "facts": {},
            "steps": [{"name": n, "status": "pending"} for n in steps]}


def save(state: dict, path: Path) -> None:
    """Atomic: a reader (the parent process, a crash afterwards) sees the old or the new state, whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def load(path: Path) -> dict:
    state = json.loads(path.read_text())
    for key in INT_KEYED:
        if key in state["facts"]:
            state["facts"][key] = {int(n): v for n, v in state["facts"][key].items()}
    return state


def step(state: dict, name: str) -> dict:
    return next(s for s in state["steps"] if s["name"] == name)


def pending(state: dict) -> list[str]:
    return [s["name"] for s in state["steps"] if s["status"] in ("pending", "running")]


def record(state: dict, name: str, status: str, seconds: float | None = None, summary: str = "",
           data: dict | None = None) -> None:
    assert status in STATUSES, status
    entry = step(state, name)
    entry.update(status=status, summary=summary)
    if seconds is not None:
        entry["seconds"] = round(seconds, 2)
    if data is not None:
        entry["data"] = data


def skip_rest(state: dict, why: str) -> None:
    for s in state["steps"]:
        if s["status"] in ("pending", "running"):
            s.update(status="skipped", summary=why)


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine() -> dict:
    """The host: CPU, cores, memory, Python, and the GPUs nvidia-smi sees."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"])
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                                                      / 2**30), "python": platform.python_version(),
            "gpus": [g.strip() for g in gpus.splitlines()] if gpus else []}


# ---------------------------------------------------------------- markdown


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(state: dict) -> str:
    m = state["machine"]
    elapsed = state.get("finished", time.time()) - state["started"]
    counts = {st: sum(s["status"] == st for s in state["steps"]) for st in ("ok", "partial", "failed", "skipped")}
    lines = [f"# localspec GPU check ({state['mode']}, {state['scale']} scale)", "",
             f"Host: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; Python {m['python']}; GPU: "
             + ("; ".join(m["gpus"]) if m["gpus"] else "none seen by nvidia-smi") + ".",
             f"{len(state['steps'])} steps, {elapsed:.0f} s of a {state['budget_s']:.0f} s budget: "
             + ", ".join(f"{n} {k}" for k, n in counts.items() if n) + ".", "",
             "| step | status | seconds | result |", "| --- | --- | ---: | --- |"]
    for s in state["steps"]:
        secs = f"{s['seconds']:.1f}" if "seconds" in s else ""
        lines.append(f"| {s['name']} | {s['status']} | {secs} | {_cell(s.get('summary', ''))} |")
    lines += _curve_table(state) + _share_table(state) + _planner_table(state)
    prediction = _data(state, "prediction")
    if prediction:
        lines += ["", "## Predicted speedups of the default pair", "", prediction["markdown"]]
    return "\n".join(lines) + "\n"


def _data(state: dict, name: str) -> dict | None:
    s = next((s for s in state["steps"] if s["name"] == name), None)
    return s.get("data") if s and s["status"] in ("ok", "partial") else None


def _curve_table(state: dict) -> list[str]:
    d = _data(state, "cost_curve")
    if not d:
        return []
    ct = {int(n): v for n, v in d["target_seconds"].items()}
    cd = {int(n): v for n, v in d["draft_seconds"].items()}
    lines = ["", "## Pass cost on this machine (shaped models, all layers offloaded)", "",
             f"Draft c(1) / target c(1) = {d['draft_over_target']:.3f}. Weights: target "
             + ", ".join(f"{k} {v:.0f} MiB" for k, v in sorted(d["weight_buffers_mib"]["target"].items()))
             + "; draft " + ", ".join(f"{k} {v:.0f} MiB" for k, v in sorted(d["weight_buffers_mib"]["draft"].items())) + ".",
             "", "| n | target c(n) | c(n)/c(1) | draft c(n) | c(n)/c(1) |", "| ---: | ---: | ---: | ---: | ---: |"]
    for n in sorted(ct):
        draft = f"{cd[n] * 1e3:.2f} ms | {cd[n] / cd[1]:.2f}" if n in cd else "— | —"
        lines.append(f"| {n} | {ct[n] * 1e3:.2f} ms | {ct[n] / ct[1]:.2f} | {draft} |")
    return lines


def _share_table(state: dict) -> list[str]:
    d = _data(state, "verifier_share")
    if not d:
        return []
    lines = ["", "## Verifiers at the default sampling (shaped pair, plan fixed)", "",
             "| verifier | shape | verifier share | verify ms/step | draft ms/step | target ms/step | tok/s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for v, r in d.items():
        shape = ", ".join(f"{k}={val}" for k, val in r["shape"].items())
        lines.append(f"| {v} | {shape} | {100 * r['verifier_share']:.2f} % | {r['verify_ms_per_step']:.3f} | "
                     f"{r['draft_ms_per_step']:.2f} | {r['target_ms_per_step']:.2f} | {r['tokens_per_second']:.1f} |")
    return lines


def _planner_table(state: dict) -> list[str]:
    d = _data(state, "planner")
    if not d:
        return []
    lines = ["", "## The planner on this cost profile", "",
             f"`--drafter auto` loads the draft model (prompt {d['prompt_tokens']} tokens, {d['remaining']} to go): "
             f"**{'yes' if d['loads_draft'] else 'no'}**.", "",
             "| per-level acceptance α | depth chosen | predicted speedup |", "| ---: | ---: | ---: |"]
    for key, v in d.items():
        if key.startswith("alpha "):
            lines.append(f"| {key[6:]} | {v['depth']} | {v['predicted_speedup']:.2f}× |")
    return lines
