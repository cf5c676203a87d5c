"""How far drafts of one kind get accepted, per draft level (:class:`Acceptance`), and drafts whose
outcome past their depth the output decides later (:class:`Censored`).

Acceptance is tracked per kind of draft (the n-gram drafter's proposals by the length of the
context match behind them, the draft model's per pair) and per draft level: the expected tokens
of a step come from the measured chance of getting past each level, not from one per-token rate
(copies are accepted in runs that end at an edit). Counts decay toward an optimistic prior within
a run and persist in the target's profile between runs; decisions use an upper confidence bound,
so a kind with little evidence gets tried and one measured to lose does not, but never deeper
than twice the levels that kind has been seen to reach (a first try is FIRST_TRY deep).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

DECAY = 0.995  # per step: acceptance counts fade so an estimate can recover (half-life ~140 steps)
OPTIMISM = 0.5  # decide with the rejection rate OPTIMISM·sd low (explores a kind of draft until it is known)
LEVELS = 24  # acceptance is tracked per draft level up to here; deeper levels share the last one
PRIOR_WEIGHT = 2.0  # the prior rejection rate is worth two observations
PRIOR_HAZARD = {  # per kind of draft, the rejection rate per level before any evidence: the longer the
    # context match behind a proposal, and the more the output has been copying, the likelier it goes on
    "ngram:m1": 0.8, "ngram:realign": 0.85, "ngram:m2-3": 0.7, "ngram:m4-7": 0.5, "ngram:m8-15": 0.3,
    "ngram:m16+": 0.15, "ngram:m1/copying": 0.4, "ngram:realign/copying": 0.6, "ngram:m2-3/copying": 0.3,
    "ngram:m4-7/copying": 0.15, "ngram:m8-15/copying": 0.08, "ngram:m16+/copying": 0.04,
    "forced": 0.0,  # tokens the grammar forces: the mask allows only them, so each is accepted
    # earlier calls (decoding.history): a match of 4+ tokens with another call's text; the longer,
    # the likelier this call says the same (a question asked again matches all of the earlier one)
    "history:m4-7": 0.5, "history:m8-15": 0.3, "history:m16-31": 0.15, "history:m32+": 0.08,
}
DEFAULT_PRIOR_HAZARD = 0.25  # a draft model's tokens (a pair of one family agrees on ~3 tokens in 4)
SHRINK = 2.0  # a level's rejection rate leans on the kind's pooled rate with this weight
FIRST_TRY = 3  # draft levels of a first try of a kind of draft (explored_depth)
EXPLORED = 0.5  # decayed count of drafts that reached a level for it to count as explored
NO_LIMIT = 1 << 16  # explored_depth once drafts reached the last tracked level


@dataclass
class Censored:
    """A deterministic draft accepted whole and shorter than its proposal: the rest of the proposal
    is compared with the tokens that follow, each level counted as it is decided (reached, then
    accepted or rejected), as if it had been drafted that deep. At T = 0 a one-hot draft is
    accepted exactly where it equals the output; at T > 0, token by token with the probability
    that the output takes that token: either way, the draft's outcome."""

    acceptance: Acceptance
    proposal: tuple[int, ...]
    matched: int  # tokens of the proposal the output has equalled so far

    def follow(self, tokens: Sequence[int]) -> bool:
        """Compare the next committed tokens; True once settled (a wrong token, or the proposal's end)."""
        for t in tokens:
            if self.matched == len(self.proposal):
                return True
            right = t == self.proposal[self.matched]
            self.acceptance.observe_level(self.matched, right)
            if not right:
                return True
            self.matched += 1
        return self.matched == len(self.proposal)


@dataclass
class Acceptance:
    """How far drafts of one kind get accepted: per draft level k, decaying counts of drafts that
    reached level k (`at_risk`) and of those rejected there (`rejected`), a Kaplan-Meier estimate
    of P(accepted >= k). Copies of the context are accepted in runs that end at an edit, which a
    single per-token rate (a geometric length) misjudges; per-level counts do not."""

    at_risk: list[float] = field(default_factory=lambda: [0.0] * LEVELS)
    rejected: list[float] = field(default_factory=lambda: [0.0] * LEVELS)
    prior: float = DEFAULT_PRIOR_HAZARD

    def decay(self) -> None:
        for k in range(LEVELS):
            self.at_risk[k] *= DECAY
            self.rejected[k] *= DECAY

    def observe(self, n_accepted: int, depth: int) -> None:
        """A draft of `depth` tokens of which the first `n_accepted` were accepted."""
        for k in range(min(n_accepted + 1, depth)):
            self.at_risk[min(k, LEVELS - 1)] += 1.0
        if n_accepted < depth:
            self.rejected[min(n_accepted, LEVELS - 1)] += 1.0

    def observe_level(self, k: int, accepted: bool) -> None:
        """One more draft reached level k and was accepted there or not (a draft counted level by
        level: Censored)."""
        self.at_risk[min(k, LEVELS - 1)] += 1.0
        if not accepted:
            self.rejected[min(k, LEVELS - 1)] += 1.0

    def pooled(self, optimism: float = 0.0) -> float:
        """The rejection rate over all levels (with the prior), minus `optimism` standard deviations."""
        e = sum(self.rejected) + PRIOR_WEIGHT * self.prior
        n = sum(self.at_risk) + PRIOR_WEIGHT
        h = e / n
        return max(0.0, h - optimism * (h * (1 - h) / (n + 1)) ** 0.5)

    def hazard(self, k: int, pooled: float | None = None) -> float:
        """P(rejected at level k | reached it): the level's own counts shrunk toward the pooled
        rate (levels seldom reached follow the kind's overall rate; default: its mean)."""
        k = min(k, LEVELS - 1)
        base = self.pooled() if pooled is None else pooled
        return (self.rejected[k] + SHRINK * base) / (self.at_risk[k] + SHRINK)

    def explored_depth(self) -> int:
        """The deepest draft worth trying on this evidence: FIRST_TRY levels, then twice as deep
        as drafts of this kind have been seen to reach (accepted up to level k: 2(k + 1)), so an
        unknown kind is not first tried 32 tokens deep, where a miss costs ~15 target steps."""
        if self.prior == 0.0 and not any(self.rejected):
            return NO_LIMIT  # a certain kind (forced tokens): nothing to explore
        reached = max((k for k in range(LEVELS) if self.at_risk[k] >= EXPLORED), default=-1)
        return NO_LIMIT if reached == LEVELS - 1 else max(FIRST_TRY, 2 * (reached + 1))

    def expectations(self, depth: int, optimism: float = OPTIMISM) -> list[float]:
        """E[tokens per step] of drafts of 0, 1, ..., `depth` tokens (accepted ones + the extra
        token), each level's rejection rate taken `optimism` standard deviations low (an upper
        bound, so a kind of draft with little evidence gets tried, and one measured to lose does
        not): 1 + the sum over levels k < d of P(accepted > k)."""
        pooled = self.pooled(optimism)
        out, survive = [1.0], 1.0
        for k in range(depth):
            survive *= 1.0 - self.hazard(k, pooled=pooled)
            out.append(out[-1] + survive)
        return out

    def expected(self, depth: int, optimism: float = OPTIMISM) -> float:
        return self.expectations(depth, optimism)[depth]

    @property
    def alpha(self) -> float:
        """The first level's acceptance rate (a summary for reports)."""
        return 1.0 - self.hazard(0)

