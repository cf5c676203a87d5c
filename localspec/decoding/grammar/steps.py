"""A constrained generation's step: the grammar follows the target's committed tokens and gives
the token masks of every row a step verifies.

:class:`Structured` is what the pair's state holds when the config has a constraint: the compiled
grammar and the :class:`~localspec.decoding.grammar.follower.GrammarFollower` of the model's
llguidance tokenizer, both made when the engine is made, so a grammar that cannot be enforced
is a ConfigError before any decoding (the follower follows the grammar's start over the model's
vocabulary); the follower is attached to the target's
:class:`~localspec.llama.sequence.KVSequence` of the generation's slot for one generation. Each step gets its
:class:`StepMasks` (:meth:`Structured.step`): the mask rows of that step's draft, in preallocated
buffers, and the rows the verifier takes (:meth:`StepMasks.verified_rows`), after which the grammar is
back at the committed tokens.

Row ids are the verifier's: row 0 is after the committed tokens, row j+1 after draft node j. A
row is computed once per step (:meth:`StepMasks.row` caches it by the path it follows), so the
masks a draft model drew its children from are the ones the verifier sees.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from localspec.decoding.drafters import DraftProposal
from localspec.decoding.grammar.compiler import compile_constraint
from localspec.decoding.grammar.follower import GrammarFollower
from localspec.decoding.grammar.masks import allocate_masks, is_allowed
from localspec.decoding.tree import DraftTree
from localspec.errors import ConstraintError
from localspec.llama.model import Model
from localspec.llama.sequence import KVSequence
from localspec.settings.constraints import Constraint

log = logging.getLogger(__name__)


class StepMasks:
    """The mask rows of one step's draft, computed once each (see the module docstring)."""

    def __init__(self, follower: GrammarFollower, max_nodes: int) -> None:
        self.follower = follower
        self.rows = allocate_masks(max_nodes + 1, follower.n_vocab)
        self._paths: list[tuple[int, ...] | None] = [None] * (max_nodes + 1)  # the draft path each row is after
        self.seconds = 0.0  # spent computing rows and returning the grammar to the committed tokens

    def _begin(self) -> StepMasks:
        """A new step: the committed tokens changed, no row is known."""
        for r in range(len(self._paths)):
            self._paths[r] = None
        return self

    def _end(self) -> None:
        """The step's masks are done: the grammar is back at the committed tokens."""
        t0 = time.perf_counter()
        self.follower.end_draft()
        self.seconds += time.perf_counter() - t0

    def cut(self, proposal: DraftProposal) -> DraftProposal | None:
        """A fixed proposal cut at its first token the masks forbid (None: nothing left)."""
        k = self.allowed_prefix(proposal.tokens[: proposal.levels])
        if k == len(proposal.tokens):
            return proposal
        if k == 0:
            return None
        return DraftProposal(proposal.drafter, proposal.kind, k, proposal.lag,
                             proposal.tokens[:k])

    def verified_rows(self, tree: DraftTree, certain: bool) -> np.ndarray:
        """The step's last use of its masks: the rows of its draft for the verifier (`certain`: a
        forced chain, each row checked to allow exactly its token), the grammar back at the
        committed tokens afterwards."""
        try:
            rows = self.complete(tree)
            if certain:
                self.check_forced(tree)
        finally:
            self._end()
        return rows

    def _row_after(self, r: int, path: tuple[int, ...]) -> np.ndarray:
        if self._paths[r] != path:
            t0 = time.perf_counter()
            self.follower.mask_after(path, self.rows[r])
            self._paths[r] = path
            self.seconds += time.perf_counter() - t0
        return self.rows[r]

    def row(self, tree: DraftTree, node: int) -> np.ndarray:
        """The tokens allowed after `node` of `tree` (-1: after the committed tokens); every
        token on its path must be allowed by the row before it."""
        path: list[int] = []
        j = node
        while j >= 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        return self._row_after(node + 1, tuple(reversed(path)))

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of a fixed chain's tokens the masks allow (its rows 0..k become the rows of
        the chain drafted from them)."""
        for i, token in enumerate(tokens):
            if not is_allowed(self._row_after(i, tuple(tokens[:i])), int(token)):
                return i
        return len(tokens)

    def complete(self, tree: DraftTree) -> np.ndarray:
        """Every row of the draft (rows 0..n). A node its parent's row forbids is never accepted:
        its row and its descendants' are copies of the parent's, never read for a token."""
        root = self.row(tree, -1)
        ok = [False] * tree.n
        for j, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
            if (parent < 0 or ok[parent]) and is_allowed(self.rows[parent + 1], token):
                ok[j] = True
                self.row(tree, j)
            else:
                self.rows[j + 1] = self.rows[parent + 1] if parent >= 0 else root
                self._paths[j + 1] = None
        return self.rows[: tree.n + 1]

    def check_forced(self, tree: DraftTree) -> None:
        """Each row along a forced chain allows exactly the next token (what forced means)."""
        for j, token in enumerate(tree.tokens):
            row = self.rows[j]  # a chain: node j's parent row is row j
            if int(np.bitwise_count(row).sum()) != 1 or not is_allowed(row, token):
                raise ConstraintError(f"the grammar forced token {token} at draft level {j + 1}, but its mask "
                                      f"allows {int(np.bitwise_count(row).sum())} tokens"
                                      f"{'' if is_allowed(row, token) else ', not that one'}")


class Structured:
    """A constrained generation's grammar state across the engine's steps."""

    def __init__(self, constraint: Constraint, target: Model, max_nodes: int) -> None:
        """ConfigError (naming the constraint's setting) now, before any decoding, for a grammar
        that cannot be enforced with the target's vocabulary. Waits for the target's tokenizer
        (built once per model: ~0.7 s for a 152k vocabulary; the CLI builds it while the weights load)."""
        self.constraint = constraint
        self.grammar = compile_constraint(constraint)
        self.target = target
        self.max_nodes = max_nodes
        self.follower = GrammarFollower.for_model(constraint, target)  # its start followed once per model
        self.masks = StepMasks(self.follower, max_nodes)
        self._sequence: KVSequence | None = None  # the sequence it follows (attach)

    @property
    def seconds(self) -> float:
        """This generation's time in the grammar: mask rows (for drafting, cutting and verifying),
        forced tokens, following the committed tokens."""
        return self.masks.seconds + self.follower.seconds

    def attach(self, prompt: Sequence[int], sequence: KVSequence) -> None:
        """After the prefill: the grammar follows the committed tokens of the target's `sequence`
        (the generation's slot) from the prompt on."""
        self.detach()
        follower = self.follower
        follower.reset(prompt)
        sequence.followers.append(follower)
        self._sequence = sequence
        follower.seconds = self.masks.seconds = 0.0

    def detach(self) -> None:
        """The generation ended (or failed): the grammar no longer follows the target."""
        sequence, self._sequence = self._sequence, None
        if sequence is not None and self.follower in sequence.followers:
            sequence.followers.remove(self.follower)

    def step(self) -> StepMasks:
        """A step begins: its draft's mask rows (nothing known yet)."""
        return self.masks._begin()

    @property
    def satisfied(self) -> bool:
        """Whether the text committed so far is a complete answer of the grammar."""
        return self.follower.accepts_end()
