"""The cost-aware planner: the cost model's arithmetic and its decisions in known regimes."""

from __future__ import annotations

import pytest

from localspec.api import stream_generate
from localspec.model import Model
from localspec.config import Shape
from localspec.planner import Acceptance, CostTable, Planner, expected_tokens, step_costs


def test_expected_tokens_formula() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_cost_table_interpolates_a_line() -> None:
    t = CostTable()
    t.observe(1, 0.033)
    t.observe(5, 0.105)
    assert t(1) == 0.033
    assert t(3) == pytest.approx(0.069)
    assert t(9) == pytest.approx(0.177)


def test_acceptance_estimate_and_decay() -> None:
    a = Acceptance()
    assert a.alpha == pytest.approx(2 / 3)  # the prior
    for _ in range(200):
        a.observe(1, 4)  # one of four accepted, then a rejection
    assert a.alpha == pytest.approx(0.5, abs=0.02)
    for _ in range(300):
        a.decay()
    assert a.alpha == pytest.approx(2 / 3, abs=0.01)  # back to the prior: worth probing again


def planner_with(target: dict[int, float], draft_level: float | None, shape: Shape, alpha_runs: int,
                 accepted: int) -> Planner:
    p = Planner.__new__(Planner)
    p.shape = shape
    p.target_cost = CostTable(dict(target))
    p.draft_cost = CostTable({1: draft_level}) if draft_level is not None else None
    p.acceptance = {"model": Acceptance(), "ngram": Acceptance()}
    for _ in range(alpha_runs):
        p.acceptance["model"].observe(accepted, shape.depth)
        p.acceptance["ngram"].observe(accepted, shape.depth)
    return p


CPU = {1: 0.033, 2: 0.051, 4: 0.092, 5: 0.105, 8: 0.172, 9: 0.185}  # docs/design.md: the default 1.5B target on 2 cores


def test_planner_declines_a_model_drafter_that_cannot_pay() -> None:
    """The CPU numbers of docs/design.md: a 21 ms draft level against a 33 ms target step loses even
    at 91 % acceptance, so the planner decodes with the target alone."""
    p = planner_with(CPU, 0.021, Shape.chain(4), alpha_runs=100, accepted=4)  # α ≈ 1
    assert p.acceptance["model"].alpha > 0.9
    assert p.depth("model", 4) == 0


def test_planner_drafts_with_a_free_accurate_drafter() -> None:
    """n-gram drafts are free: at high acceptance drafting pays on the same CPU."""
    p = planner_with(CPU, None, Shape.chain(4), alpha_runs=100, accepted=4)
    assert p.depth("ngram", 4) >= 3


def test_fresh_planner_explores_a_free_drafter_but_not_a_costly_one() -> None:
    """No observations yet: the optimistic estimate tries n-gram drafts (free) on the CPU costs,
    while even a perfect model drafter cannot pay there; repeated misses stop the n-gram drafts."""
    fresh = planner_with(CPU, 0.021, Shape.chain(4), alpha_runs=0, accepted=0)
    assert fresh.acceptance["ngram"].optimistic > fresh.acceptance["ngram"].alpha
    assert fresh.depth("ngram", 4) >= 1
    assert fresh.depth("model", 4) == 0
    missing = planner_with(CPU, None, Shape.chain(4), alpha_runs=20, accepted=0)
    assert missing.depth("ngram", 4) == 0


def test_planner_drafts_where_the_draft_is_cheap() -> None:
    """A GPU-like regime: verifying 9 tokens costs ~2x one, the draft 5 % of a target step."""
    gpu = {1: 0.0023, 2: 0.0025, 5: 0.0033, 9: 0.0047}
    p = planner_with(gpu, 0.00012, Shape.chain(8), alpha_runs=50, accepted=6)
    assert p.depth("model", 8) >= 4
    bad = planner_with(gpu, 0.00012, Shape.chain(8), alpha_runs=200, accepted=0)  # never accepted
    assert bad.depth("model", 8) == 0


def test_auto_plan_runs_and_measures_costs(tiny_target: Model, tiny_draft: Model) -> None:
    out = list(stream_generate(tiny_target, tiny_draft, "def add(a, b):", max_tokens=30, temperature=0,
                               num_draft_tokens=4))
    assert out[-1].finish_reason in ("length", "stop")
    costs = step_costs(tiny_target).seconds
    assert 1 in costs and 5 in costs and all(v > 0 for v in costs.values())


def test_cost_table_follows_a_kinked_curve() -> None:
    """Measured CPU costs are not a line (a batch of 16 costs about what 9 cost): unmeasured sizes
    come from their neighbours, not from a least-squares line through all of them."""
    t = CostTable({1: 0.040, 7: 0.175, 9: 0.350, 16: 0.343})
    assert t(8) == pytest.approx(0.2625)
    assert t(12) == pytest.approx(0.350 - 0.007 * 3 / 7)
    assert t(32) == pytest.approx(0.343)  # beyond: the falling last segment is floored at c(16)
    assert t(4) == pytest.approx(0.040 + 0.135 * 3 / 6)
    below = CostTable({2: 0.06, 4: 0.10})
    assert below(1) == pytest.approx(0.04)
    assert CostTable({4: 0.1, 8: 0.3})(1) == pytest.approx(0.025)  # the line would go negative: per token
