"""The resident service: one background process per user (and localspec install) that keeps
model pairs loaded for ``localspec`` calls, on the core every front end shares
(:class:`localspec.core.residency.Residency`).

A client (:mod:`localspec.resident.client`) starts it with its listening socket already bound,
under a lock, so that every client arriving at the same time finds it. A connection carries one
request (:mod:`localspec.resident.protocol`): a call, which runs in the connection's thread
(:func:`localspec.core.run.run`) and streams its events back; a status query; or a stop. Calls
on different pairs run side by side; calls on one pair wait in its queue. The service reads its
clients' requests as typed values and nothing else of them: it never changes its environment,
working directory, standard streams or logging for a call, and no request a client can write
ends it (a malformed one gets an error event). A call's warnings reach its client as notes.

It ends when no pair is loaded any more (each pair is unloaded when idle for its last call's
keep-alive), when ``localspec stop`` unloads everything, on SIGTERM, or when its code changed on
disk (a call then gets RETRY and its client starts a new service). A clean end removes its
socket and log; a crash leaves the log.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from localspec.core.calls import Done, event_json
from localspec.core.cancel import Cancel
from localspec.core.residency import Residency
from localspec.core.run import failed, run
from localspec.core.wire import Malformed, parse_cancel, parse_request, parse_stop
from localspec.errors import RequestError
from localspec.resident import runtime
from localspec.resident.protocol import (
    ACCEPT,
    CALL,
    CANCEL,
    EVENT,
    RETRY,
    STATUS,
    STOP,
    Channel,
    ProtocolError,
)
from localspec.settings import environment

log = logging.getLogger("localspec.resident.service")

FIRST_FRAME_TIMEOUT = 5.0  # seconds a new connection has to say what it wants
EMPTY_GRACE = 2.0  # seconds the service stays with nothing loaded and no connection before it ends
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"  # as the command line logs (localspec.cli)


class CallLogs(logging.Handler):
    """The warnings (at -v the information, at -vv the debug lines) a call logs, sent to its
    client as notes, as a call in its own process writes them to its stderr; lines of the
    service's own threads go to its log only."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self._calls: dict[int, tuple[Any, int]] = {}  # thread -> (emit, level)

    @contextlib.contextmanager
    def following(self, emit: Any, level: int) -> Any:
        ident = threading.get_ident()
        self._calls[ident] = (emit, level)
        try:
            yield
        finally:
            self._calls.pop(ident, None)

    def emit(self, record: logging.LogRecord) -> None:
        call = self._calls.get(record.thread or 0)
        if call is not None and record.levelno >= call[1] and record.name != log.name:
            from localspec.core.calls import Note

            with contextlib.suppress(Exception):
                call[0](Note(self.format(record)))


class Service:
    """The listening socket, the residency and the connections being served."""

    def __init__(self, listener: socket.socket, log_path: Path | None) -> None:
        self.listener = listener
        self.path = Path(listener.getsockname())
        self.inode = os.stat(self.path).st_ino
        self.log_path = log_path
        self.residency = Residency()
        self.fingerprint = code_fingerprint()
        self.logs = CallLogs()
        self.ending: str | None = None
        self._active = 0  # connections being served
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._quiet_since = time.monotonic()

    # ------------------------------------------------------------ the process

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: self.end("SIGTERM"))
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # its own session: a terminal's Ctrl-C is the clients'
        logging.getLogger("localspec").addHandler(self.logs)  # once: every call's lines reach it (its own filter)
        threading.Thread(target=self._accept_forever, name="acceptor", daemon=True).start()
        while self.ending is None:
            due = self.residency.expire()
            if self._empty_for() > EMPTY_GRACE:
                self.end("no model is loaded")
                break
            self._wake.wait(min(due if due is not None else 1.0, 1.0))
            self._wake.clear()
        self._retire()
        self.residency.close()

    def _empty_for(self) -> float:
        """Seconds the service has held nothing and served no connection (0: it holds or serves)."""
        with self._lock:
            if self._active or self.residency.status().pairs:
                self._quiet_since = time.monotonic()
                return 0.0
            return time.monotonic() - self._quiet_since

    def end(self, why: str) -> None:
        """Take no new call (they get RETRY); the running ones stop within one step."""
        if self.ending is None:
            self.ending = why
            log.info("ending: %s", why)
        self.residency.end(why)
        self._wake.set()

    def _retire(self) -> None:
        """No client finds this service any more: its socket goes (if it is still its own), under
        the lock clients start services with."""
        with contextlib.suppress(OSError), runtime.spawn_lock(self.path.parent):
            if os.lstat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            self.listener.close()

    def close(self, clean: bool) -> None:
        """Remove the log after a clean end (a crash leaves it, 0600, for the user to read)."""
        log.info("ended: %s", self.ending)
        if clean and self.log_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)

    # ------------------------------------------------------------ connections

    def _accept_forever(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return  # the listener was closed: the service is ending
            with self._lock:
                self._active += 1
            threading.Thread(target=self._connection, args=(sock,), daemon=True).start()

    def _connection(self, sock: socket.socket) -> None:
        channel = Channel(sock)
        try:
            uid = runtime.peer_uid(sock)
            if uid != os.geteuid():
                log.warning("refused a connection from another user (uid %d)", uid)
                return
            sock.settimeout(FIRST_FRAME_TIMEOUT)
            frame = channel.recv()
            sock.settimeout(None)
            if frame is not None:
                self._dispatch(channel, *frame)
        except (OSError, ProtocolError) as exc:
            log.info("dropped a connection: %s", exc)
        except Exception:  # noqa: BLE001 - nothing a client sends ends the service
            log.exception("a connection failed")
        finally:
            channel.close()
            with self._lock:
                self._active -= 1
                self._quiet_since = time.monotonic()
            self._wake.set()

    def _dispatch(self, channel: Channel, kind: bytes, payload: bytes) -> None:
        if kind == CALL:
            self._call(channel, payload)
        elif kind == STATUS:
            channel.send(STATUS, self.residency.status().to_json())
        elif kind == STOP:
            channel.send(STOP, self._stop(payload))
        else:
            raise ProtocolError(f"a connection opened with a {kind!r} frame")

    def _stop(self, payload: bytes) -> dict[str, Any]:
        """Unload the pairs a stop names by their targets (all: the service ends); a stop that
        is not one unloads nothing."""
        try:
            targets = parse_stop(payload)
        except Malformed as exc:
            log.warning("a malformed stop (%s): nothing unloaded", exc)
            return {"stopped": [], "ending": self.ending}
        reason = "stopped by localspec stop"
        stopped = self.residency.unload(lambda s: targets is None or s.target in targets, reason)
        if targets is None:
            self.end(reason)
        self._wake.set()
        return {"stopped": [dataclasses.asdict(s) for s in stopped], "ending": self.ending}

    def _call(self, channel: Channel, payload: bytes) -> None:
        why = self.ending or ("localspec or llama.cpp changed on disk" if code_fingerprint() != self.fingerprint
                              else None)
        if why is not None:
            channel.send(RETRY, {"reason": why})
            self.end(why)
            return
        channel.send(ACCEPT, {})
        cancel = Cancel()
        received = time.monotonic()

        def emit(event: Any) -> None:
            if isinstance(event, Done):
                event = dataclasses.replace(event, timings={**event.timings, "service": time.monotonic() - received})
            try:
                channel.send(EVENT, event_json(event))
            except OSError:
                cancel.set("gone")

        try:
            request = parse_request(payload)
        except RequestError as exc:
            emit(failed(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a bug: logged, and the client told (not "the service ended")
            log.exception("a call could not be read")
            emit(failed(exc))
            return
        threading.Thread(target=_read_cancels, args=(channel, cancel), name="client-reader", daemon=True).start()
        with self.logs.following(emit, request.log_level):
            run(self.residency, request, cancel, emit)


def _read_cancels(channel: Channel, cancel: Cancel) -> None:
    """What a client sends during its call: CANCEL, or the end of the connection (it is gone)."""
    try:
        while True:
            frame = channel.recv()
            if frame is None:
                break
            kind, payload = frame
            if kind == CANCEL:
                cancel.set(parse_cancel(payload))
    except (OSError, ProtocolError):
        pass
    cancel.set("gone")


def code_fingerprint() -> tuple:
    """What changes when localspec or llama-cpp-python is reinstalled or edited: the newest
    modification of localspec's modules and llama_cpp's package files, and what localspec's
    compiled verifier is (see _compiled)."""
    import importlib.util

    import localspec

    llama = importlib.util.find_spec("llama_cpp")  # found, not imported: a call imports it when it needs it
    own = Path(localspec.__file__).parent
    library = Path(llama.origin if llama and llama.origin else ".").parent
    return ((str(own), _newest(own, (".py",))), *_compiled(own), (str(library), _newest(library, (".py", ".so"))))


def _compiled(own: Path) -> list[tuple[str, str]]:
    """localspec's compiled verifier by content: in a checkout (an editable install), the C sources
    and build script beside the package, which ``pip install -e .`` builds again in place (new
    bytes, new time, the same code: the service stays); else the compiled module's bytes."""
    native = own.parent / "native"
    files = sorted(native.glob("*.[ch]")) + sorted(native.glob("*.py")) \
        if (own.parent / "pyproject.toml").is_file() and native.is_dir() else []
    return [(path.name, hashlib.sha256(path.read_bytes()).hexdigest()) for path in files or sorted(own.glob("*.so"))]


def _newest(package: Path, suffixes: tuple[str, ...]) -> int:
    """The newest modification time of the package's files with these suffixes."""
    newest = 0
    for path in package.rglob("*"):
        if path.suffix in suffixes:
            with contextlib.suppress(OSError):
                newest = max(newest, path.stat().st_mtime_ns)
    return newest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="localspec-service", description="the resident localspec service")
    parser.add_argument("--fd", type=int, required=True, help="its listening socket, bound by the client")
    parser.add_argument("--log", default=None, help="its log file (removed after a clean end)")
    args = parser.parse_args(argv)
    environment.quiet_blas()
    handler = logging.StreamHandler(sys.stderr)  # the service's log file
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("localspec").setLevel(logging.DEBUG)  # a call at -vv gets its debug lines as notes
    os.chdir("/")  # never holds a directory of its clients' busy
    service = Service(socket.socket(fileno=args.fd), Path(args.log) if args.log else None)
    clean = False
    try:
        service.serve()
        clean = True
    finally:
        service.close(clean)


if __name__ == "__main__":
    main()
