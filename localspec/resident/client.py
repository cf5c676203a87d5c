"""The ``localspec`` command: a call that generates is served by a resident service when one
holds its models, else by a new one it starts, else (``--keep-alive 0``, RPC servers, a private
directory that cannot be had) in this process.

This module runs before anything else and imports only the standard library and localspec's
leaf modules, so that a call served by a service costs a Python start-up and a few milliseconds.
It forwards the arguments, working directory, environment and what the command reads from stdin
or the terminal, prints what the service writes as it comes, passes Ctrl-C and SIGTERM on (the
service stops the generation within one step) and exits with the command's status. A service
that dies mid-call is reported (exit 3) with what had arrived.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import sys
import time

TYPE_CHECKING = False  # no typing at run time: this module is the start of every call
if TYPE_CHECKING:
    from typing import Any, Sequence

from localspec.resident import runtime
from localspec.resident.protocol import (
    ACCEPTED,
    DECLINED,
    EXIT,
    INPUT,
    LINE,
    NOTE,
    READ,
    REQUEST,
    SIGNAL,
    STDERR,
    STDIN,
    STDOUT,
    Channel,
    ProtocolError,
    loads,
)

# every command of the root group (tests/test_resident.py checks this against localspec.cli); only
# the generating ones are served by a service, the others always run here
COMMANDS = ("bench", "cache", "chat", "check", "generate", "info", "models", "profiles", "ps", "rpc-server",
            "serve", "stop")
SERVED = ("generate", "chat")
KEEP_ALIVE_FLAG = "--keep-alive"
KEEP_ALIVE_ENV = "LOCALSPEC_KEEP_ALIVE"
EXIT_SERVICE_LOST = 3  # the service ended before the call did (as a lost RPC server: localspec.errors)
TERM_GRACE = 2.0  # seconds the service has to end a call after the client's SIGTERM
MAX_READ = 1 << 20
SPAWN_LOCK = "spawn.lock"


class Fallback(Exception):
    """The call runs in this process instead (the reason, for -v)."""


# ---------------------------------------------------------------- which calls a service serves


def _keep_alive(argv: Sequence[str], env: dict[str, str]) -> float | None:
    """--keep-alive's value (the last one given) or LOCALSPEC_KEEP_ALIVE's, in seconds; None when
    it cannot be read (the command then reports it)."""
    from localspec import environment

    text, name = env.get(KEEP_ALIVE_ENV), KEEP_ALIVE_ENV
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == KEEP_ALIVE_FLAG and i + 1 < len(argv):
            text, name = argv[i + 1], KEEP_ALIVE_FLAG
        elif arg.startswith(KEEP_ALIVE_FLAG + "="):
            text, name = arg.split("=", 1)[1], KEEP_ALIVE_FLAG
    if text is None or not text.strip():
        return float(environment.VARIABLES[KEEP_ALIVE_ENV].default)
    try:
        return environment.parse_duration(text, name)
    except Exception:  # noqa: BLE001 - the command itself reports a bad value, exit 2
        return None


def served_call(argv: Sequence[str], env: dict[str, str], stdin_tty: bool) -> float:
    """The keep-alive of a call a service should serve, in seconds; Fallback (why not) otherwise."""
    rest = list(argv)
    while rest and (rest[0] == "--verbose" or (rest[0].startswith("-v") and set(rest[0][1:]) == {"v"})):
        rest.pop(0)
    options = rest[: rest.index("--")] if "--" in rest else rest
    if not rest and stdin_tty:
        raise Fallback("no command")
    if rest and (rest[0] in COMMANDS and rest[0] not in SERVED or rest[0] in ("--version",)):
        raise Fallback(f"{rest[0]} runs here")
    if any(a in ("-h", "--help") for a in options):
        raise Fallback("help")
    if any(a in ("--rpc", "--draft-rpc") or a.startswith(("--rpc=", "--draft-rpc=")) for a in options) \
            or env.get("LOCALSPEC_RPC", "").strip():
        raise Fallback("RPC servers are used from the calling process")
    seconds = _keep_alive(options, env)
    if seconds is None:
        raise Fallback("--keep-alive is not a duration")
    if seconds <= 0:
        raise Fallback("--keep-alive 0")
    return seconds


# ---------------------------------------------------------------- talking to a service


class Call:
    """One call's conversation with a service: the request, and what came back."""

    def __init__(self, argv: Sequence[str], started: float) -> None:
        ttys = [_isatty(fd) for fd in (0, 1, 2)]
        self.request = {"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ), "ttys": ttys,
                        "started": started, "pid": os.getpid(), "code": runtime.code_identity()}
        self.stdin_tty = ttys[0]
        self.replay = b""  # stdin a declined service read: the next one reads it first
        self._sent_to_current = b""
        self.channel: Channel | None = None
        self.accepted = False
        self.received_output = False
        self.signals = 0
        self.term_deadline: float | None = None
        self.on_accepted: Any = None  # called once, when a service takes the call (releases the spawn lock)

    def run(self, channel: Channel) -> int | str:
        """Send the request and follow the service; the exit status, or why it declined."""
        self.channel, self.accepted, self._sent_to_current = channel, False, b""
        channel.send_json(REQUEST, self.request)
        while True:
            if self.term_deadline is not None:
                channel.sock.settimeout(max(0.01, self.term_deadline - time.monotonic()))
            try:
                frame = channel.recv()
            except (socket.timeout, TimeoutError):
                return 128 + signal.SIGTERM  # the service did not end the call in time: leave anyway
            except (OSError, ProtocolError):
                frame = None
            if frame is None:
                return self._lost()
            outcome = self._frame(*frame)
            if outcome is not None:
                return outcome

    def _frame(self, kind: bytes, payload: bytes) -> int | str | None:
        if kind in (STDOUT, STDERR):
            self.received_output = True
            _write(1 if kind == STDOUT else 2, payload, self)
        elif kind == READ:
            self._read(loads(payload))
        elif kind == INPUT:
            self._input(loads(payload))
        elif kind == ACCEPTED:
            self.accepted = True
            self.replay = b""
            if self.on_accepted is not None:
                self.on_accepted()
                self.on_accepted = None
            info = loads(payload)
            if isinstance(info, dict) and info.get("started"):
                _started_note(info)
        elif kind == NOTE:
            _write(2, (str(loads(payload).get("text", "")) + "\n").encode(), self)
        elif kind == DECLINED:
            self.replay = self._sent_to_current + self.replay if not self.accepted else b""
            return str(loads(payload).get("reason", "declined"))
        elif kind == EXIT:
            code = loads(payload).get("code", 1)
            return code if isinstance(code, int) else 1
        else:
            raise ProtocolError(f"frame {kind!r} from the service")
        return None

    def _read(self, ask: Any) -> None:
        n = min(int(ask.get("n", 0)) if isinstance(ask, dict) else 0, MAX_READ)
        if self.replay:
            data, self.replay = self.replay[:n], self.replay[n:]
        else:
            try:
                data = os.read(0, max(1, n))
            except OSError:
                data = b""
        if not self.accepted:
            self._sent_to_current += data
        assert self.channel is not None
        self.channel.send(STDIN, data)

    def _input(self, ask: Any) -> None:
        prompt = str(ask.get("prompt", "")) if isinstance(ask, dict) else ""
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  line editing and history, as in-process chat has
            answer: dict[str, Any] = {"line": input(prompt)}
        except EOFError:
            answer = {"eof": True}
        except KeyboardInterrupt:
            answer = {"interrupt": True}
        finally:
            signal.signal(signal.SIGINT, previous)
        assert self.channel is not None
        self.channel.send_json(LINE, answer)

    def _lost(self) -> int | str:
        """The connection ended without an exit status."""
        if not self.accepted and not self.received_output and not self._sent_to_current:
            return "the service ended before it took the call"
        _write(2, ("\nlocalspec: the resident service ended before the call was done (killed, or it crashed); "
                   "what it generated is above. The next call starts a new one; --keep-alive 0 runs in "
                   "this process.\n").encode(), self)
        return EXIT_SERVICE_LOST

    def forward(self, signum: int) -> None:
        """The client's signal, passed on to the service's command."""
        self.signals += 1
        if signum == signal.SIGTERM and self.term_deadline is None:
            self.term_deadline = time.monotonic() + TERM_GRACE
        if self.channel is not None:
            with contextlib.suppress(OSError):
                self.channel.send_json(SIGNAL, {"signal": int(signum)})


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _write(fd: int, data: bytes, call: Call) -> None:
    """All of `data` to a standard stream; a closed pipe stops the call as it would a process."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BrokenPipeError:
            call.forward(signal.SIGPIPE)
            os._exit(128 + signal.SIGPIPE)
        except InterruptedError:
            continue
        view = view[n:]


def _started_note(info: dict[str, Any]) -> None:
    from localspec.environment import format_duration

    keep = float(info.get("keep_alive") or 0)
    name = info.get("target") or "the models"
    os.write(2, (f"localspec: {name} stays loaded for {format_duration(keep)} after each call, so the next one starts "
                 "at once (localspec ps lists it, localspec stop ends it; --keep-alive 0 or LOCALSPEC_KEEP_ALIVE=0 "
                 "runs without)\n").encode())


# ---------------------------------------------------------------- finding or starting a service


def _existing(call: Call, directory: Any, tried: set[str]) -> int | None:
    """The exit status from the first matching service that takes the call (None: none did)."""
    for record in runtime.records(directory):
        if record.id in tried or not record.matches(call.request["env"]):
            continue
        tried.add(record.id)
        channel = runtime.connect(record)
        if channel is None:
            continue
        try:
            outcome = call.run(channel)
        finally:
            channel.close()
        if isinstance(outcome, int):
            return outcome
    return None


class SpawnLock:
    """One client at a time starts a service, holding this lock until the new service has taken
    its call (its record is written by then): another client arriving meanwhile finds it."""

    def __init__(self, directory: Any) -> None:
        self.fd: int | None = os.open(directory / SPAWN_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                      0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _spawn(call: Call, directory: Any, keep_alive: float) -> int | str:
    """Start a service for this call, and run the call on it."""
    import secrets
    import subprocess

    sid = secrets.token_hex(4)
    if not runtime.socket_path_fits(directory / f"{sid}{runtime.SOCKET_SUFFIX}"):
        raise Fallback(f"the runtime directory {directory} is too long a path for a socket")
    ours, theirs = socket.socketpair()
    log_fd = os.open(directory / f"{sid}{runtime.LOG_SUFFIX}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    try:
        subprocess.Popen([sys.executable, "-m", "localspec.resident.service", "--id", sid, "--fd",
                          str(theirs.fileno()), "--keep-alive", repr(keep_alive)],
                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                         start_new_session=True, cwd="/")
    finally:
        os.close(log_fd)
        theirs.close()
    channel = Channel(ours)
    try:
        return call.run(channel)
    finally:
        channel.close()


def serve_remotely(argv: Sequence[str], keep_alive: float, started: float) -> int:
    """Run the call on a service: an existing one, else a new one; Fallback when neither can."""
    try:
        directory = runtime.directory()
    except runtime.NotPrivate as exc:
        os.write(2, f"localspec: the models are not kept loaded: {exc}\n".encode())
        raise Fallback(str(exc)) from None
    except OSError as exc:
        raise Fallback(f"no runtime directory ({exc})") from None
    call = Call(argv, started)
    with _forwarded_signals(call):
        tried: set[str] = set()
        outcome = _existing(call, directory, tried)
        if outcome is not None:
            return outcome
        lock = SpawnLock(directory)
        call.on_accepted = lock.release
        try:
            outcome = _existing(call, directory, tried)  # one started while we waited for the lock
            if outcome is not None:
                return outcome
            result = _spawn(call, directory, keep_alive)
        finally:
            lock.release()
            call.on_accepted = None
    if isinstance(result, int):
        return result
    if call.replay:
        os.write(2, f"localspec: the new service could not take the call ({result})\n".encode())
        return EXIT_SERVICE_LOST
    os.write(2, f"localspec: the models are not kept loaded: {result}\n".encode())
    raise Fallback(result)


@contextlib.contextmanager
def _forwarded_signals(call: Call) -> Any:
    """Ctrl-C and SIGTERM go to the service while it runs the call."""
    handler = lambda signum, frame: call.forward(signum)  # noqa: E731
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _in_process() -> None:
    from localspec.cli import main as cli_main

    cli_main()


def main() -> None:
    """The ``localspec`` entry point."""
    started = time.time()
    argv = sys.argv[1:]
    try:
        keep_alive = served_call(argv, dict(os.environ), _isatty(0))
        code = serve_remotely(argv, keep_alive, started)
    except Fallback:
        _in_process()
        return
    sys.exit(code)
