"""Running the app: the listening socket, uvicorn's settings, and a timeout for request heads.

Two details decide how the server behaves on a real network:

* the socket is made with ``IPPROTO_TCP`` so that asyncio recognises its connections as TCP and
  turns Nagle's algorithm off (``TCP_NODELAY``); with protocol 0 it does not, and every
  keep-alive response waits for the client's delayed ACK (~40 ms on Linux);
* uvicorn times out idle keep-alive connections but not a client that connects and sends
  nothing, or sends its request head a byte at a time, and it has no setting for that. uvicorn's
  ``http`` setting takes a protocol class: :func:`timed_protocol` gives one that holds uvicorn's
  h11 protocol (composition, every call passed on) and closes a connection whose request head
  is not complete within ``header_timeout`` seconds, telling the head's end from the bytes
  themselves (the blank line that ends it, as h11 reads it). :class:`HeadTimeoutApp`, an ASGI
  middleware, starts the timer again when a response is complete, finding the connection by the
  request's ``client`` address (the ASGI scope's, with uvicorn's proxy headers off so a client
  cannot rename itself); where it cannot, the response closes its connection
  (``Connection: close``), so no second head can follow. The body's time is bounded by the app
  (``body_timeout``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from localspec.settings.generation import DEFAULTS, GenerationConfig
from localspec.errors import ConfigError
from localspec.server import ServerLimits
from localspec.server.app import create_app
from localspec.server.jobs import Pair

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket on host:port (port 0: a free one); ConfigError when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as exc:  # the name does not resolve: the host is at fault, not the port
        sock.close()
        raise ConfigError(f"cannot listen on {host!r}: {exc.strerror or exc}; give an address of this machine "
                          "(127.0.0.1, 0.0.0.0, ::1) or a name that resolves to one", "host") from None
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port or --host",
                          "port") from None
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


HEAD_END = re.compile(rb"\n\r?\n")  # the blank line that ends a request head (h11 takes \n or \r\n lines)
MAX_HEAD_BYTES = 64 * 1024  # a head is watched this far; h11 refuses longer ones (16 KiB by default) itself


class _HeadDeadline(asyncio.Protocol):
    """One connection: uvicorn's own HTTP protocol inside (every asyncio.Protocol call is passed
    on to it), and a timer that closes the connection when a request head is not complete within
    `header_timeout` seconds of connecting or of the end of the previous response.

    The timer stops when the bytes received hold the end of a head (blank lines before a head
    are no head: a client cannot keep a connection with them), and starts again when
    :class:`HeadTimeoutApp` says the response is complete."""

    header_timeout: float = 10.0
    inner_protocol: type[asyncio.Protocol] = H11Protocol
    connections: dict[tuple[Any, ...], "_HeadDeadline"]  # open ones by client address: each server's own (timed_protocol)

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
        self.inner.data_received(data)  # type: ignore[attr-defined]

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if self.peer is not None and self.connections.get(self.peer) is self:
            del self.connections[self.peer]
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def timed_protocol(header_timeout: float) -> type[_HeadDeadline]:
    """The protocol class for uvicorn's `http` setting: its h11 protocol, in connections that
    close when a request head takes longer than `header_timeout` seconds (with HeadTimeoutApp,
    given its `connections`); each call makes a class with its own table of connections, so two
    servers in one process never see each other's."""
    return type("HeadDeadlineH11", (_HeadDeadline,), {"header_timeout": header_timeout, "connections": {}})


class HeadTimeoutApp:
    """ASGI middleware that starts a connection's head timer (timed_protocol) again when its
    response is complete, finding the connection by the request's client address; a response
    whose connection it cannot find closes the connection (``Connection: close``)."""

    def __init__(self, app: Any, connections: dict[tuple[Any, ...], _HeadDeadline]) -> None:
        self.app = app
        self.connections = connections  # the server's open connections (its timed_protocol's)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        connection = self.connections.get(tuple(client[:2])) if client else None

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start" and connection is None:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)
            if (connection is not None and message["type"] == "http.response.body"
                    and not message.get("more_body", False)):
                connection.arm()

        await self.app(scope, receive, sending)


def uvicorn_config(app: Any, limits: ServerLimits, verbose: bool = False) -> uvicorn.Config:
    # proxy_headers off: a client's X-Forwarded-For must not rename it (HeadTimeoutApp finds
    # connections by the client address; no proxy stands before this server)
    protocol = timed_protocol(limits.header_timeout)
    return uvicorn.Config(HeadTimeoutApp(app, protocol.connections), http=protocol, lifespan="on",
                          log_level="info" if verbose else "warning", access_log=verbose,
                          timeout_graceful_shutdown=3, timeout_keep_alive=5, proxy_headers=False)


def serve(pair: Pair, *, model_id: str, sock: socket.socket, defaults: GenerationConfig = DEFAULTS,
          limits: ServerLimits = ServerLimits(), verbose: bool = False) -> bool:
    """Serve until interrupted (Ctrl-C: a graceful shutdown, waiting at most 3 s for open requests).
    Returns True when no generation is left running, so the models may be closed."""
    app = create_app(pair, model_id=model_id, defaults=defaults, limits=limits)
    residency = pair.residency

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            residency.end("the server is stopping")  # open responses end after the current step, with what they have
            super().handle_exit(sig, frame)

    try:
        Server(uvicorn_config(app, limits, verbose)).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        sock.close()
    return residency.close()
