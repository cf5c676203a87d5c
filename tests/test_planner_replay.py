"""The planner replay (benchmarks/replay) on made-up token sequences, without a model: it never
beats the ceiling, it drafts a long copy and nothing on text with no repeats, and its shadow
variant learns from proposals it did not draft; the hindsight policy and the uncapped planner
that locate the gap to the ceiling stay within it. The planner is driven as the engine drives
it (Policy.pick, observe_step, finish)."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.settings.generation import GenerationConfig
from localspec.decoding.acceptance import FIRST_TRY
from localspec.decoding.costs import CostTable
from localspec.decoding.planner import Planner
from localspec.decoding.profiles import Profiles

from benchmarks.replay import planner as cli, planners, policies
from benchmarks.replay.ceiling import ngram_runs, oracle_seconds
from benchmarks.replay.steps import answer_lookup, replay

from replay_rules import Always

CURVE = {1: 0.036, 2: 0.070, 4: 0.100, 8: 0.200, 16: 0.300, 32: 0.560}  # a CPU-like curve, increasing
COST = CostTable(dict(CURVE))


def planner(warm_costs: bool = True, shadow: bool = False) -> Planner:
    return planners.planner_for(planners.fresh_profile(CURVE, 0.011, warm_costs), shadow=shadow)


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
        got = replay(planner(shadow=shadow), prompt, output, COST, max_tokens=len(output))
        assert got.accepted > 60 and got.steps < len(output) - 60  # most of the copy went through in drafts
        assert ceiling <= got.seconds < alone / 1.2


def test_text_with_no_repeats_is_never_drafted() -> None:
    rng = np.random.default_rng(1)
    prompt, output = words(rng, 50), words(rng, 60)
    got = replay(planner(), prompt, output, COST, max_tokens=len(output))
    assert (got.drafted, got.steps) == (0, len(output))
    assert abs(got.seconds - len(output) * COST(1)) < 1e-9


def test_settle_decides_a_proposal_only_once_the_output_shows_its_outcome() -> None:
    p = planner(shadow=True)
    pending = [(0, (5, 6, 7), "ngram:m4-7")]
    assert p.settle(pending, [5, 6]) == pending  # right so far, undecided
    acc = p.acceptance("ngram:m4-7")
    assert sum(acc.at_risk) == 0
    assert p.settle(pending, [5, 6, 9]) == []  # wrong at its third token
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
        p = planner(shadow=shadow)
        got = replay(p, prompt, output, COST, max_tokens=len(output))
        assert got.drafted == 0  # chance matches are not worth drafting either way
        seen[shadow] = sum(p.acceptance("ngram:m1").at_risk)
    assert seen[False] == 0 and seen[True] > 5


def test_a_given_cost_curve_is_parsed_and_checked(capsys) -> None:
    args = cli.parse_args(["--curve", "2:1.76, 16:8.43,32:14.02", "--prefill-rate", "0.3"])
    assert args.curve == {1: 1.0, 2: 1.76, 16: 8.43, 32: 14.02} and args.prefill_rate == 0.3
    for bad in (["--curve", "2:x"], ["--curve", "4:5"], ["--curve", "0:1"], ["--prefill-rate", "0.3"]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)
        assert "--curve" in capsys.readouterr().err


def test_hindsight_lies_between_the_target_alone_and_the_ceiling() -> None:
    """The best fixed depth per kind is a policy of the same lookup, so it can never beat the
    ceiling; on a long copy it must find a policy that drafts it, and on text with no repeats
    (negative control) there is nothing to find."""
    prompt, output = copy_case()
    alone = len(output) * COST(1)
    ceiling = alone / oracle_seconds(ngram_runs(prompt, output), COST, 31)
    best = policies.hindsight(prompt, output, COST, max_tokens=len(output))
    assert 1.5 < best <= ceiling + 1e-9
    rng = np.random.default_rng(1)
    assert policies.hindsight(words(rng, 50), words(rng, 60), COST, max_tokens=60) == pytest.approx(1.0)


def test_a_fixed_policy_drafts_the_kinds_it_names_and_nothing_without_them() -> None:
    prompt, output = copy_case()
    kinds: set[str] = set()
    none = replay({}, prompt, output, COST, max_tokens=len(output), kinds=kinds)
    assert none.drafted == 0 and kinds  # proposals were seen, none drafted
    deep = replay({k: 15 for k in kinds if k.endswith("/copying")}, prompt, output, COST, max_tokens=len(output))
    assert deep.drafted > 0 and deep.seconds < none.seconds


def test_the_uncapped_planner_differs_from_the_planner_only_in_its_exploration_cap() -> None:
    capped, uncapped = planner(), planners.planner_for(planners.fresh_profile(CURVE, 0.011, True), uncapped=True)
    assert capped.acceptance("ngram:m16+/copying").explored_depth() == FIRST_TRY  # a first try
    assert uncapped.acceptance("ngram:m16+/copying").explored_depth() > 31
    assert uncapped.acceptance("ngram:m1").prior == capped.acceptance("ngram:m1").prior
    prompt, output = copy_case()
    taught = planners.self_taught(prompt, output, CURVE, 0.011, COST, len(output), rounds=2)
    ceiling = len(output) * COST(1) / oracle_seconds(ngram_runs(prompt, output), COST, 31)
    assert 1.2 < taught <= ceiling + 1e-9


# ---------------------------------------------------------------- decisions on constructed traces

AMD = {n: 0.03 * r for n, r in {1: 1.0, 2: 1.65, 4: 2.56, 8: 6.24, 16: 6.84}.items()}  # this host's steep curve
AMD_COST = CostTable(dict(AMD))


class NoCompletionPlanner(Planner):
    """The planner as it was: it learns from the levels it drafted only (negative control)."""

    def observe(self, kind, depth, n_accepted, n_target_tokens, target_seconds, offered=(), new=(),
                draft_seconds=0.0, pass_tokens=None) -> None:
        super().observe(kind, depth, n_accepted, n_target_tokens, target_seconds, (), new, draft_seconds, pass_tokens)


def copy_then_break(seed: int = 3) -> tuple[list[int], list[int], int]:
    """A prompt holding a 150-token source; an answer that writes 4 new tokens, copies 70 tokens
    of the source, then goes on copying it with every third token replaced (an edit every few
    tokens: the source's continuation is still proposed, right for two tokens at most). Returns
    (prompt, output, where the break is)."""
    rng = np.random.default_rng(seed)
    source, new = words(rng, 150), words(rng, 20)
    edited = [new[k // 3] if k % 3 == 2 else source[70 + k] for k in range(60)]
    return [*words(rng, 10), *source], [*words(rng, 4), *source[:70], *edited], 4 + 70


def decisions(p: Planner, prompt: list[int], output: list[int]) -> list[tuple[int, str | None, int, int]]:
    trace: list[tuple[int, str | None, int, int]] = []
    replay(p, prompt, output, AMD_COST, max_tokens=len(output), trace=trace)
    return trace


def test_a_running_copy_is_drafted_deep() -> None:
    """On the steep curve a 3-token draft is the cheapest per token below 16, and 4 to 7 tokens cost
    more per token than 3: a planner that learns only from the levels it drafted never sees a copy
    run past 3 and stays there (negative control). Comparing the rest of each whole draft's
    proposal with the tokens that follow, it learns the copy runs on and drafts the cheapest
    deep size, 15 (c(16) ~ c(8)), once the copy's savings cover a miss."""
    prompt, output, cut = copy_then_break()
    got = [d for i, _, d, _ in decisions(planner_with_curve(AMD), prompt, output) if i < cut]
    assert max(got) >= 15 and sum(d >= 12 for d in got) >= 2, got
    old = [d for i, _, d, _ in decisions(planner_with_curve(AMD, NoCompletionPlanner), prompt, output) if i < cut]
    assert max(old) <= 2 * FIRST_TRY, old


def test_a_break_is_retreated_from() -> None:
    """After a long clean copy has taught the planner to draft deep, the copy breaks into one with
    an edit every third token: the source's continuation is still proposed and wrong by its third
    token. The planner must retreat within a few deep misses, so that the edited part costs no
    more than the target alone would spend on it. A policy that keeps drafting 15 deep (negative
    control) pays a 16-token pass for every three tokens there."""
    prompt, output, cut = copy_then_break()
    steps = decisions(planner_with_curve(AMD), prompt, output)
    assert max(d for i, _, d, _ in steps if i < cut) >= 15  # it did go deep on the copy
    after = [(d, n) for i, _, d, n in steps if i >= cut]
    alone = (len(output) - cut) * AMD_COST(1)
    assert sum(AMD_COST(d + 1) for d, _ in after) <= alone, after
    assert sum(1 for d, n in after if d > FIRST_TRY and n < d) <= 3, after  # deep misses: a few, then none
    fixed: list[tuple[int, str | None, int, int]] = []
    replay(Always(15), prompt, output, AMD_COST, max_tokens=len(output), trace=fixed)
    assert sum(AMD_COST(d + 1) for i, _, d, _ in fixed if i >= cut) > 1.5 * alone


def planner_with_curve(curve: dict[int, float], kind: type[Planner] = Planner) -> Planner:
    """A cold planner (no acceptance learned) that knows the whole cost curve."""
    return kind(planners.ReplayTarget(), GenerationConfig().shape, profiles=Profiles.in_memory(),
                profile=planners.fresh_profile(curve, 0.3 * curve[1], True))


def test_a_population_policy_knows_only_the_prompts_it_was_fitted_on() -> None:
    """Leave one out, a prompt's policy comes from the others: another long copy teaches it to
    draft its own copy; text with no repeats (negative control) teaches nothing, so it drafts
    nothing and runs at the target alone's speed. Fitted on the whole set, it never beats each
    answer's own best policy by more than coordinate descent's slack."""
    rng = np.random.default_rng(2)
    copy, other_copy, plain = copy_case(0), copy_case(1), (words(rng, 50), words(rng, 60))
    taught = policies.population_speedups({"copy": copy, "other": other_copy}, COST, 200, leave_one_out=True)
    assert taught["copy"] > 1.5 and taught["other"] > 1.5
    untaught = policies.population_speedups({"copy": copy, "plain": plain}, COST, 200, leave_one_out=True)
    assert untaught["copy"] == pytest.approx(1.0) and untaught["plain"] == pytest.approx(1.0)
    fitted = policies.population_speedups({"copy": copy, "plain": plain}, COST, 200, leave_one_out=False)
    assert fitted["copy"] > 1.5 and fitted["plain"] == pytest.approx(1.0)
    assert fitted["copy"] <= policies.hindsight(*copy, COST, 200) + 1e-9


def test_a_replayed_proposal_ends_where_the_answer_ended() -> None:
    """An answer that stopped before the token limit ended at an end-of-generation token (its
    last): the replay's proposals stop there, as the engine's do; one cut at the limit shows no
    end token, so nothing is cut."""
    prompt = [10, 11, 12, 13, 14, 2, 3, 4]
    output = [10, 11, 12, 13, 14, 2]
    assert answer_lookup(output, 128).propose(prompt + output[:3], 6).tokens == (13, 14, 2)
    assert answer_lookup(output, len(output)).propose(prompt + output[:3], 6).tokens[:5] == (13, 14, 2, 3, 4)
