"""The text of a generation's tokens: stop strings, held-back text and tool-call regions.

:class:`StopScanner` follows the target's committed tokens (a follower of the slot's
:class:`~localspec.llama.sequence.KVSequence`) and hands out each generated token once with its
text, cut at the first stop string; :class:`StopFilter` holds back text that could be the start
of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class JsonCalls(Protocol):
    """How an answer that is a tool call written as plain JSON starts (localspec.tools.JsonCalls)."""

    def opens(self, text: str) -> bool:
        """Whether `text` is the start of such a call."""

    def may_open(self, text: str) -> bool:
        """Whether `text` may still become the start of one."""


class StopFilter:
    """Holds back text that could be the start of a stop string; cuts at the first stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        self.held += text
        if not self.stops:
            out, self.held = self.held, ""
            return out
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.held = self.held[: min(hits)], ""
            return out
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class StopScanner:
    """A follower of the target's sequence (localspec.llama.sequence.Follower): the text of the tokens
    generated since the prompt, cut at the first stop string. :meth:`take` hands out each token
    with its text once; tokens rolled back before they were taken are forgotten. With `calls`
    (the ids of <tool_call> and </tool_call>), stop strings apply to the text outside tool
    calls only: a call's JSON is the grammar's, not the answer's text; so with `json_calls`, to
    an answer that is a call written as plain JSON (its start is held back while it may be)."""

    def __init__(self, target: Any, stops: Sequence[str], calls: tuple[int, int] | None = None,
                 json_calls: JsonCalls | None = None) -> None:
        self.target = target
        self.stops = tuple(stops)
        self.calls = calls
        self.json_calls = json_calls
        self.reset(())

    def reset(self, tokens: Sequence[int]) -> None:
        """A new prompt: nothing generated yet."""
        self.generated: list[int] = []
        self._pieces: list[tuple[int, str]] = []  # (token, text) of generated tokens, up to a stop string
        self._taken = 0
        self._detok = self.target.detokenizer()
        self._filter = StopFilter(self.stops)
        self._in_call = False
        self._start: str | None = "" if self.json_calls is not None and self.stops else None  # held back
        self._in_json = False  # the answer is a call written as plain JSON

    @property
    def stopped(self) -> bool:
        return self._filter.stopped

    def commit(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            self.generated.append(tok)
            if self.stopped:
                continue  # past a stop string: no text
            if self.target.is_eog(tok):
                text = ""
            elif self.calls is not None and (self._in_call or tok == self.calls[0]):
                # a call opens: the text held back before it can no longer start a stop string
                text = ("" if self._in_call else self._release_start() + self._filter.flush()) + self._detok.add(tok)
                self._in_call = tok != self.calls[1]
            elif self._in_json:
                text = self._detok.add(tok)
            elif self._start is not None:
                text = self._watch_start(self._detok.add(tok))
            else:
                text = self._filter.push(self._detok.add(tok))
            self._pieces.append((tok, text))

    def _watch_start(self, text: str) -> str:
        """The answer's start, kept from the stop strings while it may be a call written as plain
        JSON (then all of it is)."""
        start, self._start, calls = (self._start or "") + text, None, self.json_calls
        if calls is not None and calls.opens(start):
            self._in_json = True
            return start
        if calls is not None and calls.may_open(start):
            self._start = start
            return ""
        return self._filter.push(start)

    def _release_start(self) -> str:
        start, self._start = self._start or "", None
        return self._filter.push(start) if start and not self.stopped else ""

    def rollback(self, n: int) -> None:
        keep = self.generated[: len(self.generated) - n]
        if len(keep) < self._taken:
            raise RuntimeError(f"cannot withdraw {n} tokens: their text was already handed out")
        taken = self._taken
        self.reset(())
        self.commit(keep)  # the same tokens give the same text
        self._taken = taken

    def take(self) -> list[tuple[int, str]]:
        """The (token, text) pairs committed since the last call, up to the one that stopped."""
        out = self._pieces[self._taken:]
        self._taken = len(self._pieces)
        return out

    def flush(self) -> str:
        """Text held back (a possible start of a stop string, an incomplete character)."""
        if self.stopped:
            return ""
        if self._in_json:
            return self._detok.flush()
        return self._release_start() + self._filter.push(self._detok.flush()) + self._filter.flush()
