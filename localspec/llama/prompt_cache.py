"""A persistent cache of prompt prefixes: the target's KV state after a prefill, on disk.

After a prefill the state of the prompt's sequence (llama.cpp's ``llama_state_seq_get_data``) is
saved; a later run, in this process or another, restores the longest saved prefix of its prompt
and prefills only the rest. This module is the policy: which saved prefix a prompt restores
(from memory first, for a server's conversations), what is worth saving, and when the cache is
off for a model or for the process. The entries themselves, in localspec's own file format
under ``<cache root>/prompts/<model key>/`` (private, atomic, LRU-bounded), are
:mod:`localspec.llama.prompt_store`'s. An entry is used only if its options equal the model's,
its tokens are a prefix of the prompt's (compared, never trusted to a hash) and its checksum
holds.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from localspec.errors import ModelError
from localspec.llama.prompt_store import Entry, KeyedModel, PromptStore, common_prefix, model_key
from localspec.settings import environment
from localspec.settings.locations import PROMPT_CACHE_ENV

log = logging.getLogger(__name__)

MIN_TOKENS = 32  # shorter prefixes: prefilling them costs about what saving and restoring does
DEFAULT_LIMIT = 4 << 30  # bytes on disk
ENV = PROMPT_CACHE_ENV  # a directory, or "off" (localspec.settings.locations.prompt_cache_setting)
LIMIT_ENV = "LOCALSPEC_PROMPT_CACHE_LIMIT"  # bytes, or with a K/M/G suffix


class StatefulModel(KeyedModel, Protocol):
    """What the cache needs of a model (localspec.llama.model.Model has it)."""

    n_ctx: int

    @property
    def state_refusal(self) -> str | None: ...

    def seq_state(self, seq: int = 0) -> bytes: ...

    def set_seq_state(self, data: bytes, seq: int = 0) -> bool: ...


def _state(model: StatefulModel, sequence: Any) -> bytes:
    """The saved state of a slot's sequence (None: the model's first)."""
    return model.seq_state() if sequence is None else sequence.state()


def parse_limit(text: str) -> int:
    """Bytes of a size such as 4G, 512M, 100000 (ConfigError naming the setting otherwise)."""
    return environment.parse_size(text, LIMIT_ENV)


class PromptCache(PromptStore):
    """Saved prompt prefixes under `root`, at most `limit` bytes (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, limit: int = DEFAULT_LIMIT, min_tokens: int = MIN_TOKENS,
                 memory: int = 0, namespace: str | None = None) -> None:
        """`memory`: bytes of states also kept in this process (a server's conversations restore
        from memory first); `namespace`: entries of another namespace are never used (a server's
        API key: its clients' prompts are not another key's)."""
        super().__init__(root, limit, namespace)
        self.min_tokens = min_tokens
        self.memory_limit = memory
        self._memory: OrderedDict[tuple[str, tuple[int, ...]], bytes] = OrderedDict()
        self._refused: set[str] = set()  # models whose state cannot be cached (warned once each)
        self._lock = threading.RLock()  # calls on several pairs share one (a resident service's)

    @classmethod
    def from_setting(cls, value: str | os.PathLike | None = None, limit: str | int | None = None,
                     **options: Any) -> PromptCache | None:
        """The cache a setting names: a directory, "off" (None), or None for the environment's
        LOCALSPEC_PROMPT_CACHE or else ``<cache root>/prompts``."""
        from localspec.settings import locations

        setting = locations.prompt_cache_setting(value)
        if setting is False:
            return None
        root = setting if setting is not None else locations.default_prompt_cache()
        size = environment.get(LIMIT_ENV) if limit is None else parse_limit(str(limit))
        cache = cls(root, size, **options)
        if setting is not None:  # a directory the user named: refused now (the default one: off, with a warning)
            cache.check()
        return cache

    # ------------------------------------------------------------------ restoring and saving

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
            keep = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if keep >= self.min_tokens and (found is None or keep > found[1]
                                            or (keep == found[1] and entry.state_bytes < found[0].state_bytes)):
                found = (entry, keep)
        return found

    def save(self, model: StatefulModel, tokens: Sequence[int], sequence: Any = None) -> Path | None:
        """Save the state of the model's `sequence` (a KVSequence; default: its first slot's), which
        holds exactly `tokens`, unless it is too short
        or an entry already holds all but fewer than min_tokens of them (a question after a saved
        document: restoring that entry and prefilling the rest costs about what a save would, and
        the disk keeps one copy of the document). None: nothing written."""
        with self._lock:
            return self._save(model, tokens, sequence)

    def _save(self, model: StatefulModel, tokens: Sequence[int], sequence: Any) -> Path | None:
        if len(tokens) < self.min_tokens or self._off(model):
            return None
        directory = self._dir(model)
        options = model.state_options
        tokens = tuple(int(t) for t in tokens)
        if self.memory_limit > 0 and not self._in_memory(model, tokens):
            try:
                self._remember(model, tokens, _state(model, sequence))
            except ModelError as exc:
                self._disable(str(exc))
                return None
        for entry in self.entries(directory):  # an entry sharing all but a few of these tokens is enough
            if entry.options == options and len(tokens) - common_prefix(entry.tokens, tokens) < self.min_tokens:
                self._touch(entry)
                return None
        try:
            data = self._memory.get((model_key(options), tokens)) or _state(model, sequence)
        except ModelError as exc:  # llama.cpp could not serialise the state: no cache, never a failed run
            self._disable(str(exc))
            return None
        return self._write(directory, options, tokens, data)

    def keeps(self, model: StatefulModel, n_tokens: int) -> bool:
        """Whether a prefix of `n_tokens` tokens is one this cache saves for `model` (long enough,
        and the cache not off for it)."""
        return n_tokens >= self.min_tokens and not self._off(model)

    # ------------------------------------------------------------------ in memory

    def _in_memory(self, model: StatefulModel, tokens: tuple[int, ...]) -> bool:
        """Whether a state in memory holds all but fewer than min_tokens of `tokens`."""
        key = model_key(model.state_options)
        return any(k == key and len(tokens) - common_prefix(t, tokens) < self.min_tokens for k, t in self._memory)

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
                keep = min(common_prefix(tokens, prompt), len(prompt) - 1)
                if keep >= self.min_tokens and (found is None or keep > found[1]):
                    found = (tokens, keep)
        return found

    # ------------------------------------------------------------------ restoring

    def restore(self, model: Any, prompt: Sequence[int], sequence: Any = None) -> int:
        """Restore into the model's `sequence` (a KVSequence; default: its first slot's) the
        longest saved prefix of `prompt` (from memory, else from disk) when it is longer than what
        the cache already holds of it; returns the prompt tokens the cache holds after."""
        with self._lock:
            return self._restore(model, prompt, model.sequence if sequence is None else sequence)

    def _restore(self, model: Any, prompt: Sequence[int], sequence: Any) -> int:
        held = sequence.reusable(prompt)  # what the cache holds of it already (KVSequence.start keeps it)
        if self._off(model):
            return held
        in_memory = self._memory_best(model, prompt) if self._memory else None
        if in_memory is not None and in_memory[1] > held:
            tokens, keep = in_memory
            key = (model_key(model.state_options), tokens)
            self._memory.move_to_end(key)
            data = self._memory[key]
            if sequence.restore(tokens, data, keep):
                log.info("prompt cache: restored %d of %d prompt tokens from memory", keep, len(prompt))
                return keep
            del self._memory[key]
            held = 0
        found = self.best(model, prompt)
        if found is None or found[1] <= held:
            return held
        entry, keep = found
        saved = self.load(entry)
        if saved is None:
            return held
        if not sequence.restore(entry.tokens, saved, keep):
            self._remove(entry, "llama.cpp refused its state")
            return 0
        if self.memory_limit > 0:
            self._remember(model, entry.tokens, saved)
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
