"""Which drafter drafts how deep at each step: policy, apart from the mechanism that drafts,
decodes, verifies and commits (localspec.decoding.engine).

A :class:`Policy` picks one of a step's proposals and a depth, decodes the prompt (the planner
measures its cost curve on the way), and observes each step (what it cost, what was accepted).
:class:`~localspec.decoding.planner.Planner` is the cost-aware policy (``--plan auto``);
:class:`FixedPolicy` always drafts the full shape from the first drafter that offers enough
(``--plan fixed``) and learns nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from localspec.decoding import passes
from localspec.decoding.passes import Steps

if TYPE_CHECKING:
    from localspec.decoding.batch_plan import Offer
    from localspec.decoding.drafters import Drafter, DraftProposal
    from localspec.decoding.state import Draft
    from localspec.llama.sequence import KVSequence

MIN_PROPOSAL = 2  # a drafter followed by another is used when it proposes at least this many tokens


class Policy(Protocol):
    """What the engine asks of a policy."""

    def pick(self, proposals: Sequence[DraftProposal], depth: int, prompt_tokens: int,
             remaining: int, batch: int = 0) -> tuple[DraftProposal, int] | None:
        """The proposal to draft from and how many levels (None: a target-only step, nothing drafted);
        `proposals` in the drafters' order, each offering at least one level and at most `depth`
        (the step's cap: localspec.decoding.depth.step_depth); `batch`: the tokens other calls
        put in the same target pass (0: this call is alone)."""

    def offer(self, proposals: Sequence[DraftProposal], depth: int, prompt_tokens: int,
              remaining: int) -> tuple[DraftProposal, Offer] | None:
        """The step's options for a round planned with other calls' (localspec.decoding.batch_plan);
        None: it drafts as pick says (a fixed plan), or nothing."""

    def prefill(self, sequence: KVSequence, upto: int) -> Steps[None]:
        """Decode the prompt into the target's sequence up to `upto` (as requests:
        localspec.decoding.passes)."""

    def observe_step(self, draft: Draft, n_accepted: int, target_seconds: float | None, new: Sequence[int],
                     pass_tokens: int | None = None) -> None:
        """A step was verified: its draft, how many of its tokens were accepted, the target pass's
        time (None: it needed none), the tokens it committed; `pass_tokens`: the tokens of that
        pass, other calls' included (None: only this step's)."""

    def finish(self) -> None:
        """The generation ended: what was learned goes into the cost profiles."""


class FixedPolicy:
    """--plan fixed: the first drafter (in order) that proposes at least MIN_PROPOSAL levels, or
    the last one's proposal, drafted as deep as it offers."""

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        self.last = drafters[-1] if drafters else None

    def pick(self, proposals: Sequence[DraftProposal], depth: int, prompt_tokens: int,
             remaining: int, batch: int = 0) -> tuple[DraftProposal, int] | None:
        for proposal in proposals:
            if proposal.drafter is self.last or proposal.levels >= min(MIN_PROPOSAL, depth):
                return proposal, proposal.levels
        return None

    def offer(self, proposals: Sequence[DraftProposal], depth: int, prompt_tokens: int,
              remaining: int) -> tuple[DraftProposal, Offer] | None:
        return None  # a fixed plan drafts what it drafts, beside others or not

    def prefill(self, sequence: KVSequence, upto: int) -> Steps[None]:
        return passes.fill(sequence, upto)

    def observe_step(self, draft: Draft, n_accepted: int, target_seconds: float | None, new: Sequence[int],
                     pass_tokens: int | None = None) -> None:
        pass

    def finish(self) -> None:
        pass
