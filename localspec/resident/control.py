"""What ``localspec ps`` and ``localspec stop`` ask of resident services (standard library only)."""

from __future__ import annotations

import os
import time
from typing import Any

from localspec import environment
from localspec.resident import runtime
from localspec.resident.protocol import EXIT, STATUS, STOP, ProtocolError, loads

STOP_WAIT = 10.0  # seconds a stopped service has to end its call and exit
ANSWER_WAIT = 10.0  # seconds a service has to answer a status query or a stop


def status(record: runtime.Record) -> dict[str, Any] | None:
    """A service's live state (None: it is gone; its files are removed)."""
    channel = runtime.connect(record, timeout=ANSWER_WAIT)
    if channel is None:
        return None
    try:
        channel.send(STATUS)
        frame = channel.recv()
        if frame is None or frame[0] != STATUS:
            return None
        value = loads(frame[1])
        return value if isinstance(value, dict) else None
    except (OSError, ProtocolError):
        return None
    finally:
        channel.close()


def services() -> list[tuple[runtime.Record, dict[str, Any]]]:
    """Every live service with its state, most recently started first."""
    out = []
    for record in runtime.records():
        state = status(record)
        if state is not None:
            out.append((record, state))
    return out


def stop_service(record: runtime.Record, reason: str = "") -> bool:
    """Ask a service to end (its running call stops within a step) and wait until its socket is
    gone; False when it was not running."""
    channel = runtime.connect(record, timeout=ANSWER_WAIT)
    if channel is None:
        return False
    try:
        channel.send_json(STOP, {"reason": reason})
        frame = channel.recv()
        if frame is None or frame[0] != EXIT:
            return False
    except (OSError, ProtocolError):
        return False
    finally:
        channel.close()
    deadline = time.monotonic() + STOP_WAIT
    while (record.socket_path.exists() or _running(record.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)  # until the process is gone: its memory is free for what follows
    return True


def _running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def matches(record: runtime.Record, state: dict[str, Any], model: str) -> bool:
    """Whether `model` (a registry name, a path or a file name) names the service's target or draft."""
    from pathlib import Path

    names = {state.get("target_name"), state.get("target"), state.get("draft")}
    names |= {Path(n).name for n in list(names) if n} | {Path(n).stem for n in list(names) if n}
    if model in names:
        return True
    candidate = Path(model).expanduser()
    return candidate.exists() and str(candidate.resolve()) in names


# ---------------------------------------------------------------- what `localspec ps` shows


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def model_name(state: dict[str, Any]) -> str:
    """A registry name as it is, a file by its name."""
    name = state.get("target_name") or state.get("target") or "?"
    return os.path.basename(name) if name.lower().endswith(".gguf") else name


def rows() -> list[dict[str, Any]]:
    """Every live resident service as `localspec ps --json` shows it."""
    out = []
    for record, state in services():
        out.append({"id": record.id, "pid": state.get("pid"), "model": model_name(state),
                     "target": state.get("target"), "draft": state.get("draft"),
                     "draft_loaded": bool(state.get("draft_loaded")), "memory_bytes": state.get("memory", 0),
                     "idle_seconds": round(float(state.get("idle") or 0), 1),
                     "left_seconds": None if state.get("left") is None else round(float(state["left"]), 1),
                     "keep_alive_seconds": state.get("keep_alive"), "busy": bool(state.get("busy")),
                     "waiting": state.get("waiting", 0), "requests": state.get("served", 0),
                     "last_call_seconds": state.get("last_call_seconds")})
    return out


def describe_rows(rows: list[dict[str, Any]]) -> list[str]:
    """`localspec ps`'s table (also in `localspec info`)."""
    if not rows:
        return ["no resident models (a call keeps its models loaded for --keep-alive, default 5m)"]
    lines = [f"{'MODEL':<28} {'DRAFT':<22} {'MEMORY':>9} {'IDLE':>7} {'LEFT':>7} {'CALLS':>5}  PID"]
    for r in rows:
        draft = os.path.basename(r["draft"] or "-") + ("" if r["draft_loaded"] or not r["draft"] else " (not loaded)")
        left = "busy" if r["busy"] else environment.format_duration(round(r["left_seconds"] or 0))
        lines.append(f"{r['model'][:28]:<28} {draft[:22]:<22} {_size(r['memory_bytes'] or 0):>9} "
                     f"{environment.format_duration(round(r['idle_seconds'])):>7} {left:>7} {r['requests']:>5}  {r['pid']}")
    return lines
