"""A call's stop: :class:`Cancel`, set once with its reason, which ends the call's wait for its
pair at once (:class:`Cancelled`) and its generation between two steps."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal, get_args

from localspec.errors import Cancelled  # a call stopped before it had its pair (Cancel.reason says why)

__all__ = ["STOPS", "Cancel", "Cancelled"]

Stop = Literal["interrupted", "terminated"]  # why a user stops a call (Ctrl-C, SIGTERM)
STOPS: tuple[str, ...] = get_args(Stop)


class Cancel:
    """One call's stop, set once with its reason: "interrupted" (Ctrl-C), "terminated"
    (SIGTERM), "gone" (its client went away) or "ending" (the service or server stops). A
    waiting call stops waiting at once (what waits is woken: :meth:`wake`); a generation stops
    between two steps, or at once during a prefill."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None
        self._wakes: list[Callable[[], None]] = []

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self._event.set()
        for wake in list(self._wakes):
            wake()

    def wake(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the thread that sets it) when it is set, or now if it is."""
        self._wakes.append(callback)
        if self._event.is_set():
            callback()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None) -> bool:
        return self._event.wait(timeout)
