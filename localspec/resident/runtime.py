"""Where resident services live and how a client finds one (the standard library only: the
``localspec`` client imports this before anything else).

A service is two files in the per-user runtime directory (:func:`localspec.locations.runtime_dir`,
private: 0700, this user's, never a symbolic link): its socket ``<id>.sock`` (0600) and its
record ``<id>.json`` (0600: pid, models, keep-alive, the environment and code it was started
with), written after the socket listens and removed when it exits. A record whose socket refuses
connections belongs to a service that died: :func:`connect` removes both files. Every connection
is checked with ``SO_PEERCRED``: a service talks to its own user only, and so does a client.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import struct
from pathlib import Path

TYPE_CHECKING = False  # no typing at run time: the client imports this module
if TYPE_CHECKING:
    from typing import Any, Mapping

import localspec
from localspec import locations
from localspec.files import private_dir
from localspec.resident.protocol import Channel

SOCKET_SUFFIX = ".sock"
RECORD_SUFFIX = ".json"
LOG_SUFFIX = ".log"
MAX_RECORD = 64 << 10
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux
# the environment a service was started with and that changes what a call does or where it
# writes: a client whose values differ is never served by it
ENV_PREFIXES = ("LOCALSPEC_", "GGML_", "LLAMA_", "OMP_", "CUDA_", "HIP_", "OPENBLAS_")
ENV_NAMES = ("HOME", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR")
ENV_IGNORED = ("LOCALSPEC_KEEP_ALIVE", "LOCALSPEC_API_KEY")  # read per call / by serve only
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class NotPrivate(OSError):
    """The runtime directory cannot be used (a symbolic link, another user's, open to others)."""


def directory(create: bool = True) -> Path:
    """The runtime directory, checked (NotPrivate with the reason otherwise)."""
    from localspec.errors import ConfigError

    try:
        return private_dir(locations.runtime_dir(), what="the runtime directory of resident services",
                           create=create)
    except ConfigError as exc:
        raise NotPrivate(str(exc)) from None


def env_subset(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that a service's key covers."""
    return {k: v for k, v in sorted(env.items())
            if (k.startswith(ENV_PREFIXES) or k in ENV_NAMES) and k not in ENV_IGNORED}


def env_key(env: Mapping[str, str]) -> dict[str, str]:
    """What a service records of its environment, and a client's must equal (the record is
    private: no secret of serve's is in it)."""
    return env_subset(env)


def code_identity() -> dict[str, Any]:
    """Which localspec this is: its version and where its package lives (another checkout or
    install is another localspec). The service adds llama.cpp's version and checks both files
    before each call."""
    return {"localspec": localspec.__version__, "package": os.path.dirname(os.path.abspath(localspec.__file__))}


class Record:
    """What a service wrote about itself (`path`: the record file)."""

    __slots__ = ("id", "path", "data")

    def __init__(self, id: str, path: Path, data: dict[str, Any]) -> None:
        self.id, self.path, self.data = id, path, data

    @property
    def socket_path(self) -> Path:
        return self.path.with_suffix(SOCKET_SUFFIX)

    @property
    def pid(self) -> int:
        return int(self.data.get("pid", 0))

    def matches(self, env: Mapping[str, str]) -> bool:
        """Whether a client with this environment and code may be served by it (the service
        checks the models and options itself)."""
        return self.data.get("env") == env_key(env) and self.data.get("code") == code_identity()


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > MAX_RECORD:
            return None
        data = os.read(fd, MAX_RECORD + 1)
    finally:
        os.close(fd)
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def records(where: Path | None = None) -> list[Record]:
    """The records of every service in the runtime directory, most recently started first."""
    try:
        where = where or directory(create=False)
        names = os.listdir(where)
    except (OSError, FileNotFoundError):
        return []
    out = []
    for name in names:
        if name.endswith(RECORD_SUFFIX) and not name.startswith("."):
            path = where / name
            data = _read_record(path)
            if data is not None:
                out.append(Record(name[: -len(RECORD_SUFFIX)], path, data))
    return sorted(out, key=lambda r: -float(r.data.get("started", 0)))


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid


def remove_stale(record: Record) -> None:
    """Remove a dead service's socket and record (only what is a socket / regular file of ours)."""
    log_path = record.path.with_suffix(LOG_SUFFIX)
    for path, is_type in ((record.socket_path, stat.S_ISSOCK), (record.path, stat.S_ISREG), (log_path, stat.S_ISREG)):
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if is_type(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)


def connect(record: Record, timeout: float | None = None) -> Channel | None:
    """A channel to the service of `record`, checked to be run by this user; None when it is
    gone (a stale socket or record is removed). `timeout`: of every later operation too (None:
    a call's channel, which waits as long as the call runs)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout if timeout is not None else 5.0)
    try:
        sock.connect(str(record.socket_path))
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            remove_stale(record)  # nobody listens: a service closes its socket only as it exits
        return None
    if peer_uid(sock) != os.geteuid():
        sock.close()
        return None
    sock.settimeout(timeout)
    return Channel(sock)


def proc_bytes(path: str, field: str) -> int:
    """A "Field: N kB" line of a /proc file (/proc/meminfo, /proc/self/status) in bytes; 0 where
    there is none (not Linux)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    return 0


def socket_path_fits(path: Path) -> bool:
    return len(os.fsencode(str(path))) <= MAX_SOCKET_PATH
