"""A resident service: a background process that keeps one target/draft pair loaded and runs
the command line's own commands (``localspec``, ``localspec chat``) on it for its clients.

A client (:mod:`localspec.resident.client`) starts it with one end of a socket pair for its
call; the service then listens on ``<runtime dir>/<id>.sock`` for later calls. A call runs the
same click command as an in-process run, in this process's main thread, with the client's
arguments, working directory, environment, standard streams (:mod:`.streams`) and signals; only
its :class:`~localspec.cli.resources.Resources` differ (:class:`ServiceResources`: models, prompt
cache states and cost profiles kept between calls). A call whose models or options differ from
this service's is declined before it reads or writes anything, and the client goes on elsewhere.
Calls run one at a time; a client that arrives while one runs is told so and waits its turn.
The service exits when it has been idle for its keep-alive, when ``localspec stop`` asks, on
SIGTERM, when its code or llama.cpp changed on disk, or after a first call that loaded nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localspec.resident import runtime
from localspec.resident.protocol import (
    DECLINED,
    EXIT,
    NOTE,
    REQUEST,
    STATUS,
    STOP,
    Channel,
    ProtocolError,
    loads,
)
from localspec.resident.resources import Declined, ServiceResources
from localspec.resident.streams import ClientStreams

log = logging.getLogger("localspec.resident.service")

FIRST_FRAME_TIMEOUT = 5.0  # seconds a new connection has to say what it wants
MAX_ARGS = 4096


@dataclass
class Call:
    """One client's call, as the service runs it."""

    channel: Channel
    request: dict[str, Any]
    received: float = field(default_factory=time.time)

    @property
    def is_chat(self) -> bool:
        """A chat session (it lasts as long as the user talks: other calls do not wait for it)."""
        args = [a for a in self.request["argv"] if not (a == "--verbose" or (a.startswith("-v") and set(a[1:]) == {"v"}))]
        return bool(args) and args[0] == "chat"


def _check_request(value: Any) -> dict[str, Any]:
    """The request's fields, checked (ProtocolError otherwise)."""
    ok = (isinstance(value, dict) and isinstance(value.get("argv"), list) and len(value["argv"]) <= MAX_ARGS
          and all(isinstance(a, str) for a in value["argv"]) and isinstance(value.get("cwd"), str)
          and isinstance(value.get("env"), dict) and all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in value["env"].items())
          and isinstance(value.get("ttys"), list) and len(value["ttys"]) == 3
          and isinstance(value.get("started"), (int, float)))
    if not ok:
        raise ProtocolError("a malformed request")
    return value


class Service:
    """The listening socket, the queue of calls and the loop that runs them."""

    def __init__(self, sid: str, directory: Path, keep_alive: float) -> None:
        self.id = sid
        self.directory = directory
        self.socket_path = directory / f"{sid}{runtime.SOCKET_SUFFIX}"
        self.record_path = directory / f"{sid}{runtime.RECORD_SUFFIX}"
        self.keep_alive = keep_alive
        self.started = time.time()
        self.last_used = self.started
        self.served = 0
        self.last_call_seconds: float | None = None  # the last call, from its request to its exit status
        self.calls: queue.Queue[Call | None] = queue.Queue()
        self.running: Call | None = None
        self.stopping: str | None = None  # why the service is ending
        self.code = runtime.code_identity()
        self.fingerprint = code_fingerprint()
        self.env_key = runtime.env_key(os.environ)
        self.resources = ServiceResources(self)
        self.listener = self._listen()
        self._lock = threading.Lock()
        self._term_from_client = False

    # ------------------------------------------------------------ connections

    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is 0600 from the start
        try:
            sock.bind(str(self.socket_path))
        finally:
            os.umask(old)
        sock.listen(16)
        return sock

    def accept_forever(self) -> None:
        """The acceptor thread: each connection is checked and read in a thread of its own (also
        while the service ends: status is answered and calls declined until the socket closes)."""
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return  # the listener was closed: the service is ending
            threading.Thread(target=self._connection, args=(sock,), daemon=True).start()

    def _connection(self, sock: socket.socket) -> None:
        try:
            if runtime.peer_uid(sock) != os.geteuid():
                log.warning("refused a connection from another user (uid %d)", runtime.peer_uid(sock))
                sock.close()
                return
            sock.settimeout(FIRST_FRAME_TIMEOUT)
            channel = Channel(sock)
            frame = channel.recv()
            sock.settimeout(None)
            if frame is None:
                channel.close()
                return
            self.dispatch(channel, *frame)
        except (OSError, ProtocolError) as exc:
            log.info("dropped a connection: %s", exc)
            with contextlib.suppress(OSError):
                sock.close()

    def dispatch(self, channel: Channel, kind: bytes, payload: bytes) -> None:
        """A connection's first frame: a call (queued), a status query or a stop."""
        if kind == STATUS:
            channel.send_json(STATUS, self.status())
            channel.close()
        elif kind == STOP:
            self.stop(f"stopped by localspec stop ({loads(payload).get('reason', '') if payload else ''})")
            channel.send_json(EXIT, {"code": 0})
            channel.close()
        elif kind == REQUEST:
            call = Call(channel, _check_request(loads(payload)))
            running = self.running
            if self.stopping is not None:
                self._decline(call, f"the service is ending ({self.stopping})")
                return
            if running is not None and running.is_chat:  # it may last hours: the client goes elsewhere
                self._decline(call, "busy with a chat session")
                return
            if running is not None or not self.calls.empty():
                with contextlib.suppress(OSError):
                    channel.send_json(NOTE, {"text": "localspec: the models are busy with another call; this one "
                                                     "waits its turn"})
            self.calls.put(call)
        else:
            raise ProtocolError(f"a connection opened with frame {kind!r}")

    # ------------------------------------------------------------ state

    def status(self) -> dict[str, Any]:
        now = time.time()
        idle = 0.0 if self.running is not None else now - self.last_used
        return {"id": self.id, "pid": os.getpid(), "started": self.started, "keep_alive": self.keep_alive,
                "idle": idle, "left": None if self.running is not None else max(0.0, self.keep_alive - idle),
                "busy": self.running is not None, "waiting": self.calls.qsize(), "served": self.served,
                "last_call_seconds": self.last_call_seconds,
                "memory": runtime.proc_bytes("/proc/self/status", "VmRSS"),
                "memory_peak": runtime.proc_bytes("/proc/self/status", "VmHWM"), **self.resources.describe()}

    def write_record(self) -> None:
        """The record clients find the service by (written when its models are loaded)."""
        data = {"id": self.id, "pid": os.getpid(), "started": self.started, "env": self.env_key,
                "code": self.code, "socket": str(self.socket_path), **self.resources.describe()}
        tmp = self.directory / f".{self.id}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, self.record_path)

    def stop(self, why: str) -> None:
        """End the service: the running call stops within one step, queued calls are declined."""
        if self.stopping is None:
            self.stopping = why
            log.info("stopping: %s", why)
        streams = self.resources.streams
        if streams is not None:  # a chat waiting for its user ends too, and says why
            streams.end_input(f"localspec: the resident service is ending ({why})")
        self.interrupt(signal.SIGINT)
        self.calls.put(None)

    # ------------------------------------------------------------ signals

    def interrupt(self, signum: int) -> None:
        """The client's Ctrl-C (SIGINT) or SIGTERM, delivered to the running command as a signal
        to this process's main thread would be."""
        with self._lock:
            if self.running is None:
                return
            if signum == signal.SIGTERM:
                self._term_from_client = True
            signal.pthread_kill(threading.main_thread().ident or 0, signum)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM: from a client, the running command is terminated as `localspec` is; from
        anyone else (kill, a session ending), the service ends."""
        from localspec.cli.generate import Terminated

        if not self._term_from_client:
            self.stop("SIGTERM")
        self._term_from_client = False
        if self.running is not None:
            raise Terminated()

    # ------------------------------------------------------------ the loop

    def serve(self, first: Channel | None) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=self.accept_forever, name="acceptor", daemon=True).start()
        if first is not None:
            threading.Thread(target=self._first, args=(first,), daemon=True).start()
        while self.stopping is None:
            try:
                call = self.calls.get(timeout=self._idle_left(first is not None))
                if call is None:
                    continue
                first = None
                self._run_guarded(call)
            except queue.Empty:
                self.stopping = f"idle for {self.keep_alive:g} s"
            except KeyboardInterrupt:  # a client's signal that arrived as its call ended
                pass
            if self.resources.loaded is None and first is None and self.stopping is None:
                self.stopping = "its first call loaded no models"
        self._decline_queued()

    def _first(self, channel: Channel) -> None:
        """The connection of the client that started the service."""
        try:
            frame = channel.recv()
            if frame is not None:
                self.dispatch(channel, *frame)
        except (OSError, ProtocolError) as exc:
            log.info("the first client went away: %s", exc)
            self.calls.put(None)

    def _idle_left(self, starting: bool) -> float:
        if starting:
            return FIRST_FRAME_TIMEOUT * 2
        return max(0.0, self.keep_alive - (time.time() - self.last_used))

    def _decline_queued(self) -> None:
        while True:
            try:
                call = self.calls.get_nowait()
            except queue.Empty:
                return
            if call is not None:
                self._decline(call, self.stopping or "ending")

    def _decline(self, call: Call, reason: str) -> None:
        with contextlib.suppress(OSError):
            call.channel.send_json(DECLINED, {"reason": reason})
        call.channel.close()

    def _run_guarded(self, call: Call) -> None:
        """Run one call; whatever happens, the client gets its exit status (or a decline) and the
        connection is closed."""
        try:
            self._run(call)
        finally:
            with self._lock:
                self.running = None
            self._term_from_client = False
            self.last_used = time.time()
            call.channel.close()

    def _run(self, call: Call) -> None:
        request = call.request
        problem = self._refusal(request)
        if problem is not None:
            self._decline(call, problem)
            return
        with self._lock:
            self.running = call
        streams = ClientStreams(call.channel, request["ttys"], self.interrupt)
        self.resources.begin(call, streams)
        code = 1
        try:
            with _client_process(request, streams):
                code = self._command(request["argv"]) if not streams.gone else 130
        except Declined as declined:
            self._decline(call, str(declined))
            return
        finally:
            with self._lock:
                self.running = None  # no signal of this client reaches what follows
            streams.close()
            self.resources.end()
        self.served += 1
        with contextlib.suppress(OSError):
            streams.flush_pending()
            call.channel.send_json(EXIT, {"code": code})
        self.last_call_seconds = time.time() - call.received

    def _refusal(self, request: dict[str, Any]) -> str | None:
        """Why this service must not run the call (None: it may)."""
        if request.get("code") != self.code or code_fingerprint() != self.fingerprint:
            self.stop("localspec or llama.cpp changed on disk")
            return "localspec or llama.cpp changed since this service started"
        if runtime.env_key(request["env"]) != self.env_key:
            return "another environment"
        return None

    def _command(self, argv: list[str]) -> int:
        """Run the command line's own command; its exit status."""
        from localspec.cli import cli

        try:
            cli.main(args=list(argv), prog_name="localspec", standalone_mode=True, obj=self.resources)
        except SystemExit as done:
            return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        except Declined:
            raise
        except KeyboardInterrupt:  # outside the command's own handling (click's Abort is SystemExit)
            return 130
        except Exception:  # noqa: BLE001 - what an in-process run prints, then its status
            sys.stderr.write(traceback.format_exc())
            return 1
        return 0

    def close(self) -> None:
        """Remove the socket and the record, close the models."""
        with contextlib.suppress(OSError):
            self.listener.close()
        for path in (self.socket_path, self.record_path, self.directory / f"{self.id}{runtime.LOG_SUFFIX}"):
            with contextlib.suppress(OSError):
                path.unlink()  # the log too: a clean end leaves nothing (a crash leaves its log)
        self.resources.close()
        log.info("ended: %s", self.stopping)


@contextlib.contextmanager
def _client_process(request: dict[str, Any], streams: ClientStreams) -> Any:
    """Within the block this process looks like the client's: its environment, working
    directory, standard streams, and a fresh logging setup (the command configures it)."""
    saved_env = dict(os.environ)
    saved_streams = (sys.stdin, sys.stdout, sys.stderr)
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    try:
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
    except OSError as exc:
        os.environ.clear()
        os.environ.update(saved_env)
        raise Declined(f"cannot enter the working directory ({exc.strerror})") from None
    sys.stdin, sys.stdout, sys.stderr = streams.stdin, streams.stdout, streams.stderr
    root.handlers = []
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        root.handlers, root.level = saved_handlers, saved_level
        os.environ.clear()
        os.environ.update(saved_env)
        with contextlib.suppress(OSError):
            os.chdir("/")


def code_fingerprint() -> tuple:
    """What changes when localspec or llama-cpp-python is reinstalled or edited: the newest
    modification of localspec's modules and llama_cpp's package files, and what localspec's
    compiled verifier is (see _compiled)."""
    import importlib.util

    import localspec

    llama = importlib.util.find_spec("llama_cpp")  # found, not imported: the call imports it when it needs it
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
    parser = argparse.ArgumentParser(prog="localspec-service", description="a resident localspec service")
    parser.add_argument("--id", required=True)
    parser.add_argument("--fd", type=int, default=None, help="the socket of the first client")
    parser.add_argument("--keep-alive", type=float, required=True)
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)  # the service's log file
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # the service's own lines never reach a client's stderr
    os.chdir("/")
    first = Channel(socket.socket(fileno=args.fd)) if args.fd is not None else None
    service = Service(args.id, runtime.directory(), args.keep_alive)
    try:
        service.serve(first)
    finally:
        service.close()


if __name__ == "__main__":
    main()
