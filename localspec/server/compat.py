"""What the server takes from uvicorn beyond its documented settings, in one place.

The server runs uvicorn through ``uvicorn.Config`` and ``uvicorn.Server.run``; two of its classes
are used further, and only here:

* its h11 protocol class (``uvicorn.protocols.http.h11_impl.H11Protocol``), held inside
  :class:`HeadDeadline`: the protocol class given to uvicorn's ``http`` setting
  (:func:`timed_protocol`), which closes a connection whose request head is not complete in
  time. uvicorn times out idle keep-alive connections but not a client that connects and sends
  nothing, or sends its head a byte at a time, and has no setting for that;
* ``uvicorn.Server.handle_exit``, extended by :class:`StoppingServer` so that a stopping server
  ends the running generations after their current step, before uvicorn's grace period runs out.

A uvicorn outside :data:`TESTED` (pyproject.toml requires the same) is refused when this module
is imported, with a :class:`~localspec.errors.DependencyError` that says what to install.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

from localspec.dependencies import require_tested

PACKAGE = "uvicorn"
TESTED = ">=0.29,<0.60"
INTERNALS = "its h11 protocol class (H11Protocol, wrapped) and Server.handle_exit (extended)"
VERSION = require_tested(PACKAGE, TESTED, INTERNALS)

import uvicorn  # noqa: E402 - after the version check: a uvicorn outside the range is refused, not imported
from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: E402

log = logging.getLogger(__name__)

HEAD_END = re.compile(rb"\n\r?\n")  # the blank line that ends a request head (h11 takes \n or \r\n lines)
MAX_HEAD_BYTES = 64 * 1024  # a head is watched this far; h11 refuses longer ones (16 KiB by default) itself


class HeadDeadline(asyncio.Protocol):
    """One connection: uvicorn's own HTTP protocol inside (every asyncio.Protocol call is passed
    on to it), and a timer that closes the connection when a request head is not complete within
    `header_timeout` seconds of connecting or of the end of the previous response.

    The timer stops when the bytes received hold the end of a head (blank lines before a head
    are no head: a client cannot keep a connection with them), and starts again when
    :meth:`arm` is called (``localspec.server.run.HeadTimeoutApp``: the response is complete)."""

    header_timeout: float = 10.0
    inner_protocol: type[asyncio.Protocol] = H11Protocol
    connections: dict[tuple[Any, ...], HeadDeadline]  # open ones by client address: each server's own (timed_protocol)

    def __init__(self, **kwargs: Any) -> None:  # what uvicorn passes its protocol class
        self.inner = self.inner_protocol(**kwargs)
        self.transport: asyncio.BaseTransport | None = None
        self.peer: tuple[Any, ...] | None = None
        self.head: bytearray | None = bytearray()  # the head so far (None: complete, the timer stopped)
        self._timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """Time the next request head (from now)."""
        self.disarm()
        self.head = bytearray()
        if self.transport is not None and not self.transport.is_closing():
            self._timer = asyncio.get_running_loop().call_later(self.header_timeout, self._expire)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.head is not None and self.transport is not None and not self.transport.is_closing():
            log.info("closing a connection whose request head did not arrive within %g s", self.header_timeout)
            self.transport.close()

    def _watch(self, data: bytes) -> None:
        """The next bytes of a head being timed: stop the timer once it is complete."""
        assert self.head is not None
        if len(self.head) < MAX_HEAD_BYTES:
            self.head += data[: MAX_HEAD_BYTES - len(self.head)]
        start = len(self.head) - len(self.head.lstrip(b"\r\n"))
        if HEAD_END.search(self.head, start):
            self.head = None
            self.disarm()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = tuple(peer[:2]) if isinstance(peer, (tuple, list)) and len(peer) >= 2 else None
        if self.peer is not None:
            self.connections[self.peer] = self
        self.inner.connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        if self.head is not None:
            self._watch(data)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if self.peer is not None and self.connections.get(self.peer) is self:
            del self.connections[self.peer]
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def timed_protocol(header_timeout: float) -> type[HeadDeadline]:
    """The protocol class for uvicorn's `http` setting: its h11 protocol, in connections that
    close when a request head takes longer than `header_timeout` seconds; each call makes a
    class with its own table of connections (``connections``), so two servers in one process
    never see each other's."""
    return type("HeadDeadlineH11", (HeadDeadline,), {"header_timeout": header_timeout, "connections": {}})


class StoppingServer(uvicorn.Server):
    """A uvicorn server that calls `on_exit()` when a signal stops it, before uvicorn's own
    handling of the signal (its graceful shutdown then waits for what `on_exit` ended)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)
