"""Running the app: the listening socket, uvicorn's settings, and a timeout for request heads.

Two details decide how the server behaves on a real network:

* the socket is made with ``IPPROTO_TCP`` so that asyncio recognises its connections as TCP and
  turns Nagle's algorithm off (``TCP_NODELAY``); with protocol 0 it does not, and every
  keep-alive response waits for the client's delayed ACK (~40 ms on Linux);
* uvicorn times out idle keep-alive connections but not a client that connects and sends
  nothing, or sends its request head a byte at a time, and it has no setting for that. uvicorn's
  ``http`` setting takes a protocol class: ``compat.timed_protocol`` gives one that holds
  uvicorn's h11 protocol (composition, every call passed on) and closes a connection whose
  request head is not complete within ``header_timeout`` seconds, telling the head's end from
  the bytes themselves (the blank line that ends it, as h11 reads it). :class:`HeadTimeoutApp`,
  an ASGI middleware, starts the timer again when a response is complete, finding the
  connection by the request's ``client`` address (the ASGI scope's, with uvicorn's proxy headers
  off so a client cannot rename itself); where it cannot, the response closes its connection
  (``Connection: close``), so no second head can follow. The body's time is bounded by the app
  (``body_timeout``).
"""

from __future__ import annotations

import socket
from typing import Any

import uvicorn

from localspec.errors import ConfigError
from localspec.server import ServerLimits
from localspec.server.app import create_app
from localspec.server.compat import HeadDeadline, StoppingServer, timed_protocol
from localspec.server.jobs import Pair
from localspec.settings.generation import DEFAULTS, GenerationConfig


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


class HeadTimeoutApp:
    """ASGI middleware that starts a connection's head timer (compat.timed_protocol) again when
    its response is complete, finding the connection by the request's client address; a response
    whose connection it cannot find closes the connection (``Connection: close``)."""

    def __init__(self, app: Any, connections: dict[tuple[Any, ...], HeadDeadline]) -> None:
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

    def stopping() -> None:  # open responses end after the current step, with what they have
        residency.end("the server is stopping")

    try:
        StoppingServer(uvicorn_config(app, limits, verbose), stopping).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        sock.close()
    return residency.close()
