"""Running the app: the listening socket, uvicorn's settings, and a timeout for request heads.

Two details decide how the server behaves on a real network:

* the socket is made with ``IPPROTO_TCP`` so that asyncio recognises its connections as TCP and
  turns Nagle's algorithm off (``TCP_NODELAY``); with protocol 0 it does not, and every
  keep-alive response waits for the client's delayed ACK (~40 ms on Linux);
* uvicorn times out idle keep-alive connections but not a client that connects and sends
  nothing, or sends its request head a byte at a time: :class:`TimedH11Protocol` closes a
  connection whose request head is not complete within ``header_timeout`` seconds.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from localspec.config import DEFAULTS, GenerationConfig
from localspec.errors import ConfigError
from localspec.model import Model
from localspec.server import ServerLimits
from localspec.server.app import create_app
from localspec.server.worker import ModelWorker

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket on host:port (port 0: a free one); ConfigError when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port or --host",
                          "port") from None
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def timed_protocol(header_timeout: float) -> type:
    """uvicorn's h11 protocol, closing connections whose request head takes longer than
    `header_timeout` seconds (from connecting, or from the end of the previous response)."""

    class TimedH11Protocol(H11Protocol):
        _deadline: Any = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                log.info("closing a connection whose request head did not arrive within %g s", header_timeout)
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request head arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedH11Protocol


def uvicorn_config(app: Any, limits: ServerLimits, verbose: bool = False) -> uvicorn.Config:
    return uvicorn.Config(app, http=timed_protocol(limits.header_timeout), lifespan="on",
                          log_level="info" if verbose else "warning", access_log=verbose,
                          timeout_graceful_shutdown=3, timeout_keep_alive=5)


def serve(target: Model, draft: Model | None, *, model_id: str, sock: socket.socket,
          defaults: GenerationConfig = DEFAULTS, limits: ServerLimits = ServerLimits(),
          verbose: bool = False) -> bool:
    """Serve until interrupted (Ctrl-C: a graceful shutdown, waiting at most 3 s for open requests).
    Returns True when no generation is left running, so the models may be closed."""
    app = create_app(target, draft, model_id=model_id, defaults=defaults, limits=limits)
    worker: ModelWorker = app.state.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            worker.stop()  # open responses end after the current step, with what they have
            super().handle_exit(sig, frame)

    try:
        Server(uvicorn_config(app, limits, verbose)).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        sock.close()
    return worker.close()
