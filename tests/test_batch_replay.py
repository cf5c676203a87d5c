"""The batch replay (benchmarks/replay/batch.py) on made-up token sequences, without a model: one
call at a time it is the single-answer replay; on a flat cost curve K calls in lockstep cost what
the longest costs alone; on a steep CPU-like curve the planner drafts less with four calls in the
pass than alone, and the planner told it is alone (negative control) drafts and loses there; on a
flat curve it drafts in a batch as each call does alone. The planner is driven as the engine and
the scheduler drive it (pick(..., batch=), offer(...), observe_step(..., pass_tokens=), finish)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from localspec.decoding.costs import CostTable
from localspec.decoding.profiles import Profile

from benchmarks.common.prompts import REPLAY_PROMPTS
from benchmarks.replay import batch, planners
from benchmarks.replay.batch import BatchReplay, replay_batch
from benchmarks.replay.steps import replay

from replay_rules import Always

AMD = {n: 0.03 * r for n, r in {1: 1.0, 2: 1.65, 4: 2.56, 8: 6.24, 16: 6.84}.items()}  # a steep CPU curve
PREFILL = 0.3 * 0.03
AMD_COST = CostTable(dict(AMD), lambda: PREFILL)
FLAT = {1: 0.03, 128: 0.03}  # c(n) = c(1) up to 128 tokens (4 calls drafting 31 deep): batching is free
FLAT_COST = CostTable(dict(FLAT), lambda: PREFILL)


def words(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(1000, 1_000_000, size=n)]  # no token repeats by chance


def copy_case(seed: int, copied: int = 100) -> tuple[list[int], list[int]]:
    """An answer that writes 6 new tokens, copies `copied` tokens of the prompt, then 10 new ones."""
    rng = np.random.default_rng(seed)
    source = words(rng, copied)
    return [*words(rng, 20), *source, *words(rng, 5)], [*words(rng, 6), *source, *words(rng, 10)]


def free_case(seed: int, length: int = 120) -> tuple[list[int], list[int]]:
    """Free text: runs of 3-9 new tokens, each followed by a short phrase (4-8 tokens) repeated
    from the prompt or the answer so far, as prose repeats names and phrases."""
    rng = np.random.default_rng(seed)
    prompt, out = words(rng, 40), []
    while len(out) < length:
        out += words(rng, int(rng.integers(3, 10)))
        context = prompt + out
        start = int(rng.integers(0, len(context) - 8))
        out += context[start:start + int(rng.integers(4, 9))]
    return prompt, out[:length]


def planner(curve: dict[int, float], blind: bool = False) -> batch.MakePolicy:
    """A new planner for each call that knows the whole curve (`blind`: told batch = 0 always)."""
    return lambda: planners.planner_for(planners.fresh_profile(curve, PREFILL, True), batch_blind=blind)


def fixed(rule: dict[str, int]) -> batch.MakePolicy:
    return lambda: rule


def drafted_per_step(run: BatchReplay) -> float:
    return run.drafted / run.steps


# ---------------------------------------------------------------- one call at a time

def test_one_call_at_a_time_is_the_single_answer_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 1: every answer's steps, drafts and target time equal the single-answer replay's, for
    the planner (cold and warm), the batch-blind one and a fixed rule. Negative control: a slot
    told of one phantom root in its pass (the turn off by one) prices its drafts differently and
    no longer replays the same."""
    answers = [copy_case(0), free_case(1), copy_case(2, copied=40), free_case(3)]
    warm = planners.warm_profile(dict(enumerate(answers)), AMD, PREFILL, AMD_COST, 200, 1, shadow=False)
    makers = {"cold": lambda: planners.planner_for(planners.fresh_profile(AMD, PREFILL, False)),
              "warm": lambda: planners.planner_for(Profile.from_json(warm.to_json())),
              "blind": planner(AMD, blind=True), "fixed": lambda: Always(3)}
    for name, make in makers.items():
        alone = [replay(make(), *a, AMD_COST, 200) for a in answers]
        got = replay_batch(make, answers, 1, AMD_COST, 200)
        assert list(got.answers) == alone, name
        assert got.seconds == pytest.approx(sum(a.seconds for a in alone)) and got.rounds == sum(a.steps for a in alone)
        assert got.tokens == sum(len(a[1]) for a in answers)
    assert sum(a.drafted for a in replay_batch(makers["cold"], answers, 1, AMD_COST, 200).answers) > 50  # it drafts
    monkeypatch.setattr(batch, "turn_batch", lambda planned, later: planned + later + 1)
    off = replay_batch(makers["cold"], answers, 1, AMD_COST, 200)
    assert list(off.answers) != [replay(makers["cold"](), *a, AMD_COST, 200) for a in answers]


def test_the_table_row_of_one_call_is_the_single_answer_replays(tmp_path: Path, capsys) -> None:
    """The command's K = 1 row: the planner's aggregate speed is the single-answer replays' (their
    tokens over their summed target time), cold and warm, on answers read from a recorded file."""
    names = ("code", "code-edit")
    answers = {"code": free_case(5), "code-edit": copy_case(6)}
    store = {n: {"text": REPLAY_PROMPTS[n], "prompt": answers[n][0], "output": answers[n][1]} for n in names}
    path = tmp_path / "answers.json"
    path.write_text(json.dumps({"model": "made-up", "bytes": 1, "tokens": 128, "answers": store}))
    assert batch.main(["--answers", str(path), "--prompts", ",".join(names), "--curve", "amd", "--clients", "1,2",
                       "--warm-rounds", "1"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| every prompt")]
    assert [row[1] for row in rows] == ["1", "2"]
    curve = batch.curve_option("amd")
    cost, prices, prefill = curve.cost(), curve.seconds(), 0.03 * curve.prefill
    cold = [replay(planners.planner_for(planners.fresh_profile(prices, prefill, False)), *answers[n], cost, 128)
            for n in names]
    warm_profile = planners.warm_profile(answers, prices, prefill, cost, 128, 1, shadow=False)
    warm = [replay(planners.planner_for(Profile.from_json(warm_profile.to_json())), *answers[n], cost, 128)
            for n in names]
    tokens = sum(len(a[1]) for a in answers.values())
    for column, runs in ((4, cold), (5, warm)):
        assert float(rows[0][column]) == pytest.approx(tokens * cost(1) / sum(r.seconds for r in runs), abs=0.005)


# ---------------------------------------------------------------- a flat curve: batching is free

def test_on_a_flat_curve_calls_at_once_cost_what_the_longest_costs_alone() -> None:
    """Four calls of different lengths in lockstep, under policies that read no batch (the target
    alone, a fixed rule): every round costs c(1), so the batch costs what its longest call costs
    alone. Negative controls: the same calls one after another cost the sum, and on the steep
    curve the same batch costs more than its longest call."""
    answers = [copy_case(0), free_case(1, 60), copy_case(2, copied=30), free_case(3, 90)]
    for rule in ({}, Always(7)):  # at most 4 x 8 tokens: every pass on the flat part
        make = fixed(rule)
        alone = [replay(rule, *a, FLAT_COST, 200).seconds for a in answers]
        assert replay_batch(make, answers, 4, FLAT_COST, 200).seconds == pytest.approx(max(alone))
        one_by_one = replay_batch(make, answers, 1, FLAT_COST, 200).seconds
        assert one_by_one == pytest.approx(sum(alone)) and one_by_one > 1.5 * max(alone)
        steep = max(replay(rule, *a, AMD_COST, 200).seconds for a in answers)
        assert replay_batch(make, answers, 4, AMD_COST, 200).seconds > 1.5 * steep


def test_on_a_flat_curve_the_planner_drafts_in_a_batch_as_alone() -> None:
    """Where the curve is flat a draft adds nothing to the pass, so four calls at once draft about
    as much as each does alone (at least half as many tokens; alone it drafts the copies and their
    chance matches): the round is planned as a whole (localspec.decoding.batch_plan). The replay's
    own lockstep accounting is checked above with fixed rules."""
    answers = [copy_case(0), free_case(1, 60), copy_case(2, copied=30), free_case(3, 90)]
    make = planner(FLAT)
    alone = sum(replay(make(), *a, FLAT_COST, 200).drafted for a in answers)
    assert alone > 200
    together = replay_batch(make, answers, 4, FLAT_COST, 200)
    assert together.drafted >= alone / 2, (together.drafted, alone)


# ---------------------------------------------------------------- a steep curve: drafts and batching compete

def test_on_a_steep_curve_the_planner_drafts_less_in_a_batch() -> None:
    """On the AMD curve a pass of four roots costs 2.56 c(1), and drafts add to it at up to 0.9
    c(1) a token: with four calls at once the planner drafts less per step than alone on the same
    free text, and loses at most its floor (planner.FLOOR) to the target alone batched. Negative
    control: the planner told it is alone in every pass keeps drafting there and is slower."""
    from localspec.decoding.planner import FLOOR

    answers = [free_case(seed) for seed in range(4)]
    one = replay_batch(planner(AMD), answers, 1, AMD_COST, 200)
    four = replay_batch(planner(AMD), answers, 4, AMD_COST, 200)
    assert drafted_per_step(one) > 0.1 and drafted_per_step(four) < drafted_per_step(one) / 3
    target_alone = replay_batch(lambda: {}, answers, 4, AMD_COST, 200)
    assert batch.speed(four, AMD_COST) >= (1 - FLOOR) * batch.speed(target_alone, AMD_COST)
    blind = replay_batch(planner(AMD, blind=True), answers, 4, AMD_COST, 200)
    assert drafted_per_step(blind) > 2 * drafted_per_step(four) + 0.02
    assert batch.speed(blind, AMD_COST) < 0.98 * batch.speed(four, AMD_COST)


def test_the_best_fixed_rule_is_never_beaten_by_the_rules_it_tried() -> None:
    """The hindsight rule for a set and K is at least as fast as drafting nothing (where it starts)
    and as the rule the lone call's search found; on long copies alone it drafts them."""
    answers = [copy_case(0), copy_case(1)]
    one, rule_one = batch.best_fixed(answers, 1, AMD_COST, 200)
    assert rule_one and batch.speed(one, AMD_COST) > 1.5
    four, rule_four = batch.best_fixed(answers, 4, AMD_COST, 200)
    assert four.seconds <= replay_batch(lambda: {}, answers, 4, AMD_COST, 200).seconds
    assert four.seconds <= replay_batch(lambda: rule_one, answers, 4, AMD_COST, 200).seconds * (1 + 1e-9)


# ---------------------------------------------------------------- the command

def test_calls_are_dealt_round_robin_and_a_small_set_fills_every_slot() -> None:
    assert batch.deal(5, 2) == [[0, 2, 4], [1, 3]]
    assert batch.deal(2, 4) == [[0], [1], [0], [1]]
    assert batch.deal(3, 1) == [[0, 1, 2]]


def test_the_options_are_checked(capsys) -> None:
    args = batch.parse_args(["--answers", "a.json", "--curve", "intel", "--curve", "2:1.5,8:4", "--prefill-rate", "0.2"])
    assert [c.label for c in args.curve] == ["Intel Xeon (AMX), reported", "given"]
    assert args.curve[1].ratios == {1: 1.0, 2: 1.5, 8: 4.0} and {c.prefill for c in args.curve} == {0.2}
    assert [c.label for c in batch.parse_args(["--answers", "a.json"]).curve] == [c[0] for c in batch.CURVES.values()]
    for bad, says in ((["--clients", "0,2"], "--clients"), (["--clients", "9"], "--clients"), (["--curve", "4:5"], "--curve"),
                      (["--prefill-rate", "1.5"], "--prefill-rate"), ([], "--answers")):
        with pytest.raises(SystemExit):
            batch.parse_args(([] if bad == [] else ["--answers", "a.json"]) + bad)
        assert says in capsys.readouterr().err


def test_answers_missing_from_the_file_are_a_clear_error(tmp_path: Path, capsys) -> None:
    path = tmp_path / "answers.json"
    path.write_text(json.dumps({"tokens": 128, "answers": {}}))
    assert batch.main(["--answers", str(path), "--prompts", "code"]) == 2
    assert "planner_replay.py --answers" in capsys.readouterr().err
