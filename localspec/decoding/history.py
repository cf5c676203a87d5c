"""Drafts from earlier calls: the recent prompts and answers of one target, indexed so that the
longest suffix of what is being generated that occurred in them is found in O(1) per token, and
what followed it there proposed (vLLM's suffix decoding keeps such an index across requests,
llama-server's n-gram modes their n-gram tables).

Scripts repeat themselves: the same schema over many documents, the same file edited again, a
question asked twice, a chat's follow-ups. The context lookup (:mod:`localspec.decoding.lookup`)
sees only the current prompt and answer; :class:`History` keeps the earlier ones of the same
target (bounded: the newest :data:`HISTORY_TOKENS` tokens), as a suffix automaton over them with
a separator between calls that matches nothing, so a match never spans two calls.
:class:`~localspec.decoding.drafters.HistoryDrafter` proposes from it beside the context lookup,
under its own acceptance kinds (``history:<match bucket>``, :func:`history_kind`), so the planner
drafts from it only where it pays. Drafts never change the output (they are verified like any
other).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from localspec.decoding.lookup import SuffixAutomaton

HISTORY_TOKENS = 1 << 16  # tokens of earlier calls kept per target (their prompts and answers, newest first)
MIN_GENERATION_TOKENS = 8  # a generation shorter than this is not worth remembering
MIN_MATCH = 4  # a shorter match with earlier calls is chance (the context lookup covers short repeats)
BUCKETS = ((7, "m4-7"), (15, "m8-15"), (31, "m16-31"))  # acceptance buckets by match length; longer: "m32+"


class History:
    """The recent generations of one target (each its prompt and answer), as token ids,
    searchable by longest match. A generation reads it when it starts and adds its own tokens
    when it ends, in the target's step loop (localspec.decoding.scheduler: one thread for all its
    slots); a matcher keeps reading the index it started with, and a lock keeps :meth:`snapshot`
    and a rebuild apart."""

    def __init__(self, limit: int = HISTORY_TOKENS) -> None:
        self.limit = limit
        self.generations: deque[tuple[int, ...]] = deque()
        self._lock = threading.Lock()
        self._build()

    @property
    def size(self) -> int:
        return sum(len(g) for g in self.generations)

    def add(self, tokens: Sequence[int]) -> None:
        """Remember a generation's tokens (its prompt and answer). Past the limit the oldest go; the
        index is rebuilt then (on a quarter of the limit freed at least: amortised)."""
        generation = tuple(int(t) for t in tokens[-self.limit:])
        if len(generation) < MIN_GENERATION_TOKENS:
            return
        with self._lock:
            self.generations.append(generation)
            if self.size > self.limit:
                while self.generations and self.size > self.limit * 3 // 4:
                    self.generations.popleft()
                self._build()
            else:
                self._append(generation)

    def _build(self) -> None:
        self.sam = SuffixAutomaton()
        self.tokens: list[int] = []
        self._separators = 0
        for generation in self.generations:
            self._append(generation)

    def _append(self, generation: tuple[int, ...]) -> None:
        self._separators += 1
        for t in (-self._separators, *generation):  # a separator of its own matches nothing: no match spans two
            self.sam.extend(t)
            self.tokens.append(t)

    def matcher(self) -> HistoryMatch:
        """A generation's position in the history (reads the index as it is now)."""
        with self._lock:
            return HistoryMatch(self.sam, self.tokens)

    def snapshot(self) -> list[tuple[int, ...]]:
        with self._lock:
            return list(self.generations)


class HistoryMatch:
    """The longest suffix of a growing sequence that occurs in the history (matching statistics
    over its suffix automaton), and what followed it there."""

    def __init__(self, sam: SuffixAutomaton, tokens: list[int]) -> None:
        self.sam, self.tokens = sam, tokens
        self.state, self.length = 0, 0

    def feed(self, token: int) -> None:
        sam = self.sam
        while self.state and token not in sam.next[self.state]:
            self.state = sam.link[self.state]
            self.length = sam.length[self.state]
        nxt = sam.next[self.state].get(token)
        if nxt is None:
            self.state, self.length = 0, 0
        else:
            self.state, self.length = nxt, self.length + 1

    def continuation(self, depth: int, ends: Callable[[int], bool] | None) -> tuple[int, ...]:
        """Up to `depth` tokens that followed the match (its first occurrence), to the call's end
        or the first end-of-generation token; () without a match of MIN_MATCH tokens."""
        if self.length < MIN_MATCH:
            return ()
        start = self.sam.first_end[self.state] + 1
        out: list[int] = []
        for t in self.tokens[start: start + depth]:
            if t < 0:
                break
            out.append(t)
            if ends is not None and ends(t):
                break
        return tuple(out)


def history_kind(match: int) -> str:
    """The planner's acceptance kind of a proposal from earlier calls, by its match length."""
    name = next((n for limit, n in BUCKETS if match <= limit), "m32+")
    return f"history:{name}"
