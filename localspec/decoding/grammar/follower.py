"""The grammar as a follower of a sequence: :class:`GrammarFollower`, a matcher that follows a
model's committed tokens as a follower of its :class:`~localspec.llama.sequence.KVSequence`
(``reset`` / ``commit`` / ``rollback``) and answers what may come next: a token bitmask
(:meth:`GrammarFollower.mask`, rows as :mod:`localspec.decoding.grammar.masks` describes), the tokens the
grammar forces (:meth:`GrammarFollower.forced`), whether the answer may end here
(:meth:`GrammarFollower.accepts_end`), and masks along a draft path without committing it
(:meth:`GrammarFollower.masks_along`).

Masks follow llguidance's canonical tokenization: where text is forced, only the tokens
llguidance would spell it with are allowed, and a byte token that spells the same text as
another token is refused, although the matcher would consume either. So validity is decided by
the mask (:meth:`GrammarFollower.masks_along`), never by what the matcher would consume.

llguidance's matcher never raises: a forbidden token puts it in an error state whose mask allows
only the end tokens. A follower checks for that state after every consume and rollback and
raises :class:`~localspec.errors.ConstraintError` — an error, never a finished answer, and
localspec's own (the caller's grammar was checked before decoding): its message says so.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence

import llguidance
import numpy as np

from localspec.decoding.grammar.compiler import compile_constraint, start_problem
from localspec.decoding.grammar.masks import is_allowed, mask_words
from localspec.decoding.grammar.schema_errors import first_line
from localspec.decoding.grammar.tokenizer import VocabModel, start_tokenizer
from localspec.errors import ConfigError, ConstraintError
from localspec.settings.constraints import Constraint

log = logging.getLogger(__name__)

MAX_CHECKED = 1024  # grammars remembered per model as followed (GrammarFollower): then forgotten, all at once


# ---------------------------------------------------------------- the matcher as a follower


class GrammarFollower:
    """A grammar matcher that follows a sequence's committed tokens (a
    :class:`~localspec.llama.sequence.Follower`): the grammar starts after the prompt
    (``reset``), consumes what is committed, withdraws what is rolled back; between those it
    says which tokens may come next. Any disagreement raises ConstraintError."""

    def __init__(self, constraint: Constraint | str, tokenizer: llguidance.LLTokenizer, n_vocab: int,
                 checked: set[bytes] | None = None) -> None:
        """`constraint`: a Constraint (compiled and validated here) or an llguidance grammar
        from :func:`compile_constraint`; `n_vocab`: the width of the model's logits. The
        grammar's start is followed over this vocabulary (:func:`start_problem`: ConfigError
        naming the constraint's setting) unless `checked`, the digests of grammars already
        followed with this tokenizer, holds it (then it is added there)."""
        self.constraint = constraint if isinstance(constraint, Constraint) else None
        grammar = compile_constraint(constraint) if isinstance(constraint, Constraint) else constraint
        self.n_vocab = n_vocab
        self.words = mask_words(n_vocab)
        self._tokenizer_words = mask_words(tokenizer.vocab_size)
        self._scratch = np.zeros(self._tokenizer_words, dtype=np.uint32)
        self._row = np.zeros(self.words, dtype=np.uint32)
        self._tail = np.uint32((1 << (n_vocab % 32)) - 1) if n_vocab % 32 else None
        self.end_tokens = list(tokenizer.eos_tokens)
        self._tokenizer = tokenizer
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self.n_consumed = 0  # tokens consumed since the prompt
        self.seconds = 0.0  # spent following committed tokens and computing forced tokens
        self._draft: list[int] = []  # draft tokens consumed past the committed ones (mask_after)
        digest = hashlib.sha256(grammar.encode("utf-8")).digest()
        if checked is None or digest not in checked:
            problem = start_problem(self._matcher.deep_copy(), tokenizer)  # this vocabulary: before any decoding
            if problem is not None:
                raise ConfigError(f"{self._describe()} cannot be used with this model's vocabulary: {problem}",
                                  self.constraint.param if self.constraint else None)
            if checked is not None:
                if len(checked) >= MAX_CHECKED:
                    checked.clear()
                checked.add(digest)

    @classmethod
    def for_model(cls, constraint: Constraint | str, model: VocabModel) -> GrammarFollower:
        """A follower for a model's logits, with the model's (cached) tokenizer; a grammar's
        start is followed once per model."""
        _ = model.vocab_pointer  # refuse a closed model: the tokenizer points into its vocabulary
        future = start_tokenizer(model)
        return cls(constraint, future.result(), model.n_vocab, future.checked)

    # ------------------------------------------------------------ the follower protocol

    def reset(self, tokens: Sequence[int]) -> None:
        """A new context: `tokens` is the prompt; the grammar starts after it."""
        self._matcher.reset()
        self.n_consumed = 0
        self._draft.clear()
        self._check("a reset")

    def commit(self, tokens: Sequence[int]) -> None:
        """Consume committed tokens; one the grammar forbids raises ConstraintError."""
        t0 = time.perf_counter()
        self.end_draft()
        for token in tokens:
            self._matcher.consume_token(int(token))
            self._check(f"token {int(token)} ({self._token_repr(int(token))})")
            self.n_consumed += 1
        self.seconds += time.perf_counter() - t0

    def rollback(self, n: int) -> None:
        """Withdraw the last `n` consumed tokens (never past the prompt)."""
        self.end_draft()
        if n <= 0:
            return
        if n > self.n_consumed:
            raise ConstraintError(f"cannot roll the grammar back by {n} tokens: only {self.n_consumed} were "
                                  "generated since the prompt")
        ok = self._matcher.rollback(n)
        self._check(f"a rollback of {n} tokens")
        if not ok:
            raise ConstraintError(f"llguidance could not roll back {n} tokens")
        self.n_consumed -= n

    # ------------------------------------------------------------ what may come next

    def mask(self, out_row: np.ndarray) -> np.ndarray:
        """Fill `out_row` (uint32, shape (words,)) with the tokens allowed next (after the committed
        tokens, or after the draft :meth:`mask_after` moved to); returns it."""
        if out_row.dtype not in (np.uint32, np.int32) or out_row.shape != (self.words,) \
                or not out_row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"a mask row is a contiguous uint32 array of shape ({self.words},), not "
                             f"{out_row.dtype} {out_row.shape}")
        if self._tokenizer_words == self.words:
            self._matcher.unsafe_compute_mask_ptr(out_row.ctypes.data, out_row.nbytes)
        else:  # the tokenizer's vocabulary is narrower or wider than the logits: pad with zeros or cut
            self._matcher.unsafe_compute_mask_ptr(self._scratch.ctypes.data, self._scratch.nbytes)
            n = min(self.words, self._tokenizer_words)
            out_row[:n] = self._scratch[:n]
            out_row[n:] = 0
        if self._tail is not None:
            out_row.view(np.uint32)[-1] &= self._tail
        self._check("computing a mask")
        return out_row

    def allows(self, token: int) -> bool:
        """Whether `token` may come next."""
        return is_allowed(self.mask(self._row), token)

    def forced(self) -> list[int]:
        """The tokens the grammar forces now (llguidance's fast-forward tokens): whatever is
        sampled, these come next; empty when there is a choice."""
        self.end_draft()
        tokens = self._matcher.compute_ff_tokens()
        self._check("computing forced tokens")
        return [int(t) for t in tokens]

    def accepts_end(self) -> bool:
        """Whether an end token may come now: the output so far is a complete answer."""
        self.end_draft()
        return bool(self._matcher.is_accepting())

    def must_end(self) -> bool:
        """Whether the grammar is complete and only an end token may follow (also true once an
        end token has been consumed)."""
        self.end_draft()
        return bool(self._matcher.is_stopped())

    def masks_along(self, path: Sequence[int], out: np.ndarray) -> int:
        """Masks along a draft path without committing it: ``out[i]`` is the mask after
        ``path[:i]``. Stops at the first token its row forbids; returns how many tokens of the
        path are allowed (``k``: rows 0..k are filled; k == len(path) when all are)."""
        if out.ndim != 2 or out.shape[0] < len(path) + 1:
            raise ValueError(f"masks_along needs at least {len(path) + 1} rows, got shape {out.shape}")
        self.end_draft()
        consumed = 0
        try:
            for i, token in enumerate(path):
                if not is_allowed(self.mask(out[i]), int(token)):
                    return i
                if self._matcher.is_stopped():
                    continue  # an end token after an end token: the matcher takes no step (nothing to roll back)
                self._matcher.consume_token(int(token))
                self._check(f"draft token {int(token)} ({self._token_repr(int(token))})")
                consumed += 1
            self.mask(out[len(path)])
            return len(path)
        finally:
            if consumed:
                self._matcher.rollback(consumed)
                self._check(f"rolling back {consumed} draft tokens")

    def mask_after(self, path: Sequence[int], out_row: np.ndarray) -> np.ndarray:
        """Fill `out_row` with the mask after the draft `path` (not committed; each of its tokens
        allowed by the mask before it: the caller checks, see :meth:`masks_along`); returns it.
        The matcher stays at the end of `path` until the next call, which moves it along the
        shared prefix only (a chain drafted level by level costs one consume per token), or
        until :meth:`end_draft`, which every other method calls first."""
        shared = 0  # path's tokens past an end token are never consumed: _draft may be shorter than a path
        limit = min(len(self._draft), len(path))
        while shared < limit and self._draft[shared] == path[shared]:
            shared += 1
        if len(self._draft) > shared:
            self._withdraw_draft(len(self._draft) - shared)
        for token in path[shared:]:
            if self._matcher.is_stopped():
                break  # past an end token only end tokens follow, and consuming them is no step to roll back
            self._matcher.consume_token(int(token))
            self._draft.append(int(token))
            self._check(f"draft token {int(token)} ({self._token_repr(int(token))})")
        return self.mask(out_row)

    def end_draft(self) -> None:
        """Withdraw the draft tokens :meth:`mask_after` consumed: back at the committed tokens."""
        if self._draft:
            self._withdraw_draft(len(self._draft))

    def _withdraw_draft(self, n: int) -> None:
        ok = self._matcher.rollback(n)
        del self._draft[len(self._draft) - n:]
        self._check(f"rolling back {n} draft tokens")
        if not ok:
            raise ConstraintError(f"llguidance could not roll back {n} draft tokens")

    # ------------------------------------------------------------ errors

    def _check(self, after: str) -> None:
        """ConstraintError when the matcher is in its error state: every grammar's start was
        followed before decoding (start_problem), so a failure here is localspec's own."""
        if self._matcher.is_error():
            detail = self._matcher.get_error()
            log.debug("grammar matcher error after %s: %s", after, detail)
            raise ConstraintError(f"internal error (a bug in localspec, please report it): the grammar matcher failed "
                                  f"after {after}, following {self._describe()}: {first_line(detail)}")

    def _describe(self) -> str:
        return self.constraint.describe() if self.constraint else "the grammar"

    def _token_repr(self, token: int) -> str:
        if token in self.end_tokens:
            return "an end token"
        return self._tokenizer.dbg_tokens([token]) if 0 <= token < self._tokenizer.vocab_size else "out of range"
