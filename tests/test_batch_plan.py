"""The round's plan of several calls' drafts (localspec.decoding.batch_plan.allocate): the depths
that give the whole pass the most expected tokens per second, priced on the machine's curve."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from localspec.decoding import batch_plan
from localspec.decoding.batch_plan import Offer, allocate
from localspec.decoding.costs import CostTable
from localspec.decoding.planner import Planner
from localspec.decoding.profiles import Profile, Profiles
from localspec.settings.shape import Shape

C1 = 0.035
AMD = CostTable({n: C1 * r for n, r in {1: 1.0, 2: 1.69, 4: 2.82, 8: 6.44, 16: 7.85, 32: 13.3}.items()})
FLAT = CostTable({1: C1, 32: C1})  # a GPU-like curve: 32 tokens cost what one costs


def chain_offer(alpha: float, depth: int, cost: CostTable, margin: float = 1.1) -> Offer:
    """A chain drafter's options: accepted level by level with probability alpha; free drafts."""
    expected = [1.0]
    for d in range(1, depth + 1):
        expected.append(expected[-1] + alpha ** d)
    depths = tuple(range(depth + 1))
    return Offer(depths, tuple(expected), tuple(d + 1 for d in depths), (0.0,) * len(depths), cost, margin)


def test_alone_it_drafts_where_one_call_pays() -> None:
    assert allocate([chain_offer(0.95, 8, FLAT)]) == [8]
    assert allocate([chain_offer(0.2, 8, AMD)]) == [0]  # rejected drafts never pay on a steep curve


def test_four_calls_draft_together_where_one_alone_beside_them_would_not() -> None:
    """On the CPU's block-shaped curve one call's 4-token draft beside three roots costs a jump
    from 4 to 8 tokens (2.8 -> 6.4 passes of one), but all four drafting fill a block whose tokens
    are cheap: the plan drafts for all. Negative control: moves of one call at a time never start."""
    offers = [chain_offer(0.95, 4, AMD) for _ in range(4)]
    assert allocate(offers) == [4, 4, 4, 4]
    rate = lambda ds: sum(o.expected[d] for o, d in zip(offers, ds)) / AMD(sum(d + 1 for d in ds))  # noqa: E731
    assert rate([4, 4, 4, 4]) > 1.1 * rate([0, 0, 0, 0]) > rate([4, 0, 0, 0])


def test_negative_control_one_call_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    real = batch_plan._moves
    monkeypatch.setattr(batch_plan, "_moves",
                        lambda offers, choice: [m for m in real(offers, choice)
                                                if sum(a != b for a, b in zip(m, choice)) == 1])
    assert allocate([chain_offer(0.95, 4, AMD) for _ in range(4)]) == [0, 0, 0, 0]


def test_the_pass_never_exceeds_its_capacity_and_others_count() -> None:
    offers = [chain_offer(0.95, 8, FLAT) for _ in range(4)]
    depths = allocate(offers, fixed_tokens=20, fixed_expected=2.0, capacity=32)
    assert 20 + sum(d + 1 for d in depths) <= 32 and sum(depths) > 0


def test_alone_the_plan_is_the_planners_own_choice() -> None:
    """One call's offer, planned alone, drafts the depth its planner's choose gives (the rule of a
    call with nothing beside it), across acceptances and curves."""
    for alpha in (0.3, 0.6, 0.9, 0.99):
        for curve in (AMD, FLAT):
            p = Planner.__new__(Planner)
            p.shape, p.sampled = Shape.chain(8), False
            p._nodes = [p.shape.truncated(d).n_nodes for d in range(9)]
            p.target_bytes, p.profiles, p.profile = 1 << 30, Profiles.in_memory(), Profile("t", {})
            p.target_cost, p._acceptance, p._draft_costs, p._censored = curve, {}, {}, []
            p.saved, p.length = None, 0
            acc = p.acceptance("k")
            for _ in range(60):
                acc.observe(int(alpha * 8), 8)
            free = SimpleNamespace(source=None, loaded=True)
            proposal = SimpleNamespace(drafter=free, kind="k", levels=8, lag=0, tokens=())
            made = p.offer([proposal], 8, 10, 100)
            alone = p.choose(free, "k", 8)[0]
            assert (allocate([made[1]])[0] if made else 0) == alone, (alpha, curve.seconds)
