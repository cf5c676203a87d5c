"""What one model's KV cache holds: its sequence object, the one owner of that state.

A :class:`KVSequence` belongs to one model (``Model.sequence``). It holds the committed tokens
of the context (``tokens``) and how many of them the cache holds as llama.cpp sequence 0
(``n_cached``); between steps of a generation the target's cache holds every committed token but
the last (the root of the next step), a draft model's whatever it has caught up on. A prompt's
prefill decodes its last token too, as llama.cpp's own tools do, and keeps its logits
(:attr:`root_logits`): a first step that drafts nothing needs no pass of its own. Only its
methods decode into sequence 0 or trim it, so what it says is what the cache holds:

* :meth:`start` keeps the cached prefix a new context shares with the last one (prefix reuse),
* :meth:`fill` decodes committed tokens the cache does not hold yet,
* :meth:`fork` / :meth:`decode` / :meth:`keep_branch` run a step's draft on KV sequences
  1..n-1 sharing the prefix and keep the accepted path as sequence 0,
* :meth:`commit` appends committed tokens, :meth:`rollback` withdraws them.

An earlier context that a new prompt replaced comes back from the prompt cache (its memory
entries restore in a few milliseconds), not from spare KV sequences of the same cache: cells held
there would widen the attention of every later call's every token (llama.cpp attends over the
unified cache up to its last used cell; measured, 3-8% of a later call's prefill and decode).

Its followers (:class:`Follower`: the stop-string scanner, a grammar matcher) see every commit
and rollback, so they always describe the same tokens. A cache whose state is not known (an
operation failed half-way) is marked untrusted and is cleared by the next :meth:`start`.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class CachedModel(Protocol):
    """The llama.cpp operations a sequence uses (localspec.llama.model.Model has them)."""

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               seq_ids: Sequence[Sequence[int]] | None = None, outputs: str = "all") -> int: ...

    def prefill(self, tokens: Sequence[int], start: int) -> None: ...

    def logits_array(self, n_rows: int) -> Any: ...

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None: ...

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...

    def clear_memory(self) -> None: ...


class Follower(Protocol):
    """Something that follows a sequence's committed tokens."""

    def reset(self, tokens: Sequence[int]) -> None:
        """The sequence starts over with these tokens (a new prompt)."""

    def commit(self, tokens: Sequence[int]) -> None:
        """These tokens were appended."""

    def rollback(self, n: int) -> None:
        """The last `n` committed tokens were withdrawn."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class KVSequence:
    """One model's committed tokens and its KV cache's sequence 0 (see the module docstring)."""

    def __init__(self, model: CachedModel) -> None:
        self.model = model
        self.tokens: list[int] = []  # the committed context
        self.n_cached = 0  # tokens[:n_cached] are in the cache as sequence 0
        self.followers: list[Follower] = []
        self._branches = 1  # KV sequences the current step uses
        self._trusted = True  # False: an operation failed half-way; the cache's content is unknown
        # the index of the token whose logits are the last decode's output row 0, when that decode
        # was a fill ending with it (a prompt's prefill: the first step's root); None otherwise
        self.logits_at: int | None = None

    @property
    def pending(self) -> int:
        """Committed tokens the cache does not hold yet."""
        return len(self.tokens) - self.n_cached

    # ------------------------------------------------------------------ a new context

    def start(self, prompt: Sequence[int]) -> int:
        """Make `prompt` the context: the cache keeps the longest prefix (at most all of the prompt
        but its last token) it shares with the last context. Returns the number of prompt tokens
        that need no decoding."""
        if not self._trusted:
            self.clear()
        keep = self.reusable(prompt)
        self.model.seq_rm(0, keep, -1)
        self.tokens, self.n_cached, self._branches, self.logits_at = list(prompt), keep, 1, None
        for f in self.followers:
            f.reset(self.tokens)
        return keep

    def reusable(self, prompt: Sequence[int]) -> int:
        """The prompt tokens start() would keep of the cached context."""
        return common_prefix(self.tokens[: self.n_cached], prompt[: len(prompt) - 1])

    def restore(self, tokens: Sequence[int], load: Any, keep: int) -> bool:
        """Replace the cache by a saved state of `tokens` (`load()`: loads it into the empty
        sequence 0, False when refused) and keep its first `keep` tokens. False: refused, the
        cache is left empty."""
        self.clear()
        self._trusted = False
        self.logits_at = None
        if not load():
            self.clear()
            return False
        if keep < len(tokens):
            self.model.seq_rm(0, keep, -1)
        self.tokens, self.n_cached, self._trusted = list(tokens[:keep]), keep, True
        for f in self.followers:
            f.reset(self.tokens)
        return True

    def clear(self) -> None:
        """Empty the cache and the context."""
        self.model.clear_memory()
        self.tokens, self.n_cached, self._branches, self._trusted, self.logits_at = [], 0, 1, True, None
        for f in self.followers:
            f.reset(self.tokens)

    # ------------------------------------------------------------------ decoding committed tokens

    def fill(self, upto: int | None = None, outputs: str = "last") -> None:
        """Decode tokens[n_cached:upto] (default: all) into the cache at their positions.
        outputs "last": a prefill in n_batch chunks, the last token's logits kept; "all": one
        batch with logits for every token (at most n_batch tokens)."""
        upto = len(self.tokens) if upto is None else upto
        if upto <= self.n_cached:
            return
        chunk = self.tokens[self.n_cached: upto]
        self._trusted, self.logits_at = False, None
        if outputs == "all":
            self.model.decode(chunk, range(self.n_cached, upto), outputs="all")
        else:
            self._prefill(chunk)
        self.n_cached, self._trusted = upto, True
        self.logits_at = upto - 1 if outputs == "last" else None

    def _prefill(self, chunk: Sequence[int]) -> None:
        """A prefill in n_batch chunks (a failed chunk leaves the earlier ones)."""
        step = getattr(self.model, "n_batch", len(chunk)) or len(chunk)
        for lo in range(0, len(chunk), step):
            self.model.prefill(chunk[lo: lo + step], self.n_cached + lo)

    def redecode_last(self) -> None:
        """Drop the last cached token so that it is decoded again (its logits are needed with
        others, or are gone, and the cache already holds it)."""
        if self.n_cached and self.n_cached == len(self.tokens):
            self.model.seq_rm(0, self.n_cached - 1, -1)
            self.n_cached -= 1
            self.logits_at = None

    # ------------------------------------------------------------------ a step's branches

    def fork(self, branches: int) -> None:
        """Copy sequence 0 to sequences 1..branches-1: the paths of a step's draft share the prefix."""
        self._trusted = False
        for s in range(1, branches):
            self.model.seq_cp(0, s)
        self._branches = branches

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
               outputs: str = "all") -> int:
        """Decode a step's batch on the forked sequences (logits rows: see Model.decode)."""
        self._trusted, self.logits_at = False, None
        return self.model.decode(tokens, positions, seq_ids, outputs=outputs)

    def keep_branch(self, branch: int, n_cached: int) -> None:
        """End the step (after committing its tokens): sequence 0 holds positions [0, n_cached)
        of sequence `branch` (the accepted path; at most the committed tokens) and no other
        sequence is left."""
        model, n_cached = self.model, min(n_cached, len(self.tokens))
        model.seq_rm(branch, n_cached, -1)
        if self._branches > 1:  # the step's other sequences go
            for s in range(self._branches):
                if s != branch:
                    model.seq_rm(s, -1, -1)
            if branch != 0:
                model.seq_cp(branch, 0)
                model.seq_rm(branch, -1, -1)
        self.n_cached, self._branches, self._trusted = n_cached, 1, True

    @property
    def root_logits(self) -> bool:
        """Whether the cache holds every committed token and the last decode's row 0 is the last
        token's logits (a prompt's prefill: the first step needs no pass of its own)."""
        return self.n_cached == len(self.tokens) and self.logits_at == len(self.tokens) - 1

    # ------------------------------------------------------------------ committed tokens

    def commit(self, tokens: Sequence[int]) -> None:
        """Append committed tokens (the cache holds them once decoded or kept from a branch)."""
        self.tokens.extend(tokens)
        for f in self.followers:
            f.commit(tokens)

    def rollback(self, n: int) -> None:
        """Withdraw the last `n` committed tokens, from the cache too."""
        if n <= 0:
            return
        n = min(n, len(self.tokens))
        del self.tokens[len(self.tokens) - n:]
        self.logits_at = None
        if self.n_cached > len(self.tokens):
            self.model.seq_rm(0, len(self.tokens), -1)
            self.n_cached = len(self.tokens)
        for f in self.followers:
            f.rollback(n)
