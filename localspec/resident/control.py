"""What ``localspec ps`` and ``localspec stop`` ask of resident services: their status (the core's
one status type, :mod:`localspec.core.status`) and to unload pairs."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from localspec.core.status import CoreStatus, PairStatus
from localspec.core.wire import Malformed, parse_status, parse_stopped
from localspec.resident import runtime
from localspec.resident.protocol import STATUS, STOP, ProtocolError

log = logging.getLogger(__name__)

ANSWER_WAIT = 10.0  # seconds a service has to answer a status query
STOP_WAIT = 40.0  # seconds a service has to stop its pairs' calls and unload them (and end, for all)


def _ask(path: Path, kind: bytes, value: Any, timeout: float) -> bytes | None:
    """A service's answer, its JSON unread (None: it is gone, or did not answer with a frame of
    the kind asked)."""
    channel = runtime.connect(path, timeout=timeout)
    if channel is None:
        return None
    try:
        channel.send(kind, value)
        frame = channel.recv()
        return frame[1] if frame is not None and frame[0] == kind else None
    except (OSError, ProtocolError):
        return None
    finally:
        channel.close()


def status(path: Path) -> CoreStatus | None:
    """The status of the service at `path` (None: gone; one that sends no status is skipped)."""
    answer = _ask(path, STATUS, {}, ANSWER_WAIT)
    if answer is None:
        return None
    try:
        return parse_status(answer)
    except Malformed as exc:
        log.warning("the service at %s answered a malformed status (%s); left out", path, exc)
        return None


def services() -> list[tuple[Path, CoreStatus]]:
    """Every live service with its status."""
    found = []
    for path in runtime.sockets():
        state = status(path)
        if state is not None:
            found.append((path, state))
    return found


def stop(path: Path, targets: list[str] | None) -> list[PairStatus]:
    """Unload the pairs of these targets (None: all, and the service ends, its socket gone once
    this returns); the pairs unloaded."""
    answer = _ask(path, STOP, {"targets": targets}, STOP_WAIT)
    if answer is None:
        return []
    try:
        stopped = parse_stopped(answer)
    except Malformed as exc:
        log.warning("the service at %s answered a malformed stop (%s)", path, exc)
        stopped = []
    if targets is None:
        deadline = time.monotonic() + STOP_WAIT
        while _listening(path) and time.monotonic() < deadline:
            time.sleep(0.05)  # until it is gone: its memory is free for what follows
    return stopped


def _listening(path: Path) -> bool:
    channel = runtime.connect(path, timeout=1.0)
    if channel is None:
        return False
    channel.close()
    return True
