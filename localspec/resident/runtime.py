"""Where the resident service lives and how a client reaches it (the standard library only: the
``localspec`` client imports this before anything else).

One service per user holds every pair. It is a socket in the per-user runtime directory
(:func:`localspec.settings.locations.runtime_dir`, private: 0700, this user's, never a symbolic link),
``<name>.sock`` (0600), where the name says which localspec it runs (version and install) and
the environment its process was started with that changes how llama.cpp runs (``GGML_*``,
``OMP_*``, ...) or where localspec keeps its state (the cache and profile directories): a client
whose own differ is served by another service. A service's log is ``<name>-<token>.log`` (0600),
removed when it ends cleanly and kept when it crashed. Every connection is checked with
``SO_PEERCRED``: a service talks to its own user only, and so does a client.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import stat
import struct
from pathlib import Path

TYPE_CHECKING = False  # no typing at run time: the client imports this module
if TYPE_CHECKING:
    from collections.abc import Iterator

import localspec
from localspec.resident.protocol import Channel
from localspec.settings import environment, locations
from localspec.settings.files import private_dir

SOCKET_SUFFIX = ".sock"
LOG_SUFFIX = ".log"
SPAWN_LOCK = "spawn.lock"
KEEP_CRASH_LOGS = 5  # logs of services that did not end cleanly, kept for the user to read
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux
# the environment a service's process was started with that changes what it does: llama.cpp's
# and its thread libraries' settings (read when the process starts)
ENV_PREFIXES = (b"GGML_", b"LLAMA_", b"OMP_", b"GOMP_", b"KMP_", b"CUDA_", b"HIP_", b"OPENBLAS_")
ENV_NAMES = (b"LOCALSPEC_LLAMA_LOG", b"LOCALSPEC_RPC_TIMEOUT")
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


def service_name() -> str:
    """The name of the service this process's calls go to (see the module docstring)."""
    digest = hashlib.sha256()
    for part in (localspec.__version__, os.path.dirname(os.path.abspath(localspec.__file__)),
                 os.fspath(locations.cache_root().absolute()), os.fspath(locations.profile_dir().absolute())):
        digest.update(os.fsencode(part) + b"\0")
    defaults = {os.fsencode(k): os.fsencode(v) for k, v in environment.PROCESS_DEFAULTS.items()}
    for name, value in sorted({**defaults, **os.environb}.items()):  # as a command line's process sees it
        if name.startswith(ENV_PREFIXES) or name in ENV_NAMES:
            digest.update(name + b"=" + value + b"\0")
    return f"service-{digest.hexdigest()[:12]}"


def socket_path(where: Path, name: str) -> Path:
    return where / f"{name}{SOCKET_SUFFIX}"


def socket_path_fits(path: Path) -> bool:
    return len(os.fsencode(str(path))) <= MAX_SOCKET_PATH


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid


def is_our_socket(path: Path) -> bool:
    """Whether `path` is a socket of this user's (not followed if it is a link)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid()


def connect(path: Path, timeout: float | None = None) -> Channel | None:
    """A channel to the service listening at `path`, checked to be run by this user; None when
    none listens there (a socket left by a service that died is removed). `timeout`: of every
    later operation too (None: a call's channel, which waits as long as the call runs)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.ECONNREFUSED and is_our_socket(path):
            with spawn_lock(path.parent):  # nobody listens: a service closes its socket only as it exits
                with contextlib.suppress(OSError):
                    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        probe.connect(str(path))
                    except OSError as again:
                        if again.errno == errno.ECONNREFUSED and is_our_socket(path):
                            os.unlink(path)
                    finally:
                        probe.close()
        return None
    if peer_uid(sock) != os.geteuid():
        sock.close()
        return None
    sock.settimeout(timeout)
    return Channel(sock)


def sockets(where: Path | None = None) -> list[Path]:
    """Every service socket in the runtime directory (none when it does not exist)."""
    try:
        where = where or directory(create=False)
        names = os.listdir(where)
    except OSError:
        return []
    return sorted(where / n for n in names if n.endswith(SOCKET_SUFFIX) and not n.startswith("."))


@contextlib.contextmanager
def spawn_lock(where: Path) -> Iterator[None]:
    """The lock under which one client at a time starts a service and a service removes its
    socket: N clients arriving at once start one service."""
    fd = os.open(where / SPAWN_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def listen(path: Path) -> socket.socket:
    """A listening socket at `path` (0600 from the start); call under spawn_lock, where no
    service listens at `path` (a stale socket of ours is replaced)."""
    if is_our_socket(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(64)
    return sock


def prune_logs(where: Path, name: str) -> None:
    """Keep the newest KEEP_CRASH_LOGS logs of crashed services (a live service's is its own)."""
    logs = []
    for entry in os.scandir(where):
        if entry.name.startswith(name + "-") and entry.name.endswith(LOG_SUFFIX):
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                    logs.append((st.st_mtime, entry.path))
    for _, path in sorted(logs, reverse=True)[KEEP_CRASH_LOGS:]:
        with contextlib.suppress(OSError):
            os.unlink(path)
