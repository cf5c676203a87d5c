"""An ASGI app served by uvicorn on a free port, in a background thread (the server tests')."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator

from localspec.server import ServerLimits
from localspec.server.run import base_url, bind_socket, uvicorn_config


@contextlib.contextmanager
def uvicorn_server(app: Any, limits: ServerLimits) -> Iterator[tuple[Any, socket.socket]]:
    """Serve `app` as localspec serves (run.uvicorn_config) until the block ends; yields the
    running uvicorn.Server and its listening socket. At the end uvicorn must stop within 10 s."""
    import uvicorn

    sock = bind_socket("127.0.0.1", 0)
    uv = uvicorn.Server(uvicorn_config(app, limits))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield uv, sock
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()
    assert not thread.is_alive(), "uvicorn did not stop"


@contextlib.contextmanager
def uvicorn_thread(app: Any, limits: ServerLimits) -> Iterator[str]:
    """Serve `app` until the block ends; yields its base URL (…/v1)."""
    with uvicorn_server(app, limits) as (_, sock):
        yield base_url(sock)
