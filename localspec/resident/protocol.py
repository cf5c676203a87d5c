"""The frames a ``localspec`` client and a resident service exchange on a Unix socket.

A frame is one byte naming its kind, the payload's length (u32, little endian) and the payload:
bytes for standard streams, JSON for everything else. A call goes::

    client                                   service
    REQUEST {argv, cwd, env, ttys, ...}  ─►
                                         ◄─  ACCEPTED {service}   (or DECLINED {reason}: another key)
                                         ◄─  STDOUT / STDERR bytes, as the command writes them
                                         ◄─  READ {n}             (the command reads stdin)
    STDIN bytes (b"": end of input)      ─►
                                         ◄─  INPUT {prompt}       (chat asks for a line in a terminal)
    LINE {line} | {eof} | {interrupt}    ─►
    SIGNAL {signal}  (Ctrl-C, SIGTERM)   ─►  any time: stops the generation within one step
                                         ◄─  EXIT {code}

``STATUS`` (answered by ``STATUS``) and ``STOP`` (answered by ``EXIT``) are what ``localspec ps``
and ``localspec stop`` send instead of a request. Standard library only: the client imports it.
"""

from __future__ import annotations

import json
import socket
import struct
import threading

TYPE_CHECKING = False  # no typing at run time: the client imports this module
if TYPE_CHECKING:
    from typing import Any

HEADER = struct.Struct("<cI")
MAX_FRAME = 64 << 20  # a payload larger than this ends the connection (no peer of ours sends one)
MAX_JSON = 8 << 20

# client -> service
REQUEST = b"Q"
STDIN = b"I"
LINE = b"L"
SIGNAL = b"S"
STATUS = b"T"
STOP = b"X"
# service -> client
ACCEPTED = b"A"
DECLINED = b"D"
STDOUT = b"O"
STDERR = b"E"
READ = b"R"
INPUT = b"P"
EXIT = b"Z"
NOTE = b"N"  # a line for the client's stderr from the service itself (e.g. "waiting for another call")


class ProtocolError(ConnectionError):
    """The peer sent something no localspec peer sends (or the connection ended mid-frame)."""


class Channel:
    """Frames over a connected socket: one reader, any number of writers (sends are locked, so
    frames from two threads never interleave)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        """One frame; OSError (BrokenPipeError, ...) when the peer is gone."""
        with self._send_lock:
            self.sock.sendall(HEADER.pack(kind, len(payload)) + payload)

    def send_json(self, kind: bytes, value: Any) -> None:
        self.send(kind, json.dumps(value, ensure_ascii=False).encode("utf-8"))

    def recv(self) -> tuple[bytes, bytes] | None:
        """The next frame, or None when the peer closed the connection between frames."""
        head = self._read(HEADER.size, allow_eof=True)
        if head is None:
            return None
        kind, length = HEADER.unpack(head)
        if length > MAX_FRAME:
            raise ProtocolError(f"a frame of {length} bytes (at most {MAX_FRAME})")
        payload = self._read(length, allow_eof=False) if length else b""
        assert payload is not None
        return kind, payload

    def _read(self, n: int, allow_eof: bool) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(min(n - got, 1 << 20))
            if not chunk:
                if allow_eof and got == 0:
                    return None
                raise ProtocolError("the connection ended in the middle of a frame")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def loads(payload: bytes) -> Any:
    """A JSON payload (ProtocolError when it is not one)."""
    if len(payload) > MAX_JSON:
        raise ProtocolError(f"a JSON frame of {len(payload)} bytes")
    try:
        return json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"a malformed JSON frame ({exc})") from None
