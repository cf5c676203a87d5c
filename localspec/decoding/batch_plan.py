"""How deep each of several calls in one target pass drafts: the round's plan, priced as a whole.

With several calls (slots) in the pass, a step's cost is the cost of the whole pass on this
machine's curve, shared: drafting and batching compete for the same spare compute (Su et al.,
"The synergy of speculative decoding and batching", arXiv 2310.18813). On a CPU whose kernels run
tokens in blocks (c(4) ≈ 2.8, c(8) ≈ 6.4, c(16) ≈ 7.9, c(20) ≈ 9 passes of one token on the 2-core
reference host), one call drafting alone beside three others never pays for its jump from 4 to 8
tokens, while all four drafting together fill a block whose tokens are cheap: the plan is chosen
for the round, not slot by slot.

Each call offers its options (:class:`Offer`: per depth, the tokens it expects to commit, the
tokens it puts in the pass and the seconds its draft model spends), made by its own policy
(localspec.decoding.planner.Planner.offer: only depths its acceptance and its loss allowance
allow); :func:`allocate` picks a depth per offer that maximises the round's expected tokens per
second, and drafts at all only where that beats the round without drafts by the policy's margin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Offer:
    """A step's drafting options, depths[0] = 0 (nothing drafted) first: the tokens it expects to
    commit at each depth, the tokens it adds to the target pass, the seconds its drafting takes;
    `cost`: seconds of a target pass of n tokens (its policy's curve); `margin`: how much faster a
    plan with drafts must be predicted to be."""

    depths: tuple[int, ...]
    expected: tuple[float, ...]
    tokens: tuple[int, ...]
    draft_seconds: tuple[float, ...]
    cost: Callable[[int], float]
    margin: float = 1.0


def _rate(offers: Sequence[Offer], choice: Sequence[int], fixed_tokens: int, fixed_expected: float) -> tuple[float, int]:
    """(expected tokens per second, tokens of the pass) of a choice (an index into each offer)."""
    tokens = fixed_tokens + sum(o.tokens[c] for o, c in zip(offers, choice, strict=True))
    seconds = offers[0].cost(tokens) + sum(o.draft_seconds[c] for o, c in zip(offers, choice, strict=True))
    expected = fixed_expected + sum(o.expected[c] for o, c in zip(offers, choice, strict=True))
    return (expected / seconds if seconds > 0 else 0.0), tokens


def _moves(offers: Sequence[Offer], choice: list[int]) -> list[list[int]]:
    """The choices one move away: one offer deeper (to any of its depths), or every offer at once
    to the same depth (where it has it): the move that fills a block of the curve together."""
    out = []
    for i, o in enumerate(offers):
        for c in range(choice[i] + 1, len(o.depths)):
            out.append(choice[:i] + [c] + choice[i + 1:])
    for depth in sorted({d for o in offers for d in o.depths if d > 0}):
        together = [max(c, max((k for k, d in enumerate(o.depths) if d <= depth), default=0))
                    for o, c in zip(offers, choice, strict=True)]
        if together != choice:
            out.append(together)
    return out


def allocate(offers: Sequence[Offer], fixed_tokens: int = 0, fixed_expected: float = 0.0,
             capacity: int | None = None) -> list[int]:
    """The depth each offer drafts: the plan of the round with the most expected tokens per second,
    the pass holding `fixed_tokens` more (other calls' parts, a prompt's chunk) that commit
    `fixed_expected` tokens, at most `capacity` tokens in all; greedy, one move at a time (see
    _moves), kept only where it beats no drafts by the offers' margin. All zeros: draft nothing."""
    if not offers:
        return []
    choice = [0] * len(offers)
    base, _ = _rate(offers, choice, fixed_tokens, fixed_expected)
    best = base
    while True:
        found = None
        for trial in _moves(offers, choice):
            rate, tokens = _rate(offers, trial, fixed_tokens, fixed_expected)
            if (capacity is None or tokens <= capacity) and rate > best and (found is None or rate > found[0]):
                found = (rate, trial)
        if found is None:
            break
        best, choice = found
    if best < base * max(o.margin for o in offers):
        return [0] * len(offers)
    return [o.depths[c] for o, c in zip(offers, choice, strict=True)]
