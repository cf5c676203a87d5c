"""Longest-match lookup over the whole context: a suffix automaton of token ids.

After every committed token the automaton is extended (amortised O(1)); then the longest suffix
of the context that also occurred earlier, and where it first occurred, are read off in O(1):
the state of the longest earlier-occurring suffix is the suffix link of the automaton's last
state (Blumer et al. 1985). What followed that occurrence is the proposal, and the length of the
match says how much to trust it.

Editing prompts (rename, refactor, add type hints) copy the input with small changes. After a
change the longest match is short and points to the wrong place, so :class:`ContextLookup` also
keeps the position it was copying from: when the output replaces a source token, copying goes
on from the token after it ("re-alignment"). A replaced token followed by a copy of a few tokens
is taken for a rename: later copies propose the new token wherever the source has the old one,
until the output keeps an old one.

A proposal ends at its first end-of-generation token (given by the model: `ends`): the
generation stops there, so a draft past it (a copy of the prompt's last line runs on into the
chat template's next turn) can only cost verification and count as rejected where it was not.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RECENT = 16  # output tokens over which the lookup judges whether the output is copying the context
RENAME_CONFIRM = 2  # source tokens copied right after a replaced one for the replacement to count as a rename


class SuffixAutomaton:
    """Suffix automaton of a growing token sequence, with the first end position of each state."""

    def __init__(self) -> None:
        self.length = [0]
        self.link = [-1]
        self.next: list[dict[int, int]] = [{}]
        self.first_end = [-1]
        self.last = 0
        self.size = 0  # tokens added

    def extend(self, token: int) -> None:
        """Append one token (the standard online construction)."""
        pos = self.size
        self.size += 1
        cur = self._new(self.length[self.last] + 1, -1, {}, pos)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = self._new(self.length[p] + 1, self.link[q], dict(self.next[q]), self.first_end[q])
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = clone
                self.link[cur] = clone
        self.last = cur

    def _new(self, length: int, link: int, nxt: dict[int, int], first_end: int) -> int:
        self.length.append(length)
        self.link.append(link)
        self.next.append(nxt)
        self.first_end.append(first_end)
        return len(self.length) - 1

    def longest_repeat(self) -> tuple[int, int]:
        """(length, first end position) of the longest suffix of the sequence that also ends
        earlier; (0, -1) when not even the last token occurred before."""
        s = self.link[self.last] if self.last else -1
        if s <= 0:
            return 0, -1
        return self.length[s], self.first_end[s]


@dataclass(frozen=True)
class Proposal:
    """Tokens to draft, where they were copied from, and the evidence behind them."""

    tokens: tuple[int, ...]
    source: int  # context index of tokens[0]
    match: int  # length of the matched suffix (0 for a re-alignment)
    kind: str  # the acceptance bucket (see ContextLookup.bucket)


class ContextLookup:
    """Proposals copied from the context: the continuation of the longest earlier match, or,
    right after the output replaced a source token, the source from the next token on; each
    up to its first end-of-generation token (`ends`: the model's test, e.g. ``Model.is_eog``)."""

    def __init__(self, ends: Callable[[int], bool] | None = None) -> None:
        self.ends = ends
        self.reset()

    def reset(self) -> None:
        """Forget the context (a new prompt)."""
        self.sam = SuffixAutomaton()
        self.tokens: list[int] = []
        self.cursor = -1  # context index the next token is expected to copy (-1: none)
        self.misses = 0  # tokens in a row that the cursor did not predict
        self.run = 0  # tokens in a row that it did
        self.recent: deque[bool] = deque(maxlen=RECENT)  # the cursor predicted each of the last tokens?
        self.renamed: dict[int, int] = {}  # source token -> the token the output put in its place
        self._replaced: tuple[int, int] | None = None  # (source, output) of the last miss, to confirm

    def sync(self, context: Sequence[int]) -> None:
        """Index every context token not indexed yet (between resets the context only grows),
        following the copy source over each new token."""
        n = len(self.tokens)
        if len(context) < n or (n and context[n - 1] != self.tokens[-1]):
            self.reset()  # not the context indexed so far: start over
        for t in context[len(self.tokens):]:
            self._advance(int(t))
            self.sam.extend(int(t))
            self.tokens.append(int(t))

    def _advance(self, token: int) -> None:
        """Move the cursor over the next output token: past a source token it equals (or the
        token a rename put in its place), or past one it replaced (a substitution: a renamed
        identifier); two misses in a row lose the source. A substitution followed by a copy
        (RENAME_CONFIRM tokens) is a rename: later copies of that source token propose its
        replacement."""
        source = self.tokens[self.cursor] if 0 <= self.cursor < len(self.tokens) else None
        hit = source is not None and token in (source, self.renamed.get(source, source))
        self.recent.append(hit)
        if source is None:
            return
        if hit:
            if token == source:
                self.renamed.pop(source, None)  # the output kept it: no longer renamed
            self.misses, self.run = 0, self.run + 1
            if self._replaced is not None and self.run >= RENAME_CONFIRM:
                self.renamed[self._replaced[0]] = self._replaced[1]
                self._replaced = None
        else:
            self._replaced = (source, token) if self.misses == 0 else None
            self.misses, self.run = self.misses + 1, 0
        self.cursor = self.cursor + 1 if self.misses < 2 else -1

    @property
    def copying(self) -> bool:
        """Has the output been copying the context lately (most of the last RECENT tokens)?"""
        return len(self.recent) == RECENT and 2 * sum(self.recent) >= RECENT

    def bucket(self, match: int) -> str:
        """Acceptance is learned per bucket of evidence: the match length, and whether the output
        has been copying lately (a copy in progress, or free text with chance matches)."""
        name = "realign"
        if match > 0:
            name = next((n for limit, n in ((1, "m1"), (3, "m2-3"), (7, "m4-7"), (15, "m8-15")) if match <= limit),
                        "m16+")
        return name + ("/copying" if self.copying else "")

    def propose(self, context: Sequence[int], depth: int) -> Proposal | None:
        """The best proposal of up to `depth` tokens for what follows `context`: the source being
        copied while it keeps predicting the output (unless a longer match points elsewhere);
        else the longest match anywhere in the context (after an edit of several tokens it finds
        the place again); else, right after a substitution (the last token occurs nowhere
        earlier), the source past it."""
        self.sync(context)
        following = 0 <= self.cursor < len(self.tokens)
        match, end = self.sam.longest_repeat()
        if following and self.misses == 0 and self.run >= max(match, 1):
            return self._copy(self.cursor, self.run, depth)
        if match:
            return self._copy(end + 1, match, depth)
        if following:
            return self._copy(self.cursor, 0, depth)
        return None

    def _copy(self, start: int, match: int, depth: int) -> Proposal | None:
        tokens = tuple(self.renamed.get(t, t) for t in self.tokens[start: start + depth])
        if self.ends is not None:
            tokens = tokens[: next((i + 1 for i, t in enumerate(tokens) if self.ends(t)), len(tokens))]
        if not tokens:
            return None
        if start != self.cursor:  # a new source: what follows is expected to copy from here
            self.cursor, self.misses, self.run, self._replaced = start, 0, match, None
        return Proposal(tokens, start, match, self.bucket(match))
