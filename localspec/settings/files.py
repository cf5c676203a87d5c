"""Files: the one place where localspec opens them, so that it reads and writes only its own.

Two kinds:

* **Files the user names** (``--grammar``, ``--json-schema``, ``--tools``, ``--context``, prompt
  files, a prompt piped on stdin): read with a size bound enforced while reading, so a device
  (``/dev/zero``), a FIFO or a huge file ends in a one-line :class:`ConfigError` naming the option
  and the limit, never in a hang or an exhausted memory (:func:`read_user_file`,
  :func:`read_user_text`, :func:`read_stream`).
* **localspec's own state** (the prompt cache, saved chats, cost profiles, kernel check records):
  directories opened by descriptor (:class:`StateDir`). Inside them a symbolic link, anything but
  a regular file, a file of another user or one with other hard links is :class:`Foreign`: never
  opened, rewritten, touched or deleted. Writes go to a new private file (0600) renamed into
  place. A directory localspec did not create keeps its mode; one owned by another user is
  refused with a message (:func:`private_dir`, :func:`state_root`).

A leaf: the standard library and :mod:`localspec.errors` only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path

TYPE_CHECKING = False  # typing is not imported at run time (the `localspec` client uses this module)
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import BinaryIO

from localspec.errors import ConfigError

MiB = 1 << 20
SPEC_LIMIT = 4 * MiB  # --grammar, --json-schema and --tools files: a grammar, a schema, a list of tools
TEXT_LIMIT = 32 * MiB  # --context, prompt files, a prompt piped on stdin, one line of a piped chat
STATE_LIMIT = 16 * MiB  # a cost profile or a record of kernel checks (a larger one is no file localspec wrote)
CHUNK = 1 << 16
TEMP_PREFIX = ".tmp-"  # a state file being written (renamed to its name when whole)
TEMP_SUFFIX = ".part"
PRIVATE = 0o700


def mib(n: int) -> str:
    return f"{n / MiB:g} MiB"


# ---------------------------------------------------------------- files the user names


def read_bounded(fd: int, limit: int) -> bytes | None:
    """At most `limit` bytes from a descriptor, in chunks; None when there are more (it reads at
    most limit + 1 bytes, so an endless source ends here)."""
    chunks: list[bytes] = []
    total = 0
    while total <= limit:
        chunk = os.read(fd, min(CHUNK, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks) if total <= limit else None


def _too_large(what: str, where: object, limit: int, param: str | None) -> ConfigError:
    return ConfigError(f"{what} {where}: larger than {mib(limit)}, the most localspec reads for it", param)


def read_user_file(path: str | os.PathLike, *, param: str, limit: int, what: str = "file") -> bytes:
    """The bytes of a file the user named (`param`: the option, for the error), at most `limit`.
    A FIFO without a writer reads as empty instead of waiting; a missing file, a directory, a file
    that cannot be read or one larger than `limit` is a one-line ConfigError naming `param`."""
    shown = Path(path).expanduser()
    try:
        fd = os.open(shown, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {shown}", param) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {shown}: {exc.strerror or exc}", param) from None
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise ConfigError(f"{what} {shown} is a directory, not a file", param)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        data = read_bounded(fd, limit)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {shown}: {exc.strerror or exc}", param) from None
    finally:
        os.close(fd)
    if data is None:
        raise _too_large(what, shown, limit, param)
    return data


def decode_text(data: bytes, *, what: str, param: str | None) -> str:
    """UTF-8 text, or a ConfigError saying where it is not (a byte order mark is dropped)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
                          param) from None


def read_user_text(path: str | os.PathLike, *, param: str, limit: int, what: str = "file") -> str:
    """:func:`read_user_file` as UTF-8 text (a clear ConfigError where it is not)."""
    data = read_user_file(path, param=param, limit=limit, what=what)
    return decode_text(data, what=f"{what} {Path(path).expanduser()}", param=param)


def read_stream(stream: BinaryIO, *, limit: int, what: str, param: str | None = None) -> bytes:
    """At most `limit` bytes of a binary stream to its end (standard input); a ConfigError when
    there are more."""
    chunks: list[bytes] = []
    total = 0
    while total <= limit:
        chunk = stream.read(min(CHUNK, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > limit:
        raise ConfigError(f"{what} is larger than {mib(limit)}, the most localspec reads for it", param)
    return b"".join(chunks)


# ---------------------------------------------------------------- directories


def _refusal(what: str, path: Path, problem: str, todo: str) -> ConfigError:
    return ConfigError(f"{what} {path} {problem}: {todo}")


def _open_dir(path: Path, *, what: str, private: bool, shared: bool, todo: str | None = None) -> int:
    """A descriptor of an existing directory that is ours (`private`: not a symbolic link and open
    to no one else; `shared`: another user's is accepted when it has the sticky bit, like /tmp);
    a ConfigError otherwise. FileNotFoundError when absent."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if private else 0)
    todo = todo or "choose another directory (localspec never changes the permissions of a directory it did not create)"
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and path.is_symlink()):
            raise _refusal(what, path, "is a symbolic link", todo) from None
        if exc.errno == errno.ENOTDIR:
            raise _refusal(what, path, "is not a directory", todo) from None
        raise _refusal(what, path, f"cannot be opened ({exc.strerror or exc})", todo) from None
    try:
        st = os.fstat(fd)
        mine = st.st_uid == os.geteuid()
        if not mine and not (shared and st.st_mode & stat.S_ISVTX):
            raise _refusal(what, path, f"belongs to another user (uid {st.st_uid}, you are {os.geteuid()})", todo)
        if private and stat.S_IMODE(st.st_mode) & 0o077:
            raise _refusal(what, path, f"is open to other users (mode {stat.S_IMODE(st.st_mode):04o})",
                           f"chmod 700 it, or {todo}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_dir(path: Path) -> bool:
    """Create `path` (0700; its parents with the default mode); False when it already existed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, PRIVATE)
    except FileExistsError:
        return False
    return True


def _open_or_make(path: str | os.PathLike, *, what: str, create: bool, private: bool, shared: bool,
                  todo: str | None = None) -> tuple[Path, int]:
    p = Path(path).expanduser()
    made = False
    if create:
        try:
            made = _make_dir(p)
        except FileExistsError:  # a parent (or the path) is a file: refused below as "not a directory"
            pass
        except OSError as exc:
            raise ConfigError(f"cannot create {what} {p}: {exc.strerror or exc}") from None
    try:
        fd = _open_dir(p, what=what, private=private or made, shared=shared, todo=todo)
    except FileNotFoundError:
        if create:
            raise ConfigError(f"cannot create {what} {p}: a parent is not a directory") from None
        raise
    if made and stat.S_IMODE(os.fstat(fd).st_mode) != PRIVATE:
        os.fchmod(fd, PRIVATE)  # ours, just made: exactly 0700 whatever the umask
    return p, fd


def private_dir(path: str | os.PathLike, *, what: str, create: bool = True) -> Path:
    """A directory only this user can use. Absent: created with mode 0700 (parents as needed,
    with the default mode); without `create`, FileNotFoundError. Present: a ConfigError naming
    `what` and the path when it is a symbolic link, not a directory, another user's, or open to
    group or others (mode & 0o077) — its mode is never changed."""
    p, fd = _open_or_make(path, what=what, create=create, private=True, shared=False)
    os.close(fd)
    return p


def state_root(path: str | os.PathLike, *, what: str, create: bool = True, shared: bool = False,
               todo: str | None = None) -> Path:
    """A directory localspec keeps state in: absent, created 0700; present, it must be this
    user's (`shared`: or have the sticky bit, like /tmp, where only private subdirectories are
    used). Its mode is never changed; a ConfigError says what is wrong otherwise (`todo`: what
    to do instead, in it)."""
    p, fd = _open_or_make(path, what=what, create=create, private=False, shared=shared, todo=todo)
    os.close(fd)
    return p


# ---------------------------------------------------------------- state files


class Foreign(Exception):
    """A name in a state directory that localspec did not write: a symbolic link, no regular file,
    another user's file, or a file with other hard links. Skipped: never opened, rewritten,
    touched or deleted."""


def check_ours(st: os.stat_result, *, links: bool = False) -> None:
    """Foreign unless `st` (from lstat or fstat) is a regular file of ours with one link (`links`:
    or more: replacing or removing a name never changes the file its other names hold)."""
    if stat.S_ISLNK(st.st_mode):
        raise Foreign("a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise Foreign("not a regular file")
    if st.st_uid != os.geteuid():
        raise Foreign(f"another user's file (uid {st.st_uid})")
    if st.st_nlink != 1 and not links:
        raise Foreign(f"a file with {st.st_nlink} hard links")


class StateDir:
    """A directory of localspec's state files, held by a descriptor: every name in it is looked
    up relative to that descriptor and never through a symbolic link."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def open(cls, path: str | os.PathLike, *, what: str, create: bool = True, private: bool = True,
             shared: bool = False, todo: str | None = None) -> StateDir:
        """The directory (see :func:`private_dir`; without `private`, :func:`state_root`): a
        ConfigError when it is refused, FileNotFoundError when absent and not `create`."""
        p, fd = _open_or_make(path, what=what, create=create, private=private, shared=shared, todo=todo)
        return cls(fd, p)

    def __enter__(self) -> StateDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def child(self, name: str, *, create: bool = False) -> StateDir:
        """A private subdirectory (0700, ours, no symbolic link), created when absent and
        `create`: Foreign when the name is anything else, FileNotFoundError when absent."""
        made = False
        if create:
            try:
                os.mkdir(name, PRIVATE, dir_fd=self.fd)
                made = True
            except FileExistsError:
                pass
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            link = stat.S_ISLNK(self.lstat(name).st_mode)
            raise Foreign("a symbolic link" if link else "not a directory") from None
        st = os.fstat(fd)
        if made and stat.S_IMODE(st.st_mode) != PRIVATE:
            os.fchmod(fd, PRIVATE)
        elif st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            os.close(fd)
            raise Foreign(f"another user's directory (uid {st.st_uid})" if st.st_uid != os.geteuid()
                          else f"a directory open to other users (mode {stat.S_IMODE(st.st_mode):04o})")
        return StateDir(fd, self.path / name)

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def open_file(self, name: str) -> BinaryIO:
        """A regular file of ours, opened for reading (Foreign otherwise; FileNotFoundError)."""
        check_ours(self.lstat(name))  # a FIFO or a device is never opened
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                         dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Foreign("a symbolic link") from None
            raise
        try:
            check_ours(os.fstat(fd))  # replaced since the lstat
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    def read(self, name: str, limit: int = STATE_LIMIT) -> bytes:
        """The bytes of a regular file of ours: Foreign, FileNotFoundError, or ValueError when it
        is larger than `limit`."""
        with self.open_file(name) as f:
            data = read_bounded(f.fileno(), limit)
        if data is None:
            raise ValueError(f"larger than {mib(limit)}")
        return data

    def write(self, name: str, chunks: bytes | Iterable[bytes]) -> None:
        """Replace `name` atomically with a new file (0600) holding `chunks`; Foreign when the name
        holds something localspec did not write (left as it is)."""
        with contextlib.suppress(FileNotFoundError):
            check_ours(self.lstat(name), links=True)
        import secrets

        tmp = f"{TEMP_PREFIX}{secrets.token_hex(8)}{TEMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in [chunks] if isinstance(chunks, bytes) else chunks:
                    f.write(chunk)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def unlink(self, name: str) -> None:
        """Remove a regular file of ours (Foreign otherwise: left as it is)."""
        check_ours(self.lstat(name), links=True)
        os.unlink(name, dir_fd=self.fd)

    def rmdir(self, name: str) -> None:
        os.rmdir(name, dir_fd=self.fd)  # never follows a link (ENOTDIR)
