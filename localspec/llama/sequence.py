"""What one slot of a model's KV cache holds: its sequence object, the one owner of that state.

A model's context holds several *slots* (``ModelOptions.slots``: calls generating at once, as
llama-server's slots), each a :class:`KVSequence` with llama.cpp sequence ids of its own
(``base`` .. ``base + span - 1``; ``Model.sequences[i]``, ``Model.sequence`` is slot 0's). A
sequence holds the committed tokens of its context (``tokens``) and how many of them the cache
holds as its first sequence id (``n_cached``); between steps of a generation the target's cache
holds every committed token but the last (the root of the next step), a draft model's whatever it
has caught up on. A prompt's prefill decodes its last token too, as llama.cpp's own tools do, and
keeps its logits (:attr:`root_logits`): a first step that drafts nothing needs no pass of its own.
Only its methods decode into its sequences or trim them, so what it says is what the cache holds:

* :meth:`start` keeps the cached prefix a new context shares with the last one (prefix reuse),
* :meth:`fill` decodes committed tokens the cache does not hold yet,
* :meth:`fork` / :meth:`decode` / :meth:`keep_branch` run a step's draft on the slot's other
  sequence ids, sharing the prefix, and keep the accepted path as the first,
* :meth:`commit` appends committed tokens, :meth:`rollback` withdraws them.

A decode that several slots share (localspec.decoding.scheduler) is built from :class:`Part`\\ s
(:meth:`fill_part`, :meth:`step_part`): each sequence says what it adds, the model decodes them
together (``Model.decode_parts``), and the sequence records what its part left in the cache
(:meth:`filled`, :meth:`stepped`). The plain methods above are the same with one part.

An earlier context that a new prompt replaced comes back from the prompt cache (its memory
entries restore in a few milliseconds) or from another slot's cells, not from spare sequence ids
of its own: cells held there would widen the attention of every later call's every token.

Its followers (:class:`Follower`: the stop-string scanner, a grammar matcher) see every commit
and rollback, so they always describe the same tokens. A cache whose state is not known (an
operation failed half-way) is marked untrusted and is cleared by the next :meth:`start`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Part:
    """One sequence's tokens in a decode that others may share: absolute llama.cpp sequence ids
    per token, and which tokens give logits ("all", "last" or "none"). `first_row`: the first of
    its output rows in the decode's logits, set by the decode."""

    tokens: Sequence[int]
    positions: Sequence[int]
    seq_ids: Sequence[Sequence[int]]
    outputs: str = "all"
    first_row: int = field(default=-1, compare=False)

    def __post_init__(self) -> None:
        if self.outputs not in ("all", "last", "none"):
            raise ValueError(f"outputs must be 'all', 'last' or 'none', not {self.outputs!r}")

    @property
    def n_outputs(self) -> int:
        if not self.tokens:
            return 0
        return len(self.tokens) if self.outputs == "all" else 1 if self.outputs == "last" else 0


class CachedModel(Protocol):
    """The llama.cpp operations a sequence uses, and the logits its users read after a decode
    (localspec.llama.model.Model has them)."""

    n_batch: int
    decodes: int  # decodes run so far: logits rows are those of the last one

    def decode_parts(self, parts: Sequence[Part]) -> int: ...

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None: ...

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...

    def seq_state(self, seq: int = 0) -> bytes: ...

    def set_seq_state(self, data: bytes, seq: int = 0) -> bool: ...

    def logits_array(self, n_rows: int, first: int = 0) -> np.ndarray: ...


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
    """One slot's committed tokens and its KV cache sequences (see the module docstring)."""

    def __init__(self, model: CachedModel, base: int = 0, span: int = 1, slot: int = 0) -> None:
        self.model = model
        self.base = base  # its first llama.cpp sequence id: the committed context
        self.span = span  # sequence ids it may use (base .. base + span - 1): a step's branches
        self.slot = slot  # which of the model's slots it is
        self.tokens: list[int] = []  # the committed context
        self.n_cached = 0  # tokens[:n_cached] are in the cache as sequence `base`
        self.followers: list[Follower] = []
        self._branches = 1  # sequence ids the current step uses
        self._trusted = True  # False: an operation failed half-way; the cache's content is unknown
        # the index of the token whose logits are an output row of the model's last decode, when that
        # decode was a fill ending with it (a prompt's prefill: the first step's root); None otherwise
        self.logits_at: int | None = None
        self.logits_row = 0  # that row
        self._logits_decode = -1  # which of the model's decodes it was (rows last until the next one)

    @property
    def pending(self) -> int:
        """Committed tokens the cache does not hold yet."""
        return len(self.tokens) - self.n_cached

    def ids(self, relative: Sequence[int]) -> tuple[int, ...]:
        """Absolute sequence ids of the sequence's own ids 0 .. span - 1."""
        return tuple(self.base + s for s in relative)

    # ------------------------------------------------------------------ a new context

    def start(self, prompt: Sequence[int]) -> int:
        """Make `prompt` the context: the cache keeps the longest prefix (at most all of the prompt
        but its last token) it shares with the last context. Returns the number of prompt tokens
        that need no decoding."""
        if not self._trusted:
            self.clear()
        keep = self.reusable(prompt)
        self.model.seq_rm(self.base, keep, -1)
        self.tokens, self.n_cached, self._branches, self.logits_at = list(prompt), keep, 1, None
        for f in self.followers:
            f.reset(self.tokens)
        return keep

    def reusable(self, prompt: Sequence[int]) -> int:
        """The prompt tokens start() would keep of the cached context."""
        return common_prefix(self.tokens[: self.n_cached], prompt[: len(prompt) - 1])

    def restore(self, tokens: Sequence[int], data: bytes, keep: int) -> bool:
        """Replace the cache by a saved state of `tokens` (Model.seq_state's bytes) and keep its
        first `keep` tokens. False: llama.cpp refused it, the cache is left empty."""
        self.clear()
        self._trusted = False
        self.logits_at = None
        if not self.model.set_seq_state(data, self.base):
            self.clear()
            return False
        if keep < len(tokens):
            self.model.seq_rm(self.base, keep, -1)
        self.tokens, self.n_cached, self._trusted = list(tokens[:keep]), keep, True
        for f in self.followers:
            f.reset(self.tokens)
        return True

    def state(self) -> bytes:
        """llama.cpp's saved state of the cached context (its KV cells), as bytes."""
        return self.model.seq_state(self.base)

    def clear(self) -> None:
        """Empty this slot's sequences and the context (the other slots keep theirs)."""
        for s in range(self.span):
            self.model.seq_rm(self.base + s, -1, -1)
        self.tokens, self.n_cached, self._branches, self._trusted, self.logits_at = [], 0, 1, True, None
        for f in self.followers:
            f.reset(self.tokens)

    # ------------------------------------------------------------------ decoding committed tokens

    def fill_part(self, upto: int | None = None, outputs: str = "last", most: int | None = None) -> Part:
        """The part that decodes tokens[n_cached:upto] (default: all; at most `most` of them) into
        the cache at their positions, with logits for the last ("last") or every one ("all")."""
        upto = len(self.tokens) if upto is None else upto
        if most is not None:
            upto = min(upto, self.n_cached + most)
        chunk = self.tokens[self.n_cached: upto]
        return Part(chunk, range(self.n_cached, self.n_cached + len(chunk)), [(self.base,)] * len(chunk), outputs)

    def begin(self) -> None:
        """A part of this sequence goes into a decode: the cache is unknown until it is recorded."""
        self._trusted, self.logits_at = False, None

    def filled(self, part: Part) -> None:
        """A fill part was decoded: the cache holds its tokens."""
        upto = self.n_cached + len(part.tokens)
        self.n_cached, self._trusted = upto, True
        self.logits_at = upto - 1 if part.outputs == "last" and part.tokens else None
        self.logits_row, self._logits_decode = part.first_row, self.model.decodes

    def fill(self, upto: int | None = None, outputs: str = "last") -> None:
        """Decode tokens[n_cached:upto] (default: all) into the cache at their positions.
        outputs "last": a prefill in n_batch chunks, the last token's logits kept; "all": one
        batch with logits for every token (at most n_batch tokens)."""
        upto = len(self.tokens) if upto is None else upto
        step = self.model.n_batch if outputs == "last" else upto
        while self.n_cached < upto:
            part = self.fill_part(upto, outputs, step)
            self.begin()
            self.model.decode_parts([part])
            self.filled(part)

    def redecode_last(self) -> None:
        """Drop the last cached token so that it is decoded again (its logits are needed with
        others, or are gone, and the cache already holds it)."""
        if self.n_cached and self.n_cached == len(self.tokens):
            self.model.seq_rm(self.base, self.n_cached - 1, -1)
            self.n_cached -= 1
            self.logits_at = None

    # ------------------------------------------------------------------ a step's branches

    def fork(self, branches: int) -> None:
        """Copy the first sequence id to the next branches-1: the paths of a step's draft share
        the prefix."""
        if branches > self.span:
            raise ValueError(f"{branches} branches exceed the slot's {self.span} sequences")
        self._trusted = False
        for s in range(1, branches):
            self.model.seq_cp(self.base, self.base + s)
        self._branches = branches

    def step_part(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
                  outputs: str = "all") -> Part:
        """A step's tokens on the forked sequences (`seq_ids` relative to the slot's)."""
        return Part(list(tokens), list(positions), [self.ids(ids) for ids in seq_ids], outputs)

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
               outputs: str = "all") -> int:
        """Decode a step's batch on the forked sequences (logits rows: see Model.decode_parts)."""
        part = self.step_part(tokens, positions, seq_ids, outputs)
        self.begin()
        return self.model.decode_parts([part])

    def keep_branch(self, branch: int, n_cached: int) -> None:
        """End the step (after committing its tokens): the first sequence id holds positions
        [0, n_cached) of sequence `branch` (the accepted path; at most the committed tokens) and
        no other of the slot's is left."""
        model, n_cached, base = self.model, min(n_cached, len(self.tokens)), self.base
        model.seq_rm(base + branch, n_cached, -1)
        if self._branches > 1:  # the step's other sequences go
            for s in range(self._branches):
                if s != branch:
                    model.seq_rm(base + s, -1, -1)
            if branch != 0:
                model.seq_cp(base + branch, base)
                model.seq_rm(base + branch, -1, -1)
        self.n_cached, self._branches, self._trusted = n_cached, 1, True

    def abandon(self, part: Part) -> None:
        """A decode holding `part` failed or was stopped: whatever it put in the cache goes, so
        that the cache holds what it held before (sequences forked for it are dropped too)."""
        if part.positions:
            first = min(part.positions)
            for ids in {s for seqs in part.seq_ids for s in seqs}:
                self.model.seq_rm(ids, first, -1)
        for s in range(1, self._branches):
            self.model.seq_rm(self.base + s, -1, -1)
        self._branches, self.logits_at = 1, None
        self.n_cached = min(self.n_cached, min(part.positions, default=self.n_cached))
        self._trusted = True

    @property
    def root_logits(self) -> bool:
        """Whether the cache holds every committed token and an output row of the model's last
        decode (:attr:`logits_row`) is the last token's logits (a prompt's prefill: the first step
        needs no pass of its own)."""
        return (self.n_cached == len(self.tokens) and self.logits_at == len(self.tokens) - 1
                and self._logits_decode == self.model.decodes)

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
            self.model.seq_rm(self.base, len(self.tokens), -1)
            self.n_cached = len(self.tokens)
        for f in self.followers:
            f.rollback(n)
