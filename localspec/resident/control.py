"""What ``localspec ps`` and ``localspec stop`` ask of resident services (standard library only)."""

from __future__ import annotations

import time
from typing import Any

from localspec.resident import runtime
from localspec.resident.protocol import EXIT, STATUS, STOP, ProtocolError, loads

STOP_WAIT = 10.0  # seconds a stopped service has to end its call and exit


def status(record: runtime.Record) -> dict[str, Any] | None:
    """A service's live state (None: it is gone; its files are removed)."""
    channel = runtime.connect(record)
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
    channel = runtime.connect(record)
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
    while record.socket_path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def matches(record: runtime.Record, state: dict[str, Any], model: str) -> bool:
    """Whether `model` (a registry name, a path or a file name) names the service's target or draft."""
    from pathlib import Path

    names = {state.get("target_name"), state.get("target"), state.get("draft")}
    names |= {Path(n).name for n in list(names) if n} | {Path(n).stem for n in list(names) if n}
    if model in names:
        return True
    candidate = Path(model).expanduser()
    return candidate.exists() and str(candidate.resolve()) in names
