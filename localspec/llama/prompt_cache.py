"""A persistent cache of prompt prefixes: the target's KV state after a prefill, on disk.

After a prefill the state of the prompt's sequence (llama.cpp's ``llama_state_seq_get_data``) is
saved; a later run, in this process or another, restores the longest saved prefix of its prompt
and prefills only the rest. Entries live under ``<cache root>/prompts/<model key>/`` in
localspec's own format:

    MAGIC (8 bytes) | header length (u32, little endian) | header (JSON) | llama.cpp's state bytes

The header holds the format version, the model's state options (:attr:`Model.state_options`:
file identity, KV type, flash attention, stream layout, batch shape, CPU kernels, llama.cpp
build), the tokens and the state's length and SHA-256. An entry is used only if its options
equal the model's, its tokens are a prefix of the prompt's (compared, never trusted to a hash)
and its checksum holds; a corrupt, truncated, foreign or refused file is removed with a one-line
warning. Writes go to a temporary file renamed into place, so concurrent processes never read
half a file; files are readable by the user alone (they hold the user's prompts). The cache is
bounded in bytes and evicts the least recently used entries.

Only its own files are touched (:mod:`localspec.files`): each model's entries live in a private
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
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

from localspec import environment
from localspec.errors import ConfigError, ModelError
from localspec.files import TEMP_PREFIX, Foreign, StateDir, state_root

log = logging.getLogger(__name__)

MAGIC = b"LSPROMPT"
FORMAT = 1
HEADER = struct.Struct("<8sI")
MAX_HEADER = 4 << 20  # a header longer than this is no file localspec wrote
SUFFIX = ".kv"
SUBDIR = re.compile(r"(?:[0-9a-f]{16}-)?[0-9a-f]{20}")  # a model's directory: [namespace-]model key
WHAT = "the prompt cache directory"
TODO = "name one of your own (--prompt-cache DIR), or turn the cache off (--prompt-cache off)"
MIN_TOKENS = 32  # shorter prefixes: prefilling them costs about what saving and restoring does
DEFAULT_LIMIT = 4 << 30  # bytes on disk
ENV = "LOCALSPEC_PROMPT_CACHE"  # a directory, or "off"
LIMIT_ENV = "LOCALSPEC_PROMPT_CACHE_LIMIT"  # bytes, or with a K/M/G suffix


class StatefulModel(Protocol):
    """What the cache needs of a model (localspec.llama.model.Model has it)."""

    n_ctx: int

    @property
    def state_options(self) -> dict: ...

    @property
    def state_refusal(self) -> str | None: ...

    def seq_state(self) -> bytes: ...

    def set_seq_state(self, data: bytes) -> bool: ...


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


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def model_key(options: dict) -> str:
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:20]


def parse_limit(text: str) -> int:
    """Bytes of a size such as 4G, 512M, 100000 (ConfigError naming the setting otherwise)."""
    return environment.parse_size(text, LIMIT_ENV)


class PromptCache:
    """Saved prompt prefixes under `root`, at most `limit` bytes (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, limit: int = DEFAULT_LIMIT, min_tokens: int = MIN_TOKENS,
                 memory: int = 0, namespace: str | None = None) -> None:
        """`memory`: bytes of states also kept in this process (a server's conversations restore
        from memory first); `namespace`: entries of another namespace are never used (a server's
        API key: its clients' prompts are not another key's)."""
        self.root = Path(root).expanduser()
        self.limit = limit
        self.min_tokens = min_tokens
        self.memory_limit = memory
        self.namespace = hashlib.sha256(namespace.encode()).hexdigest()[:16] if namespace else None
        self._memory: OrderedDict[tuple[str, tuple[int, ...]], bytes] = OrderedDict()
        self.disabled: str | None = None  # why the cache stopped working in this process (warned once)
        self._refused: set[str] = set()  # models whose state cannot be cached (warned once each)
        self._warned: set[Path] = set()  # files and directories the cache did not write (warned once each)

    @classmethod
    def from_setting(cls, value: str | os.PathLike | None = None, limit: str | int | None = None,
                     **options: Any) -> PromptCache | None:
        """The cache a setting names: a directory, "off" (None), or None for the environment's
        LOCALSPEC_PROMPT_CACHE or else ``<cache root>/prompts``."""
        from localspec.llama import registry

        if value is None:  # the environment's (an empty variable is unset)
            setting = environment.get(ENV)
        elif str(value).strip() == "":
            setting = False
        else:
            setting = environment.parse_dir_or_off(os.fsdecode(value), "prompt_cache", "prompt_cache")
        if setting is False:
            return None
        root = setting if setting is not None else registry.cache_root() / "prompts"
        size = environment.get(LIMIT_ENV) if limit is None else parse_limit(str(limit))
        cache = cls(root, size, **options)
        if setting is not None:  # a directory the user named: refused now (the default one: off, with a warning)
            cache.check()
        return cache

    # ------------------------------------------------------------------ the directories

    def check(self) -> None:
        """A ConfigError naming prompt_cache when the root exists and is refused (not a directory,
        another user's without the sticky bit); nothing is created."""
        with contextlib.suppress(FileNotFoundError):
            try:
                state_root(self.root, what=WHAT, create=False, shared=True, todo=TODO)
            except ConfigError as exc:
                raise ConfigError(str(exc), "prompt_cache") from None

    def _dir(self, model: StatefulModel) -> str:
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

    def best(self, model: StatefulModel, prompt: Sequence[int]) -> tuple[Entry, int] | None:
        """The entry sharing the longest prefix with `prompt` (at most all but its last token,
        at least min_tokens) and how many tokens of it to keep."""
        if self._off(model):
            return None
        options = model.state_options
        found: tuple[Entry, int] | None = None
        for entry in self.entries(self._dir(model)):
            if entry.options != options or len(entry.tokens) > model.n_ctx:
                continue
            keep = min(_common(entry.tokens, prompt), len(prompt) - 1)
            if keep >= self.min_tokens and (found is None or keep > found[1]
                                            or (keep == found[1] and entry.state_bytes < found[0].state_bytes)):
                found = (entry, keep)
        return found

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

    def save(self, model: StatefulModel, tokens: Sequence[int]) -> Path | None:
        """Save the model's sequence-0 state, which holds exactly `tokens`, unless it is too short
        or an entry already holds all but fewer than min_tokens of them (a question after a saved
        document: restoring that entry and prefilling the rest costs about what a save would, and
        the disk keeps one copy of the document). None: nothing written."""
        if len(tokens) < self.min_tokens or self._off(model):
            return None
        directory = self._dir(model)
        options = model.state_options
        tokens = tuple(int(t) for t in tokens)
        if self.memory_limit > 0 and not self._in_memory(model, tokens):
            try:
                self._remember(model, tokens, model.seq_state())
            except ModelError as exc:
                self._disable(str(exc))
                return None
        for entry in self.entries(directory):  # an entry sharing all but a few of these tokens is enough
            if entry.options == options and len(tokens) - _common(entry.tokens, tokens) < self.min_tokens:
                self._touch(entry)
                return None
        try:
            data = self._memory.get((model_key(options), tokens)) or model.seq_state()
        except ModelError as exc:  # llama.cpp could not serialise the state: no cache, never a failed run
            self._disable(str(exc))
            return None
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

    # ------------------------------------------------------------------ in memory

    def _in_memory(self, model: StatefulModel, tokens: tuple[int, ...]) -> bool:
        """Whether a state in memory holds all but fewer than min_tokens of `tokens`."""
        key = model_key(model.state_options)
        return any(k == key and len(tokens) - _common(t, tokens) < self.min_tokens for k, t in self._memory)

    def _remember(self, model: StatefulModel, tokens: tuple[int, ...], data: bytes) -> None:
        """Keep a state in memory, dropping the least recently used past memory_limit bytes."""
        self._memory[(model_key(model.state_options), tokens)] = data
        total = sum(len(d) for d in self._memory.values())
        while total > self.memory_limit and self._memory:
            total -= len(self._memory.popitem(last=False)[1])

    def _memory_best(self, model: StatefulModel, prompt: Sequence[int]) -> tuple[tuple[int, ...], int] | None:
        key = model_key(model.state_options)
        found: tuple[tuple[int, ...], int] | None = None
        for k, tokens in self._memory:
            if k == key and len(tokens) <= model.n_ctx:
                keep = min(_common(tokens, prompt), len(prompt) - 1)
                if keep >= self.min_tokens and (found is None or keep > found[1]):
                    found = (tokens, keep)
        return found

    # ------------------------------------------------------------------ restoring

    def restore(self, model: Any, prompt: Sequence[int]) -> int:
        """Restore into the model's sequence the longest saved prefix of `prompt` (from memory,
        else from disk) when it is longer than what the cache already holds of it; returns the
        prompt tokens the cache holds after."""
        sequence = model.sequence
        held = _common(sequence.tokens[: sequence.n_cached], prompt[: len(prompt) - 1])
        if self._off(model):
            return held
        in_memory = self._memory_best(model, prompt) if self._memory else None
        if in_memory is not None and in_memory[1] > held:
            tokens, keep = in_memory
            key = (model_key(model.state_options), tokens)
            self._memory.move_to_end(key)
            data = self._memory[key]
            if sequence.restore(tokens, lambda: model.set_seq_state(data), keep):
                log.info("prompt cache: restored %d of %d prompt tokens from memory", keep, len(prompt))
                return keep
            del self._memory[key]
            held = 0
        found = self.best(model, prompt)
        if found is None or found[1] <= held:
            return held
        entry, keep = found
        data = self.load(entry)
        if data is None:
            return held
        if not sequence.restore(entry.tokens, lambda: model.set_seq_state(data), keep):
            self._remove(entry, "llama.cpp refused its state")
            return 0
        if self.memory_limit > 0:
            self._remember(model, entry.tokens, data)
        log.info("prompt cache: restored %d of %d prompt tokens from %s", keep, len(prompt), entry.path.name)
        return keep

    # ------------------------------------------------------------------ refusals

    def _off(self, model: StatefulModel) -> bool:
        if self.disabled is not None:
            return True
        refusal = model.state_refusal
        if refusal is not None:
            if refusal not in self._refused:
                self._refused.add(refusal)
                log.warning("prompt cache: off for this model: %s", refusal)
            return True
        return False

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            self.disabled = why
            log.warning("prompt cache: off: %s", why)
