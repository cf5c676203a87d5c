"""The planner replay (benchmarks/planner_replay.py) on made-up token sequences, without a model:
it never beats the ceiling, it drafts a long copy and nothing on text with no repeats, and its
shadow variant learns from proposals it did not draft; the hindsight policy and the uncapped
planner that locate the gap to the ceiling stay within it."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.decoding.planner import FIRST_TRY, CostTable, Planner

import planner_replay as pr  # benchmarks/ (pyproject's pytest pythonpath)
from head_to_head import ngram_runs, oracle_seconds

CURVE = {1: 0.036, 2: 0.070, 4: 0.100, 8: 0.200, 16: 0.300, 32: 0.560}  # a CPU-like curve, increasing
COST = CostTable(dict(CURVE))


def planner(warm_costs: bool = True) -> Planner:
    return pr.planner_for(pr.fresh_profile(CURVE, 0.011, warm_costs))


def words(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(1000, 1_000_000, size=n)]  # no token repeats by chance


def copy_case(seed: int = 0) -> tuple[list[int], list[int]]:
    """An answer that writes 6 new tokens, copies 100 tokens of the prompt, then 10 new ones."""
    rng = np.random.default_rng(seed)
    source = words(rng, 100)
    return [*words(rng, 20), *source, *words(rng, 5)], [*words(rng, 6), *source, *words(rng, 10)]


def test_a_long_copy_is_drafted_and_the_replay_never_beats_the_ceiling() -> None:
    prompt, output = copy_case()
    alone = len(output) * COST(1)
    ceiling = oracle_seconds(ngram_runs(prompt, output), COST, 31)
    for shadow in (False, True):
        got = pr.replay(planner(), prompt, output, COST, max_tokens=len(output), shadow=shadow)
        assert got.accepted > 60 and got.steps < len(output) - 60  # most of the copy went through in drafts
        assert ceiling <= got.seconds < alone / 1.2


def test_text_with_no_repeats_is_never_drafted() -> None:
    rng = np.random.default_rng(1)
    prompt, output = words(rng, 50), words(rng, 60)
    got = pr.replay(planner(), prompt, output, COST, max_tokens=len(output))
    assert (got.drafted, got.steps) == (0, len(output))
    assert abs(got.seconds - len(output) * COST(1)) < 1e-9


def test_settle_decides_a_proposal_only_once_the_output_shows_its_outcome() -> None:
    p = planner()
    pending = [(0, (5, 6, 7), "ngram:m4-7")]
    assert pr.settle(p, pending, [5, 6]) == pending  # right so far, undecided
    acc = p.acceptance("ngram:m4-7")
    assert sum(acc.at_risk) == 0
    assert pr.settle(p, pending, [5, 6, 9]) == []  # wrong at its third token
    assert acc.at_risk[:4] == [1.0, 1.0, 1.0, 0.0] and acc.rejected[:3] == [0.0, 0.0, 1.0]


def test_the_shadow_variant_learns_from_proposals_it_did_not_draft() -> None:
    """One-token chance matches are never drafted (their prior says they fail), so only the shadow
    variant learns how they fare; the baseline (negative control) knows nothing of them."""
    rng = np.random.default_rng(2)
    vocab = [int(x) for x in rng.integers(1000, 1100, size=40)]  # few distinct tokens: many chance matches
    prompt = [vocab[int(i)] for i in rng.integers(0, 40, size=60)]
    output = [vocab[int(i)] for i in rng.integers(0, 40, size=60)]
    seen = {}
    for shadow in (False, True):
        p = planner()
        got = pr.replay(p, prompt, output, COST, max_tokens=len(output), shadow=shadow)
        assert got.drafted == 0  # chance matches are not worth drafting either way
        seen[shadow] = sum(p.acceptance("ngram:m1").at_risk)
    assert seen[False] == 0 and seen[True] > 5


def test_a_given_cost_curve_is_parsed_and_checked(capsys) -> None:
    args = pr.parse_args(["--curve", "2:1.76, 16:8.43,32:14.02", "--prefill-rate", "0.3"])
    assert args.curve == {1: 1.0, 2: 1.76, 16: 8.43, 32: 14.02} and args.prefill_rate == 0.3
    for bad in (["--curve", "2:x"], ["--curve", "4:5"], ["--curve", "0:1"], ["--prefill-rate", "0.3"]):
        with pytest.raises(SystemExit):
            pr.parse_args(bad)
        assert "--curve" in capsys.readouterr().err


def test_hindsight_lies_between_the_target_alone_and_the_ceiling() -> None:
    """The best fixed depth per kind is a policy of the same lookup, so it can never beat the
    ceiling; on a long copy it must find a policy that drafts it, and on text with no repeats
    (negative control) there is nothing to find."""
    prompt, output = copy_case()
    alone = len(output) * COST(1)
    ceiling = alone / oracle_seconds(ngram_runs(prompt, output), COST, 31)
    best = pr.hindsight(prompt, output, COST, max_tokens=len(output))
    assert 1.5 < best <= ceiling + 1e-9
    rng = np.random.default_rng(1)
    assert pr.hindsight(words(rng, 50), words(rng, 60), COST, max_tokens=60) == pytest.approx(1.0)


def test_a_fixed_policy_drafts_the_kinds_it_names_and_nothing_without_them() -> None:
    prompt, output = copy_case()
    kinds: set[str] = set()
    none = pr.replay({}, prompt, output, COST, max_tokens=len(output), kinds=kinds)
    assert none.drafted == 0 and kinds  # proposals were seen, none drafted
    deep = pr.replay({k: 15 for k in kinds if k.endswith("/copying")}, prompt, output, COST, max_tokens=len(output))
    assert deep.drafted > 0 and deep.seconds < none.seconds


def test_the_uncapped_planner_differs_from_the_planner_only_in_its_exploration_cap() -> None:
    capped, uncapped = planner(), pr.planner_for(pr.fresh_profile(CURVE, 0.011, True), uncapped=True)
    assert capped.acceptance("ngram:m16+/copying").explored_depth() == FIRST_TRY  # a first try
    assert uncapped.acceptance("ngram:m16+/copying").explored_depth() > 31
    assert uncapped.acceptance("ngram:m1").prior == capped.acceptance("ngram:m1").prior
    prompt, output = copy_case()
    taught = pr.self_taught(prompt, output, CURVE, 0.011, COST, len(output), rounds=2)
    ceiling = len(output) * COST(1) / oracle_seconds(ngram_runs(prompt, output), COST, 31)
    assert 1.2 < taught <= ceiling + 1e-9
