"""The prompt cache's entries on disk (:mod:`localspec.llama.prompt_cache` decides what to save
and restore): localspec's own file format and the store of entries under
``<cache root>/prompts/<model key>/``:

    MAGIC (8 bytes) | header length (u32, little endian) | header (JSON) | llama.cpp's state bytes

The header holds the format version, the model's state options (:attr:`Model.state_options`:
file identity, KV type, flash attention, stream layout, batch shape, CPU kernels, llama.cpp
build), the tokens and the state's length and SHA-256. A corrupt, truncated, foreign or refused
file is removed with a one-line warning. Writes go to a temporary file renamed into place, so
concurrent processes never read half a file; files are readable by the user alone (they hold
the user's prompts). The store is bounded in bytes and evicts the least recently used entries.

Only its own files are touched (:mod:`localspec.settings.files`): each model's entries live in a private
subdirectory (0700) the cache created; a subdirectory or entry that is a symbolic link, not a
regular file or another user's is skipped with a warning, never read, touched or deleted. The
root keeps its mode (it may be a shared directory with the sticky bit, like /tmp); a root that
belongs to another user otherwise is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from localspec.errors import ConfigError
from localspec.settings.files import TEMP_PREFIX, Foreign, StateDir, state_root

log = logging.getLogger("localspec.llama.prompt_cache")  # the cache's warnings come under one name

MAGIC = b"LSPROMPT"
FORMAT = 1
HEADER = struct.Struct("<8sI")
MAX_HEADER = 4 << 20  # a header longer than this is no file localspec wrote
SUFFIX = ".kv"
SUBDIR = re.compile(r"(?:[0-9a-f]{16}-)?[0-9a-f]{20}")  # a model's directory: [namespace-]model key
WHAT = "the prompt cache directory"
TODO = "name one of your own (--prompt-cache DIR), or turn the cache off (--prompt-cache off)"


class KeyedModel(Protocol):
    """What the store needs of a model: the options its state depends on."""

    @property
    def state_options(self) -> dict: ...


@dataclass(frozen=True)
class Entry:
    """One saved prefix (its header; the state stays on disk until restored)."""

    path: Path
    options: dict
    tokens: tuple[int, ...]
    state_bytes: int
    state_sha256: str
    size: int  # of the file
    used: float  # last use (the file's mtime)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def model_key(options: dict) -> str:
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:20]


class PromptStore:
    """The entries under `root`, at most `limit` bytes (see the module docstring); `namespace`:
    entries of another namespace are never used (a server's API key: its clients' prompts are not
    another key's)."""

    def __init__(self, root: str | os.PathLike, limit: int, namespace: str | None = None) -> None:
        self.root = Path(root).expanduser()
        self.limit = limit
        self.namespace = hashlib.sha256(namespace.encode()).hexdigest()[:16] if namespace else None
        self.disabled: str | None = None  # why the cache stopped working in this process (warned once)
        self._warned: set[Path] = set()  # files and directories the cache did not write (warned once each)

    # ------------------------------------------------------------------ the directories

    def check(self) -> None:
        """A ConfigError naming prompt_cache when the root exists and is refused (not a directory,
        another user's without the sticky bit); nothing is created."""
        with contextlib.suppress(FileNotFoundError):
            try:
                state_root(self.root, what=WHAT, create=False, shared=True, todo=TODO)
            except ConfigError as exc:
                raise ConfigError(str(exc), "prompt_cache") from None

    def _dir(self, model: KeyedModel) -> str:
        """The name of a model's subdirectory."""
        key = model_key(model.state_options)
        return f"{self.namespace}-{key}" if self.namespace else key

    def _root(self, create: bool) -> StateDir:
        return StateDir.open(self.root, what=WHAT, create=create, private=False, shared=True, todo=TODO)

    @contextlib.contextmanager
    def _sub(self, name: str, create: bool = False) -> Iterator[StateDir]:
        """A model's private subdirectory: ConfigError (a refused root), Foreign (a subdirectory
        the cache did not make), FileNotFoundError (absent without `create`)."""
        with self._root(create) as root:
            with root.child(name, create=create) as sub:
                yield sub

    def _subdirs(self, only: str | None = None) -> Iterator[tuple[StateDir, StateDir]]:
        """The root and each of the cache's own subdirectories in it (of one model, or all), open
        while the caller uses them."""
        try:
            root = self._root(False)
        except FileNotFoundError:
            return
        except (ConfigError, OSError) as exc:
            self._disable(str(exc))
            return
        with root:
            try:
                names = [only] if only is not None else [n for n in root.names() if SUBDIR.fullmatch(n)]
            except OSError:
                return
            for name in names:
                try:
                    sub = root.child(name)
                except FileNotFoundError:
                    continue
                except Foreign as exc:
                    self._skip(root.path / name, str(exc))
                    continue
                except OSError:
                    continue
                with sub:
                    yield root, sub

    def _skip(self, path: Path, why: str) -> None:
        """A file or directory the cache did not write: left alone, said once."""
        if path not in self._warned:
            self._warned.add(path)
            log.warning("prompt cache: ignoring %s: %s (the cache uses only files it wrote)", path, why)

    # ------------------------------------------------------------------ reading

    def entries(self, directory: str | None = None, *, tidy: bool = True) -> list[Entry]:
        """Every readable entry (of one model's directory, or of all); unreadable files of the
        cache's own are removed with a warning when `tidy` (`cache list` reads only)."""
        out = []
        for _, sub in self._subdirs(directory):
            try:
                names = sub.names()
            except OSError:
                continue
            for name in names:
                if name.endswith(SUFFIX) and not name.startswith("."):
                    entry = self._read_header(sub, name, tidy)
                    if entry is not None:
                        out.append(entry)
        return out

    def _read_header(self, sub: StateDir, name: str, tidy: bool) -> Entry | None:
        try:
            with sub.open_file(name) as f:  # a link, a FIFO or a device is never opened
                st = os.fstat(f.fileno())
                magic, n = HEADER.unpack(f.read(HEADER.size))
                if magic != MAGIC or n > MAX_HEADER:
                    raise ValueError("not a localspec prompt-cache file")
                header = json.loads(f.read(n).decode("utf-8"))
            if header.get("format") != FORMAT:
                raise ValueError(f"format {header.get('format')!r}, not {FORMAT}")
            tokens = tuple(int(t) for t in header["tokens"])
            state_bytes, digest = int(header["state_bytes"]), str(header["state_sha256"])
            if st.st_size != HEADER.size + n + state_bytes:
                raise ValueError(f"{st.st_size} bytes where the header says {HEADER.size + n + state_bytes}")
            return Entry(sub.path / name, dict(header["options"]), tokens, state_bytes, digest, st.st_size,
                         st.st_mtime)
        except FileNotFoundError:
            return None  # removed meanwhile (another process evicted it)
        except Foreign as exc:
            self._skip(sub.path / name, str(exc))
            return None
        except (OSError, ValueError, KeyError, TypeError, struct.error, AttributeError) as exc:
            if tidy:
                self._discard(sub, name, f"unreadable ({exc})")
            return None

    def _discard(self, sub: StateDir, name: str, why: str) -> None:
        """Remove an entry of the cache's own that failed its checks."""
        log.warning("prompt cache: removing %s: %s", sub.path / name, why)
        with contextlib.suppress(OSError, Foreign):
            sub.unlink(name)

    def load(self, entry: Entry) -> bytes | None:
        """The entry's state bytes, checked against its header (None: removed as corrupt, or gone)."""
        try:
            with self._sub(entry.path.parent.name) as sub, sub.open_file(entry.path.name) as f:
                why = "it changed since its header was read"
                if os.fstat(f.fileno()).st_size == entry.size:
                    f.seek(entry.size - entry.state_bytes)
                    data = f.read(entry.state_bytes)
                    why = "its checksum does not match (corrupt or truncated)"
                    if len(data) == entry.state_bytes and hashlib.sha256(data).hexdigest() == entry.state_sha256:
                        with contextlib.suppress(OSError):
                            os.utime(f.fileno())  # used now: the last to be evicted
                        return data
        except (FileNotFoundError, ConfigError):
            return None  # evicted meanwhile, or the root refused
        except Foreign as exc:
            self._skip(entry.path, str(exc))
            return None
        except OSError as exc:
            why = f"unreadable ({exc})"
        self._remove(entry, why)
        return None

    def _remove(self, entry: Entry, why: str | None = None) -> bool:
        """Remove an entry (`why`: said in a warning); False when it is gone or not the cache's own."""
        try:
            with self._sub(entry.path.parent.name) as sub:
                if why:
                    log.warning("prompt cache: removing %s: %s", entry.path, why)
                sub.unlink(entry.path.name)
            return True
        except (ConfigError, Foreign, OSError):
            return False

    def _touch(self, entry: Entry) -> None:
        with contextlib.suppress(ConfigError, Foreign, OSError), self._sub(entry.path.parent.name) as sub:
            with sub.open_file(entry.path.name) as f:
                os.utime(f.fileno())

    # ------------------------------------------------------------------ writing

    def _write(self, directory: str, options: dict, tokens: tuple[int, ...], data: bytes) -> Path | None:
        """Write the entry of `tokens` and their state into a model's directory, then evict what no
        longer fits. None: nothing written (said in a warning; the cache may be off after)."""
        header = json.dumps({"format": FORMAT, "options": options, "tokens": list(tokens),
                             "state_bytes": len(data), "state_sha256": hashlib.sha256(data).hexdigest(),
                             "saved": time.time()}).encode()
        name = hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:24] + SUFFIX
        try:
            with self._sub(directory, create=True) as sub:  # entries 0600 in a 0700 directory of the cache's own
                try:
                    sub.write(name, [HEADER.pack(MAGIC, len(header)), header, data])
                except Foreign as exc:  # something else holds the entry's name: left as it is
                    self._skip(sub.path / name, str(exc))
                    return None
        except Foreign as exc:
            self._disable(f"{self.root / directory} is {exc}: the cache writes only in directories it made")
            return None
        except ConfigError as exc:
            self._disable(str(exc))
            return None
        except OSError as exc:
            self._disable(f"cannot write to {self.root / directory} ({exc.strerror or exc})")
            return None
        self.evict()
        return self.root / directory / name

    def evict(self) -> None:
        """Remove the least recently used entries until the cache fits its limit."""
        entries = sorted(self.entries(), key=lambda e: e.used)
        total = sum(e.size for e in entries)
        for entry in entries:
            if total <= self.limit:
                break
            if self._remove(entry):
                total -= entry.size

    def clear(self) -> int:
        """Remove every entry of the cache's own (and leftover temporary files of its writes), then
        its emptied subdirectories; returns how many entries went. Links, other users' files and
        anything else are left where they are."""
        removed = 0
        for root, sub in self._subdirs():
            removed += self._clear(sub)
            with contextlib.suppress(OSError):
                root.rmdir(sub.path.name)  # only when emptied
        return removed

    def _clear(self, sub: StateDir) -> int:
        removed = 0
        for name in sub.names():
            if not (name.endswith(SUFFIX) or name.startswith(TEMP_PREFIX)):  # and writes a crash left
                continue
            try:
                sub.unlink(name)
                removed += not name.startswith(".")
            except Foreign as exc:
                self._skip(sub.path / name, str(exc))
            except OSError:
                pass
        return removed

    def size(self) -> int:
        return sum(e.size for e in self.entries(tidy=False))

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            self.disabled = why
            log.warning("prompt cache: off: %s", why)
