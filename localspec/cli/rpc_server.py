"""``localspec rpc-server``: serve this machine's CPU to llama.cpp RPC clients (``--rpc``)."""

from __future__ import annotations

import logging
import os
import signal
import threading

import click

from localspec.cli.options import user_errors
from localspec.settings.endpoints import RPC_PORT

log = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@click.command("rpc-server")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. The default takes connections from this machine only.")
@click.option("--port", type=click.IntRange(1, 65535), default=RPC_PORT, show_default=True, help="Port to listen on.")
@click.option("--threads", type=click.IntRange(1), default=None, help="CPU threads (default: all cores).")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="Directory where the server caches the tensors clients send (large ones are then sent "
                   "once per machine instead of once per load).")
@user_errors
def rpc_server(host: str, port: int, threads: int | None, cache_dir: str | None) -> None:
    """Serve this machine's CPU to localspec (or llama.cpp) RPC clients.

    A client started with --rpc HOST:PORT puts its target's layers here; every
    target pass is then one or more network round trips, which speculative
    decoding divides by the tokens it gets per pass. The protocol is llama.cpp's
    and has no authentication or encryption: keep the server on loopback or a
    trusted network. Needs llama-cpp-python built with -DGGML_RPC=on.

    \b
    localspec rpc-server                                  # 127.0.0.1:50052
    localspec rpc-server --host 0.0.0.0 --port 50052 --cache ~/.cache/localspec/rpc
    localspec --rpc 192.168.1.20:50052 "Write a quicksort"  # on the client
    """
    from localspec.llama import rpc

    rpc.require()
    if host not in LOOPBACK:
        click.echo(f"localspec: warning: listening on {host}: the RPC protocol has no authentication or "
                   "encryption; anyone who can reach this port can use this machine", err=True)
    n_threads = threads or os.cpu_count() or 1
    failed: list[BaseException] = []

    def run() -> None:
        try:
            rpc.serve(host, port, n_threads, cache_dir)
        except BaseException as exc:  # reported by the main thread
            failed.append(exc)
        finally:
            done.set()

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    thread = threading.Thread(target=run, name="rpc-server", daemon=True)
    click.echo(f"localspec: RPC server on {host}:{port} ({n_threads} threads, tensor cache "
               f"{cache_dir or 'off'}); Ctrl-C stops", err=True)
    thread.start()
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    if failed:
        raise failed[0]
    click.echo("localspec: RPC server stopped", err=True)
    os._exit(0)  # the C server loop has no stop call: leave without waiting for it

