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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import struct
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from localspec.errors import ConfigError, ModelError

log = logging.getLogger(__name__)

MAGIC = b"LSPROMPT"
FORMAT = 1
HEADER = struct.Struct("<8sI")
MAX_HEADER = 4 << 20  # a header longer than this is no file localspec wrote
SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"  # a file being written (renamed to its entry's name when whole)
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
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    value = text.strip().upper().removesuffix("B")
    try:
        n = float(value[:-1]) * units[value[-1]] if value and value[-1] in units else float(value)
    except ValueError:
        n = -1
    if not n >= 0 or n != n:
        raise ConfigError(f"{LIMIT_ENV}={text!r} is not a size (e.g. 4G, 512M or a number of bytes)")
    return int(n)


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

    @classmethod
    def from_setting(cls, value: str | os.PathLike | None = None, limit: str | int | None = None,
                     **options: Any) -> PromptCache | None:
        """The cache a setting names: a directory, "off" (None), or None for the environment's
        LOCALSPEC_PROMPT_CACHE or else ``<cache root>/prompts``."""
        from localspec.llama import registry

        value = os.environ.get(ENV) if value is None else value
        if value is not None and str(value).strip().lower() in ("off", "none", "0", "false", ""):
            return None
        root = Path(value).expanduser() if value is not None else registry.cache_root() / "prompts"
        limit = os.environ.get(LIMIT_ENV) if limit is None else limit
        return cls(root, parse_limit(str(limit)) if limit is not None else DEFAULT_LIMIT, **options)

    # ------------------------------------------------------------------ reading

    def _dir(self, model: StatefulModel) -> Path:
        key = model_key(model.state_options)
        return self.root / f"{self.namespace}-{key}" if self.namespace else self.root / key

    def entries(self, directory: Path | None = None) -> list[Entry]:
        """Every readable entry (of one model's directory, or of all); unreadable files are
        removed with a warning."""
        dirs = [directory] if directory is not None else [d for d in self._subdirs()]
        out = []
        for d in dirs:
            with contextlib.suppress(OSError):
                for path in d.iterdir():
                    if path.suffix == SUFFIX and not path.name.startswith("."):
                        entry = self._read_header(path)
                        if entry is not None:
                            out.append(entry)
        return out

    def _subdirs(self) -> list[Path]:
        try:
            return [d for d in self.root.iterdir() if d.is_dir()]
        except OSError:
            return []

    def _read_header(self, path: Path) -> Entry | None:
        try:
            if not stat.S_ISREG(path.stat().st_mode):  # a FIFO or a device would block or never end
                log.warning("prompt cache: ignoring %s: not a regular file", path)
                return None
            with path.open("rb") as f:
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
            return Entry(path, dict(header["options"]), tokens, state_bytes, digest, st.st_size, st.st_mtime)
        except FileNotFoundError:
            return None  # removed meanwhile (another process evicted it)
        except (OSError, ValueError, KeyError, TypeError, struct.error, AttributeError) as exc:
            self._discard(path, f"unreadable ({exc})")
            return None

    def _discard(self, path: Path, why: str) -> None:
        log.warning("prompt cache: removing %s: %s", path, why)
        with contextlib.suppress(OSError):
            path.unlink()

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
        """The entry's state bytes, checked against its header (None: removed as corrupt)."""
        try:
            with entry.path.open("rb") as f:
                f.seek(entry.size - entry.state_bytes)
                data = f.read(entry.state_bytes)
        except OSError as exc:
            self._discard(entry.path, f"unreadable ({exc})")
            return None
        if len(data) != entry.state_bytes or hashlib.sha256(data).hexdigest() != entry.state_sha256:
            self._discard(entry.path, "its checksum does not match (corrupt or truncated)")
            return None
        with contextlib.suppress(OSError):
            os.utime(entry.path)  # used now: the last to be evicted
        return data

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
                with contextlib.suppress(OSError):
                    os.utime(entry.path)
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
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            with contextlib.suppress(OSError):
                os.chmod(self.root, 0o700)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=TEMP_PREFIX, suffix=".part")  # mode 0600; no entry yet
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(HEADER.pack(MAGIC, len(header)))
                    f.write(header)
                    f.write(data)
                os.replace(tmp, directory / name)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            self._disable(f"cannot write to {directory} ({exc.strerror or exc})")
            return None
        self.evict()
        return directory / name

    def evict(self) -> None:
        """Remove the least recently used entries until the cache fits its limit."""
        entries = sorted(self.entries(), key=lambda e: e.used)
        total = sum(e.size for e in entries)
        for entry in entries:
            if total <= self.limit:
                break
            with contextlib.suppress(OSError):
                entry.path.unlink()
                total -= entry.size

    def clear(self) -> int:
        """Remove every entry (and leftover temporary files); returns how many files went."""
        removed = 0
        for d in self._subdirs():
            with contextlib.suppress(OSError):
                for path in d.iterdir():
                    if path.suffix == SUFFIX or path.name.startswith(TEMP_PREFIX):  # and writes a crash left
                        with contextlib.suppress(OSError):
                            path.unlink()
                            removed += path.suffix == SUFFIX
                with contextlib.suppress(OSError):
                    d.rmdir()
        return removed

    def size(self) -> int:
        return sum(e.size for e in self.entries())

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
            self._discard(entry.path, "llama.cpp refused its state")
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
