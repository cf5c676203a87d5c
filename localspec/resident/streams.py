"""A call's standard streams inside the service: sys.stdin, sys.stdout and sys.stderr that are
the client's, over its connection.

Output is sent as it is written (held back only until the service accepts the call, so that a
declined call has written nothing); input is asked for when the command reads (``READ``), and a
line typed in a terminal is read by the client with its own line editing (``INPUT``). A thread
reads what the client sends meanwhile: its input, and its signals, which it hands to the service.
When the client goes away (killed, its pipe closed) output is dropped, input ends and the running
command is interrupted as by Ctrl-C.
"""

from __future__ import annotations

import io
import queue
import signal
import threading
from typing import Any, Callable

from localspec.resident.protocol import (
    ACCEPTED,
    INPUT,
    LINE,
    READ,
    SIGNAL,
    STDERR,
    STDIN,
    STDOUT,
    Channel,
    ProtocolError,
    loads,
)

NOTE_KIND = STDERR
POLL = 0.1  # seconds between checks for a signal while waiting for the client's input
_GONE = object()


class _Output(io.RawIOBase):
    def __init__(self, streams: "ClientStreams", kind: bytes, tty: bool) -> None:
        self.streams, self.kind, self.tty = streams, kind, tty

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.tty

    def write(self, data: Any) -> int:
        self.streams.send_output(self.kind, bytes(data))
        return len(data)


class _Input(io.RawIOBase):
    def __init__(self, streams: "ClientStreams", tty: bool) -> None:
        self.streams, self.tty = streams, tty

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.tty

    def readinto(self, buffer: Any) -> int:
        data = self.streams.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class ClientStreams:
    """The client's stdin, stdout and stderr for one call, and the thread that reads from it."""

    def __init__(self, channel: Channel, ttys: list[bool], on_signal: Callable[[int], None]) -> None:
        self.channel = channel
        self.on_signal = on_signal
        self.gone = False  # the client went away
        self.finished = False  # the command ended: the client's signals no longer reach it
        self.accepted = False
        self._pending: list[tuple[bytes, bytes]] = []  # output before the call was accepted
        self._stdin: queue.Queue[Any] = queue.Queue()
        self._lines: queue.Queue[Any] = queue.Queue()
        self._eof = False
        self.stdin = io.TextIOWrapper(io.BufferedReader(_Input(self, bool(ttys[0]))), encoding="utf-8")
        self.stdout = self._text(STDOUT, bool(ttys[1]))
        self.stderr = self._text(STDERR, bool(ttys[2]))
        self._reader = threading.Thread(target=self._read_client, name="client-reader", daemon=True)
        self._reader.start()

    def _text(self, kind: bytes, tty: bool) -> io.TextIOWrapper:
        return io.TextIOWrapper(io.BufferedWriter(_Output(self, kind, tty)), encoding="utf-8",
                                errors="backslashreplace" if kind == STDERR else "strict", write_through=True)

    # ------------------------------------------------------------ to the client

    def send_output(self, kind: bytes, data: bytes) -> None:
        if self.gone or not data:
            return
        if not self.accepted:
            self._pending.append((kind, data))
            return
        self._send(kind, data)

    def _send(self, kind: bytes, data: bytes) -> None:
        try:
            self.channel.send(kind, data)
        except OSError:
            self._went_away()

    def accept(self, info: dict[str, Any]) -> None:
        """The call is this service's: tell the client, then send what was written so far."""
        if self.accepted:
            return
        self.accepted = True
        try:
            self.channel.send_json(ACCEPTED, info)
        except OSError:
            self._went_away()
        for kind, data in self._pending:
            self._send(kind, data)
        self._pending.clear()

    def flush_pending(self) -> None:
        for stream in (self.stdout, self.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self.accept({})

    # ------------------------------------------------------------ from the client

    def read(self, n: int) -> bytes:
        """Up to n bytes of the client's stdin (b"": its end)."""
        if self._eof or self.gone:
            return b""
        try:
            self.channel.send_json(READ, {"n": n})
        except OSError:
            self._went_away()
            return b""
        data = self._wait(self._stdin)
        if data is _GONE or not data:
            self._eof = True
            return b""
        return data

    def end_input(self, note: str) -> None:
        """The service is ending: say so on the client's stderr; what the command reads from now
        on is the end of its input (a chat waiting for its user ends)."""
        self.send_output(NOTE_KIND, (note + "\n").encode())
        self._eof = True
        self._stdin.put(_GONE)
        self._lines.put(_GONE)

    def input(self, prompt: str) -> str:
        """A line the user types at the client's terminal, after `prompt` (EOFError at its end,
        KeyboardInterrupt for Ctrl-C there)."""
        if self.gone or self._eof:
            raise EOFError
        self.accept({})
        try:
            self.channel.send_json(INPUT, {"prompt": prompt})
        except OSError:
            self._went_away()
            raise EOFError from None
        answer = self._wait(self._lines)
        if answer is _GONE or answer.get("eof"):
            raise EOFError
        if answer.get("interrupt"):
            raise KeyboardInterrupt
        line = answer.get("line")
        if not isinstance(line, str):
            raise EOFError
        return line

    def _wait(self, source: queue.Queue) -> Any:
        """The next item of `source`, checking for signals every POLL seconds meanwhile."""
        while True:
            try:
                return source.get(timeout=POLL)
            except queue.Empty:
                if self.gone:
                    return _GONE

    def _read_client(self) -> None:
        try:
            while True:
                frame = self.channel.recv()
                if frame is None:
                    break
                kind, payload = frame
                if kind == STDIN:
                    self._stdin.put(payload)
                elif kind == LINE:
                    answer = loads(payload)
                    self._lines.put(answer if isinstance(answer, dict) else {"eof": True})
                elif kind == SIGNAL:
                    number = loads(payload).get("signal")
                    if number in (signal.SIGINT, signal.SIGTERM) and not self.finished:
                        self.on_signal(number)
                    elif number == signal.SIGPIPE:  # the client's output was closed: stop as for Ctrl-C
                        self._went_away()
                        return
                else:
                    raise ProtocolError(f"frame {kind!r} during a call")
        except (OSError, ProtocolError, AttributeError):
            pass
        self._went_away()

    def _went_away(self) -> None:
        if self.gone:
            return
        self.gone = True
        self._stdin.put(_GONE)
        self._lines.put(_GONE)
        if not self.finished:
            self.on_signal(signal.SIGINT)

    def close(self) -> None:
        """The command ended: what the client sends no longer reaches it (its output still goes out)."""
        self.finished = True
