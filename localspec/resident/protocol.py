"""The frames a ``localspec`` client and the resident service exchange on a Unix socket.

A frame is one byte naming its kind, the payload's length (u32, little endian) and the payload,
a JSON object (UTF-8; text that is not valid Unicode, such as a path's undecodable bytes, kept
as surrogate escapes). A connection carries one exchange::

    client                                     service
    CALL {version, kind, pair, settings, ...} ─►  (localspec.core.calls.Request)
                                           ◄─  ACCEPT {}         (at once; or RETRY {reason}: this
                                                                  service takes no more calls)
                                           ◄─  EVENT {event: note|ready|text|done|failed, ...}, ...
    CANCEL {reason}   (Ctrl-C, SIGTERM)    ─►  any time: the call stops within one step
    (the connection closed)                ─►  the client is gone: the call stops at once

    STATUS {}                              ─►
                                           ◄─  STATUS {pid, pairs, ...}  (localspec.core.status)
    STOP {model | all}                     ─►
                                           ◄─  STOP {stopped: [...], ending}

Standard library only: the client imports it.
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
MAX_FRAME = 160 << 20  # a call holds a prompt and a context of up to 32 MiB each, tools and a schema

# client -> service
CALL = b"Q"
CANCEL = b"C"
STATUS = b"T"
STOP = b"X"
# service -> client
ACCEPT = b"A"
EVENT = b"V"
RETRY = b"Y"
FRAMES = (CALL, CANCEL, STATUS, STOP, ACCEPT, EVENT, RETRY)  # the kinds of frame


class ProtocolError(ConnectionError):
    """The peer sent something no localspec peer sends (or the connection ended mid-frame)."""


class Channel:
    """Frames over a connected socket: one reader, any number of writers (sends are locked, so
    frames from two threads never interleave)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, kind: bytes, value: Any) -> None:
        """One frame of a JSON value; OSError (BrokenPipeError, ...) when the peer is gone."""
        payload = dumps(value)
        if len(payload) > MAX_FRAME:
            raise ProtocolError(f"a frame of {len(payload)} bytes (at most {MAX_FRAME})")
        with self._send_lock:
            self.sock.sendall(HEADER.pack(kind, len(payload)) + payload)

    def recv(self) -> tuple[bytes, bytes] | None:
        """The next frame (kind, payload), or None when the peer closed the connection between
        frames; ProtocolError for a frame no peer of ours sends."""
        head = self._read(HEADER.size, allow_eof=True)
        if head is None:
            return None
        kind, length = HEADER.unpack(head)
        if kind not in FRAMES:
            raise ProtocolError(f"a frame of unknown kind {kind!r}")
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
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def dumps(value: Any) -> bytes:
    """A JSON value as a frame's payload (surrogate escapes pass: json.loads reads them back)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8", "surrogatepass")


def loads(payload: bytes) -> Any:
    """A JSON payload (ProtocolError when it is not one)."""
    try:
        return json.loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"a malformed JSON frame ({exc})") from None
