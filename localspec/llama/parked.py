"""Idle slots' KV states in memory (:class:`Parked`), so that their cells do not slow the others.

A model's context is one unified KV cache for every slot (a token tree's branches must share
cells, which per-slot streams cannot), and llama.cpp attends over every used cell of it, masked per
sequence: cells an idle slot holds widen every other call's attention at every step (measured:
benchmarks/concurrency.py --held-cells). So when another call runs, an idle slot's state is saved
to memory and its cells freed; a later call whose prompt shares its prefix gets it back into its
own slot (restoring a 1,600-token state takes milliseconds; prefilling it again, seconds).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

from localspec.llama.sequence import common_prefix

log = logging.getLogger(__name__)

PARK_MEMORY = 512 << 20  # bytes of idle slots' KV states kept in memory (their cells freed for the others)
PARK_MIN = 32  # tokens: a shorter context costs about as much to prefill again as to park
RESTORE_MIN = 8  # tokens a parked state must add to what a slot holds to be restored (it takes milliseconds)


class Parked:
    """Idle slots' KV states in memory, the least recently parked dropped past `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # (model, tokens) -> (the model, the slot it was parked from, its state)
        self._states: collections.OrderedDict[tuple[int, tuple[int, ...]], tuple[Any, int, bytes]] = \
            collections.OrderedDict()

    @property
    def bytes(self) -> int:
        return sum(len(data) for _, _, data in self._states.values())

    def park(self, slot: int, models: Sequence[Any]) -> None:
        """Save what the slot's sequences hold of each model, and free their cells."""
        for model in dict.fromkeys(models):
            seq = model.sequences[slot] if slot < len(model.sequences) else None
            if seq is None or seq.n_cached == 0:
                continue
            if seq.n_cached >= PARK_MIN and self.limit > 0:
                try:
                    data = seq.state()
                except Exception as exc:  # noqa: BLE001 - a state llama.cpp cannot write is prefilled again
                    log.info("could not park a slot of %s: %s", model.path.name, exc)
                else:
                    self._states[(id(model), tuple(seq.tokens[: seq.n_cached]))] = (model, slot, data)
                    self._shrink()
            seq.clear()

    def clear(self) -> None:
        self._states.clear()

    def _shrink(self) -> None:
        total = self.bytes
        while total > self.limit and self._states:
            total -= len(self._states.popitem(last=False)[1][2])

    def shared(self, slot: int, prompt: Sequence[int], model: Any) -> int:
        """The most tokens of `prompt` (but its last) a state parked from `slot` of `model` holds."""
        return max((common_prefix(tokens, prompt[: len(prompt) - 1])
                    for (mid, tokens), (_, parked, _) in self._states.items() if mid == id(model) and parked == slot),
                   default=0)

    def restore(self, slot: int, prompt: Sequence[int], target: Any) -> None:
        """Into the slot, each model's parked state sharing the longest prefix with `prompt`, where
        it holds RESTORE_MIN tokens of it more than the slot does. A state the call continues
        leaves memory (the slot holds it now); one it shares less than half of stays parked for
        a call that continues it (the slot holds the shared prefix only)."""
        models = {id(m): m for m, _, _ in self._states.values()} | {id(target): target}
        for key, model in models.items():
            seq = model.sequences[slot] if slot < len(model.sequences) else None
            if seq is None:
                continue
            best, keep = None, seq.reusable(prompt) + RESTORE_MIN - 1
            for mid, tokens in self._states:
                shared = common_prefix(tokens, prompt[: len(prompt) - 1])
                if mid == key and shared > keep:
                    best, keep = (mid, tokens), shared
            if best is not None:
                self._restore(seq, best, keep)

    def _restore(self, seq: Any, key: tuple[int, tuple[int, ...]], keep: int) -> None:
        model, _, data = self._states[key]
        if keep >= len(key[1]) / 2:
            del self._states[key]
        else:
            self._states.move_to_end(key)  # used: the last to be dropped
        try:
            if not seq.restore(key[1], data, keep):
                log.info("llama.cpp refused a parked state of %s", model.path.name)
        except Exception as exc:  # noqa: BLE001 - a model closed since: its state is dropped
            log.info("a parked state of %s is gone: %s", model.path.name, exc)
