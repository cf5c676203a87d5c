"""The cost-aware planner and the cost profiles: the cost model's arithmetic, its decisions in
known regimes, learning from real steps, and profiles that persist between processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from localspec.settings.shape import Shape
from localspec.llama.model import Model
from localspec.decoding.acceptance import FIRST_TRY, Acceptance
from localspec.decoding.costs import CostTable
from localspec.decoding.planner import LOSS_ALLOWANCE, SAMPLED, Planner
from localspec.decoding.profiles import Profile, Profiles
from localspec.llama.host import identity, key_of


def test_cost_table_interpolates_a_line() -> None:
    t = CostTable()
    t.observe(1, 0.033)
    t.observe(5, 0.105)
    assert t(1) == 0.033
    assert t(3) == pytest.approx(0.069)
    assert t(9) == pytest.approx(0.105 + 4 * 0.5 * 0.033)  # beyond: UNMEASURED_SLOPE·c(1) a token, no prefill rate
    assert CostTable({5: 0.105, 3: 0.069})(9) == pytest.approx(0.177)  # without c(1): the line


def test_cost_table_follows_a_kinked_curve() -> None:
    """Measured CPU costs are not a line (a batch of 16 costs about what 9 cost): unmeasured sizes
    come from their neighbours, not from a least-squares line through all of them."""
    t = CostTable({1: 0.040, 7: 0.175, 9: 0.350, 16: 0.343})
    assert t(8) == pytest.approx(0.2625)
    assert t(12) == pytest.approx(0.350 - 0.007 * 3 / 7)
    assert CostTable({7: 0.175, 9: 0.350, 16: 0.343})(32) == pytest.approx(0.343)  # the falling last segment,
    # without c(1) or a prefill rate, is floored at c(16)
    with_prefill = CostTable(dict(t.seconds), lambda: 0.010)
    assert with_prefill(32) == pytest.approx(0.343 + 16 * 0.010)  # beyond: a prefill's cost per token
    assert t(4) == pytest.approx(0.040 + 0.135 * 3 / 6)
    below = CostTable({2: 0.06, 4: 0.10})
    assert below(1) == pytest.approx(0.04)
    assert CostTable({4: 0.1, 8: 0.3})(1) == pytest.approx(0.025)  # the line would go negative: per token


def test_an_unmeasured_size_is_estimated_optimistically_from_the_prefill_rate() -> None:
    """With c(1) alone, a pass of n tokens is first taken at c(1) + (n - 1) x the prefill's cost per
    token (a lower bound of any batch's rate), so it gets tried and measured once."""
    t = CostTable({1: 0.034}, prefill=lambda: 0.010)
    assert t(9) == pytest.approx(0.034 + 8 * 0.010)
    assert CostTable({1: 0.034})(3) == pytest.approx(0.034 * 2)  # no prefill rate: UNMEASURED_SLOPE 0.5


def test_passes_beyond_the_measured_ones_are_priced_optimistically() -> None:
    """Measured up to 4 tokens (a steep start, ~0.9 c(1) per token), a pass of 16 is priced at c(4)
    plus a prefill's cost per further token, not along the steep line; a prefill rate as dear as
    c(1) (recorded under load, kept because later prompts came from the prompt cache) is forgotten
    and UNMEASURED_SLOPE·c(1) per token used instead."""
    start = {1: 0.036, 2: 0.064, 3: 0.096, 4: 0.126}
    t = CostTable(dict(start), lambda: 0.011)
    assert t(16) == pytest.approx(0.126 + 12 * 0.011)
    stale = CostTable(dict(start), lambda: 0.040)
    assert stale.prefill_rate() is None
    assert stale(16) == pytest.approx(0.126 + 12 * 0.5 * 0.036)


def test_the_prefill_rate_moves_with_c1_until_a_prefill_is_measured() -> None:
    """Like the recorded pass sizes, a recorded prefill rate follows c(1): recorded while c(1) was
    0.060, it halves when c(1) does, and is written back at today's level; once a prefill is
    measured in this run it keeps its measurement."""
    profile = Profile("t", {})
    profile.costs, profile.prefill = {1: 0.060, 16: 0.40}, 0.020
    p = Planner(SimpleNamespace(file_bytes=1), Shape.chain(8), profiles=Profiles.in_memory(), profile=profile)
    for _ in range(60):
        p.target_cost.observe(1, 0.030)
    assert p.target_cost.prefill_rate() == pytest.approx(0.010, rel=1e-3)
    p.record()
    assert profile.prefill == pytest.approx(0.010, rel=1e-3) and p.target_cost.prefill_scale == 1.0
    p.observe_prefill(profile, 64, 64 * 0.012)  # a measured prefill: mixed in at today's level
    assert profile.prefill == pytest.approx(0.8 * 0.010 + 0.2 * 0.012, rel=1e-3)
    p.target_cost.observe(1, 0.020)  # measured now, it no longer follows c(1)
    assert p.target_cost.prefill_rate() == pytest.approx(profile.prefill)


class LineBeyond(CostTable):
    """The earlier rule (negative control): beyond the largest measured size, the line through the
    two largest."""

    def __call__(self, n: int) -> float:
        sizes = sorted(self.seconds)
        if n <= sizes[-1]:
            return super().__call__(n)
        lo, hi = sizes[-2], sizes[-1]
        return self.seconds[hi] + (self.seconds[hi] - self.seconds[lo]) * (n - hi) / (hi - lo)


def test_a_curve_measured_only_up_to_4_tokens_does_not_keep_drafts_shallow() -> None:
    """Where the prompt cache left no prefill to measure c(16), a profile knows c(1..4) only (this
    host's curve is steep up to 8 tokens and flat from 8 to 16). A kind that is always right then
    reaches 15-token drafts once the generation has saved what a miss would cost. Negative
    control: priced along the line through the two largest measured sizes, each deeper try
    measures a steep size, the line stays steep, and drafts stay at 4 (over 15 % slower)."""
    start = {1: 0.036, 2: 0.064, 3: 0.096, 4: 0.126}
    true = CostTable({**start, 6: 0.155, 8: 0.263, 12: 0.308, 16: 0.292, 24: 0.428, 32: 0.446})  # this host's, measured

    def depths(table: CostTable) -> list[int]:  # the depths of a 128-token generation that copies throughout
        p = planner_with(start, Shape.chain(32), "ngram:m16+/copying", alpha_runs=100, accepted=20, depth=20)
        p.target_cost = table
        p.begin(remaining=128)
        out: list[int] = []
        while sum(d + 1 for d in out) < 128:
            d = p.choose(FREE, "ngram:m16+/copying", 15)[0]
            out.append(d)
            p.observe("ngram:m16+/copying", d, d, d + 1, true(d + 1))
        return out

    def seconds(depths: list[int]) -> float:
        return sum(true(d + 1) for d in depths)

    optimistic, line = depths(CostTable(dict(start), lambda: 0.011)), depths(LineBeyond(dict(start), lambda: 0.011))
    assert optimistic[-1] == 15 and max(line[-5:]) <= 4, (optimistic, line)  # the line rule stays shallow
    assert seconds(optimistic) < 0.85 * seconds(line)


def test_costs_recorded_under_load_are_forgotten_and_measured_again() -> None:
    """A run under heavy load recorded c(n) seconds-long; c(1) has recovered since. The planner
    forgets the sizes that cost more than 1.5·n·c(1) (one pass of n never costs more than n of
    one), so the prompt prefill measures c(16) again and drafts are priced by fresh costs."""
    profile = Profile("t", {})
    profile.costs = {1: 0.042, 2: 3.07, 4: 0.11, 16: 3.18, 32: 4.0}
    p = Planner(SimpleNamespace(file_bytes=1), Shape.chain(8), profiles=Profiles.in_memory(), profile=profile)
    assert p.target_cost.seconds == {1: 0.042, 4: 0.11}
    assert p.sizes_to_measure(64) == [16]
    sane = Profile("t", {})  # control: a plausible curve is kept whole
    sane.costs = {1: 0.042, 2: 0.07, 4: 0.11, 16: 0.29, 32: 0.5}
    kept = Planner(SimpleNamespace(file_bytes=1), Shape.chain(8), profiles=Profiles.in_memory(), profile=sane)
    assert kept.target_cost.seconds == sane.costs and kept.sizes_to_measure(64) == []


def test_a_new_c1_moves_the_recorded_curve_with_it() -> None:
    """A curve recorded while the machine was busier: c(1) recovers at the first steps, and the
    recorded sizes (measured only by drafts of that size) follow it, keeping the curve's shape.
    A size measured in this run keeps its measurement (negative control: c(16), timed by the
    prompt's prefill at today's speed, is not moved), and a pass of another size moves only its
    own point."""
    t = CostTable({1: 0.050, 4: 0.150, 8: 0.300})
    t.observe(16, 0.200)  # the prefill's measured chunk
    for _ in range(30):
        t.observe(1, 0.030)
    assert t(1) == pytest.approx(0.030, rel=1e-3)
    assert t(4) / t(1) == pytest.approx(3.0) and t(8) / t(1) == pytest.approx(6.0)
    assert t(16) == pytest.approx(0.200)
    t.observe(4, 0.120)
    assert t(1) == pytest.approx(0.030, rel=1e-3) and t(8) / t(1) == pytest.approx(6.0)


def test_acceptance_per_level_and_decay() -> None:
    a = Acceptance(prior=0.25)
    assert a.alpha == pytest.approx(0.75)  # the prior: a level is passed 3 times in 4
    assert a.expected(2, optimism=0) == pytest.approx(1 + 0.75 + 0.75 ** 2)
    for _ in range(300):
        a.observe(1, 4)  # the first draft token accepted, the second rejected, every time
    assert a.hazard(0) < 0.02 and a.hazard(1) > 0.95  # per level: not one rate for all
    assert a.expected(4, optimism=0) == pytest.approx(2.0, abs=0.05)
    assert a.expected(4, optimism=1) >= a.expected(4, optimism=0)  # the optimistic bound is above
    for _ in range(3000):
        a.decay()
    assert a.alpha == pytest.approx(0.75, abs=0.01)  # back to the prior: worth probing again


def test_runs_that_end_at_an_edit_are_not_a_geometric_length() -> None:
    """Copies accepted 10 tokens at a time (then an edit): deep drafts pay where a single
    per-token rate (0.9 here) would predict 1/(1 - 0.9) = 10 tokens at most and decline depth 10."""
    a = Acceptance()
    for _ in range(200):
        a.observe(10, 16)
    assert a.expected(10, optimism=0) == pytest.approx(11.0, abs=0.3)
    assert (1 - 0.9 ** 11) / (1 - 0.9) < 7  # the geometric model's E[tokens] for 10 drafts at α = 0.9


# ---------------------------------------------------------------- decisions

CPU = {1: 0.033, 2: 0.051, 4: 0.092, 5: 0.105, 8: 0.172, 9: 0.185}  # docs/design.md: the 1.5B target, 2 cores
FREE = SimpleNamespace(source=None, loaded=True)  # an n-gram drafter


def planner_with(target_costs: dict[int, float], shape: Shape, kind: str, alpha_runs: int, accepted: int,
                 depth: int) -> Planner:
    p = Planner.__new__(Planner)
    p.shape = shape
    p.sampled = False
    p._nodes = [shape.truncated(d).n_nodes for d in range(shape.depth + 1)]
    p.target_bytes = 1_117_320_768
    p.profiles = Profiles.in_memory()
    p.profile = Profile(f"t{id(shape)}", {})
    p.target_cost = CostTable(dict(target_costs))
    p._acceptance = {}
    p._draft_costs = {}
    p._censored = []
    p.saved = None  # no generation started: deep drafts are not held to savings
    for _ in range(alpha_runs):
        p.acceptance(kind).observe(accepted, depth)
    return p


def model_drafter(planner: Planner, level_seconds: float | None, tmp_path: Path,
                  loaded: bool = True) -> SimpleNamespace:
    path = tmp_path / "draft.gguf"
    path.write_bytes(b"GGUF")
    source = SimpleNamespace(identity={"draft": str(path), "level": level_seconds}, file_bytes=491_400_064)
    if level_seconds is not None:
        planner.profile_of(source).costs[1] = level_seconds
    return SimpleNamespace(source=source, loaded=loaded, kind="model")


def test_planner_declines_a_model_drafter_that_cannot_pay(tmp_path: Path) -> None:
    """The CPU numbers: a 21 ms draft level against a 33 ms target step loses even at 91 %
    acceptance, so the planner decodes with the target alone, and would not even load it."""
    p = planner_with(CPU, Shape.chain(4), "model:x", alpha_runs=100, accepted=4, depth=4)  # α ≈ 1
    drafter = model_drafter(p, 0.021, tmp_path)
    assert p.acceptance("model:x").expected(4, optimism=0) > 4.5
    assert p.choose(drafter, "model:x", 4)[0] == 0
    (tmp_path / "u").mkdir()
    unloaded = model_drafter(p, None, tmp_path / "u", loaded=False)
    assert not p.worth_loading(unloaded, prompt_tokens=30, remaining=200)  # size prior: 44 % of a step


def test_planner_uses_a_model_drafter_where_verification_is_cheap(tmp_path: Path) -> None:
    gpu = {1: 0.0023, 2: 0.0025, 4: 0.0030, 5: 0.0033, 8: 0.0037, 9: 0.0047}  # flat: a GPU
    p = planner_with(gpu, Shape.chain(8), "model:x", alpha_runs=200, accepted=8, depth=8)
    drafter = model_drafter(p, 0.00012, tmp_path)
    assert p.choose(drafter, "model:x", 8)[0] >= 4
    bad = planner_with(gpu, Shape.chain(8), "model:x", alpha_runs=200, accepted=0, depth=8)  # never accepted
    bad.profiles = p.profiles
    assert bad.choose(drafter, "model:x", 8)[0] == 0


def test_a_draft_models_catch_up_counts() -> None:
    """A draft that has not seen the last m tokens must decode them first: with a long lag the same
    draft stops paying."""
    gpu = {1: 0.0023, 2: 0.0025, 4: 0.0030, 5: 0.0033}
    p = planner_with(gpu, Shape.chain(4), "model:y", alpha_runs=200, accepted=4, depth=4)
    source = SimpleNamespace(identity={"lag-test": 1}, file_bytes=1)
    profile = p.profile_of(source)
    profile.costs[1], profile.prefill = 0.0002, 0.0001
    drafter = SimpleNamespace(source=source, loaded=True)
    assert p.choose(drafter, "model:y", 4, lag=0)[0] == 4
    assert p.choose(drafter, "model:y", 4, lag=200)[0] == 0  # 20 ms of catch-up: the target alone wins


def test_free_drafts_follow_their_measured_acceptance() -> None:
    p = planner_with(CPU, Shape.chain(8), "ngram:m16+", alpha_runs=100, accepted=8, depth=8)
    assert p.choose(FREE, "ngram:m16+", 8)[0] == 8  # always right: draft as deep as offered
    poor = planner_with(CPU, Shape.chain(8), "ngram:m1", alpha_runs=100, accepted=0, depth=4)
    assert poor.choose(FREE, "ngram:m1", 8)[0] == 0  # always wrong: not even a probe
    unknown = planner_with(CPU, Shape.chain(8), "ngram:m16+/copying", alpha_runs=0, accepted=0, depth=1)
    assert unknown.choose(FREE, "ngram:m16+/copying", 8)[0] >= 1  # no evidence: a long copy's prior tries it
    chance = planner_with(CPU, Shape.chain(8), "ngram:m1", alpha_runs=0, accepted=0, depth=1)
    assert chance.choose(FREE, "ngram:m1", 8)[0] == 0  # ... a one-token chance match's does not
    assert p.choose(FREE, "ngram:m16+", 8)[0] > 0 and planner_with({}, Shape.chain(8), "k", 0, 0, 1).choose(
        FREE, "k", 8)[0] == 0  # c(1) unknown: this step measures it


def test_a_kind_never_seen_is_first_tried_short_and_deepens_as_it_is_accepted() -> None:
    """Exploration is cheap: a first try is FIRST_TRY deep however long the proposal and however
    hopeful the prior, then twice as deep as drafts of that kind have been seen to reach; a try
    that fails at once earns nothing deeper."""
    flat = {1: 0.030, 2: 0.031, 4: 0.032, 16: 0.035, 33: 0.040}  # deep drafts nearly free: depth is tempting
    p = planner_with(flat, Shape.chain(32), "ngram:m16+/copying", alpha_runs=0, accepted=0, depth=1)
    acc = p.acceptance("ngram:m16+/copying")
    assert p.choose(FREE, "ngram:m16+/copying", 32)[0] == FIRST_TRY
    acc.observe(0, FIRST_TRY)  # rejected at once: levels beyond 0 not reached
    assert p.choose(FREE, "ngram:m16+/copying", 32)[0] <= FIRST_TRY
    depths = []
    for _ in range(4):
        d = p.choose(FREE, "ngram:m16+/copying", 32)[0]
        depths.append(d)
        acc.observe(d, d)  # all accepted
    assert depths == [3, 6, 12, 24]
    assert p.choose(FREE, "ngram:m16+/copying", 32)[0] == 32  # explored past the last tracked level: no cap


# ---------------------------------------------------------------- learning and persistence


def test_auto_plan_learns_costs_from_real_steps(tiny_target: Model, tiny_draft: Model, tmp_path: Path) -> None:
    """A generation's planner refines the profiles it was given; their owner saves them (the
    engine writes nothing)."""
    from localspec.api import Generation
    from localspec.settings.generation import GenerationConfig

    store = Profiles(tmp_path)
    before = dict(store.get(tiny_target.identity).costs)
    config = GenerationConfig.from_options(max_tokens=30, temperature=0, drafter="hybrid", num_draft_tokens=4)
    out = list(Generation(tiny_target, tiny_draft, "def add(a, b): return a + b. def add(a, b):", config, store))
    assert out[-1].finish_reason in ("length", "stop")
    costs = store.get(tiny_target.identity).costs
    assert 1 in costs and all(v > 0 for v in costs.values()) and len(costs) >= len(before)
    assert not list(tmp_path.glob("*.json"))  # given profiles are saved by their owner, not the generation
    store.save()
    assert Profiles(tmp_path).get(tiny_target.identity).costs == costs


def test_profiles_persist_atomically_and_reset(tmp_path: Path) -> None:
    store = Profiles(tmp_path / "profiles")
    ident = {"file": "/x/model.gguf", "threads": 2}
    p = store.get(ident)
    p.costs.update({1: 0.03, 5: 0.1})
    at_risk, rejected = p.levels("ngram:m16+", 4)
    at_risk[:] = [500.0, 400.0, 300.0, 0.0]
    rejected[0] = 10.0
    p.dirty = True
    store.save()
    files = list((tmp_path / "profiles").glob("*.json"))
    assert [f.stem for f in files] == [key_of(ident)]
    again = Profiles(tmp_path / "profiles").get(ident)
    assert again.costs == {1: 0.03, 5: 0.1}
    assert again.acceptance["ngram:m16+"][0] == pytest.approx([100.0, 80.0, 60.0, 0.0])  # capped: it keeps adapting
    assert again.acceptance["ngram:m16+"][1][0] == pytest.approx(2.0)
    (tmp_path / "profiles" / "broken.json").write_text("{not json")
    assert [q.key for q in Profiles(tmp_path / "profiles").on_disk()] == [key_of(ident)]  # unreadable: skipped
    assert store.reset() == 1  # the profile; broken.json is no profile localspec wrote: it stays
    assert [f.name for f in (tmp_path / "profiles").glob("*.json")] == ["broken.json"]


def test_identity_changes_with_what_changes_speed(tiny_paths: tuple[Path, Path]) -> None:
    from localspec.settings.models import ModelOptions

    base = identity(tiny_paths[0], ModelOptions(threads=1))
    assert key_of(base) == key_of(identity(tiny_paths[0], ModelOptions(threads=1)))
    for other in (ModelOptions(threads=2), ModelOptions(threads=1, cache_type="f32"),
                  ModelOptions(threads=1, n_gpu_layers=-1), ModelOptions(threads=1, load_mode="mmap")):
        assert key_of(identity(tiny_paths[0], other)) != key_of(base)
    assert key_of(identity(tiny_paths[1], ModelOptions(threads=1))) != key_of(base)
    assert "llama_cpp" in base and "build" in base and "cpu" in base


def test_a_second_process_starts_from_the_profile(tiny_paths: tuple[Path, Path], tmp_path: Path) -> None:
    """The first run learns step costs and acceptance; they are on disk for the next process,
    and `localspec profiles` lists and resets them."""
    env = {"LOCALSPEC_PROFILE_DIR": str(tmp_path)}
    args = [sys.executable, "-m", "localspec", "-m", str(tiny_paths[0]), "-d", "none", "--threads", "1",
            "--raw", "-t", "0", "-n", "24", "def add(a, b): return a + b. def add(a, b): return"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=120, env={**_env(), **env})
    assert first.returncode == 0, first.stderr
    saved = [json.loads(f.read_text()) for f in tmp_path.glob("*.json")]
    assert len(saved) == 1 and saved[0]["costs"]["1"] > 0
    assert any(k.startswith("ngram:") for k in saved[0]["acceptance"])
    shown = subprocess.run([sys.executable, "-m", "localspec", "profiles", "list"], capture_output=True,
                           text=True, timeout=60, env={**_env(), **env})
    assert shown.returncode == 0 and tiny_paths[0].name in shown.stdout and "c(1)" in shown.stdout
    reset = subprocess.run([sys.executable, "-m", "localspec", "profiles", "reset"], capture_output=True,
                           text=True, timeout=60, env={**_env(), **env})
    assert reset.returncode == 0 and "removed 1" in reset.stdout and not list(tmp_path.glob("*.json"))


def _env() -> dict:
    import os

    return dict(os.environ)


def test_sampled_and_greedy_acceptance_are_kept_apart(tiny_target) -> None:
    """A sampled target accepts fewer copies: its counts go to their own profile entry, so a
    greedy run's evidence does not make a sampled run draft (and the reverse)."""
    store = Profiles.in_memory()
    greedy = Planner(tiny_target, Shape.chain(4), profiles=store)
    sampled = Planner(tiny_target, Shape.chain(4), sampled=True, profiles=store)
    greedy.acceptance("ngram:apart").observe(4, 4)
    sampled.acceptance("ngram:apart").observe(0, 4)
    greedy.record()
    sampled.record()
    levels = store.get(tiny_target.identity).acceptance
    assert levels["ngram:apart"][1][0] == 0.0 and levels["ngram:apart" + SAMPLED][1][0] == 1.0
    assert greedy.acceptance("ngram:apart").hazard(0) < sampled.acceptance("ngram:apart").hazard(0)


@pytest.mark.parametrize("body", [
    '{"version": 2, "key": "k", "identity": {}, "costs": [1, 2]}',  # a list where a mapping belongs
    '{"version": 2, "key": "k", "identity": {}, "costs": {"x": 1}}',  # a size that is no number
    '{"version": 2, "key": "k", "identity": {}, "acceptance": {"ngram": [1, 2, 3]}}',
    '{"version": 2, "key": "k", "identity": [], "checks": {}}',
    '{"version": 2}', '[1, 2]', '"text"', '{"version": 2, "key": "k", "identity": {}, "updated": "soon"}',
    '{"version": 2, "key": "k", "identity": {}, "acceptance": {"ngram": [["a"], [1]]}}',
])
def test_a_profile_of_the_wrong_shape_is_ignored_with_a_warning(tmp_path: Path, body: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from localspec.decoding.profiles import Profiles
    from localspec.llama.host import key_of

    ident = {"file": "m.gguf"}
    (tmp_path / f"{key_of(ident)}.json").write_text(body)
    with caplog.at_level("WARNING", logger="localspec.decoding.profiles"):
        profile = Profiles(tmp_path).get(ident)
    assert profile.costs == {} and profile.acceptance == {}  # measured again
    assert any("ignoring the unreadable cost profile" in r.getMessage() for r in caplog.records)


def test_a_whole_draft_shorter_than_its_proposal_is_counted_as_far_as_the_output_goes() -> None:
    """A 2-token draft of a 6-token proposal, accepted whole: levels 0 and 1 count at once, the
    extra token decides level 2, the next step's tokens levels 3 and 4 (wrong at 4: rejected
    there). Without the proposal (negative control) only the drafted levels count."""
    p = planner_with(CPU, Shape.chain(8), "k", 0, 0, 1)
    proposal = (11, 12, 13, 14, 15, 16)
    p.observe("k", 2, 2, 3, 0.05, proposal, [11, 12, 13])
    acc = p.acceptance("k")
    assert acc.at_risk[:4] == [1.0, 1.0, 1.0, 0.0] and not any(acc.rejected)
    p.observe(None, 0, 0, 1, 0.033, (), [14])
    p.observe(None, 0, 0, 1, 0.033, (), [99])  # the proposal said 15
    near = pytest.approx([1.0] * 5 + [0.0], abs=0.02)  # counts decay by 0.5 % a step
    assert acc.at_risk[:6] == near and acc.rejected[:5] == pytest.approx([0.0] * 4 + [1.0], abs=0.02)
    before = sum(acc.at_risk)
    p.observe(None, 0, 0, 1, 0.033, (), [16])  # settled: nothing more is counted
    assert sum(acc.at_risk) < before
    control = planner_with(CPU, Shape.chain(8), "k", 0, 0, 1)
    control.observe("k", 2, 2, 3, 0.05, (), [11, 12, 13])
    assert control.acceptance("k").at_risk[:3] == [1.0, 1.0, 0.0]


def test_a_deep_draft_waits_until_the_generation_has_saved_its_worst_case() -> None:
    """A kind known to be always right, on a curve where 15-token drafts pay best: at a
    generation's start only FIRST_TRY levels fit the loss allowance; once accepted drafts have
    saved more than a 15-token miss would cost, it drafts 15. Forced tokens (certain) are never
    held back."""
    steep = {1: 0.03, 2: 0.0495, 4: 0.0768, 8: 0.1872, 16: 0.2052}
    p = planner_with(steep, Shape.chain(32), "ngram:m16+/copying", alpha_runs=100, accepted=20, depth=20)
    p.begin(remaining=128)  # allowance: 1 % of 128 tokens at c(1)
    assert p.saved == 0.0 and p.allowance(FIRST_TRY + 1) == pytest.approx(LOSS_ALLOWANCE * 128 * 0.03)
    depths = []
    while len(depths) < 30 and (not depths or depths[-1] < 15):
        d = p.choose(FREE, "ngram:m16+/copying", 15)[0]
        assert d <= FIRST_TRY or p.target_cost(d + 1) - 0.03 <= p.saved + p.allowance(d)  # never more at risk
        depths.append(d)
        p.observe("ngram:m16+/copying", d, d, d + 1, p.target_cost(d + 1))
    assert depths[0] == FIRST_TRY and depths[-1] == 15 and len(depths) > 2, depths
    fresh = planner_with(steep, Shape.chain(32), "forced", alpha_runs=0, accepted=0, depth=1)
    fresh.begin(remaining=128)
    assert fresh.choose(FREE, "forced", 15)[0] == 15


def test_drafts_that_are_rejected_stop_within_the_floor() -> None:
    """A profile that learned high acceptance elsewhere (a verbatim copy) meets a prompt where
    every draft is rejected: the generation stops drafting once its drafts have lost FLOOR of its
    length at c(1), whatever the profile says (never below 1 - FLOOR of the target alone).
    Negative control: with no generation begun (nothing held to the floor) it drafts on."""
    from localspec.decoding.planner import FLOOR

    steep = {1: 0.03, 2: 0.0495, 4: 0.0768, 8: 0.1872, 16: 0.2052}
    for begun in (True, False):
        p = planner_with(steep, Shape.chain(8), "ngram:m16+/copying", alpha_runs=100, accepted=8, depth=8)
        if begun:
            p.begin(remaining=128)
        lost, drafted = 0.0, 0
        for _ in range(128):
            d = p.choose(FREE, "ngram:m16+/copying", 8)[0]
            if d == 0:
                p.observe(None, 0, 0, 1, 0.03)
                continue
            drafted += 1
            lost += p.target_cost(d + 1) - 0.03
            p.observe("ngram:m16+/copying", d, 0, d + 1, p.target_cost(d + 1))  # rejected at once
        if begun:
            assert lost <= FLOOR * 128 * 0.03 + p.target_cost(9) and drafted < 20, (lost, drafted)
        else:
            assert lost > FLOOR * 128 * 0.03 * 2, (lost, drafted)


def test_one_pass_slowed_by_other_work_moves_no_cost() -> None:
    """A size's cost is the median of its recent passes: one pass timed while the cores were
    busy leaves it where it was. Negative control: the mean would have moved by a third."""
    table = CostTable({1: 0.03})
    for secs in (0.031, 0.029, 0.030, 0.300):
        table.observe(1, secs)
    assert table(1) == pytest.approx(0.030)
    assert (0.03 + 0.031 + 0.029 + 0.030 + 0.300) / 5 > 1.3 * table(1)


def test_a_curve_recorded_under_load_is_thrown_out_and_said() -> None:
    """A pass never costs more than n single passes, nor more than a longer pass (the AVX2 host's
    profile learned beside other work: c(4) = 395 ms beside c(16) = 184 ms): such sizes are
    measured again, and `profiles list` says so. A curve that only wobbles within the slack stays."""
    from localspec.cli.profiles import describe
    from localspec.decoding.costs import implausible_costs, plausible_costs

    busy = {1: 0.085, 2: 0.14, 4: 0.395, 16: 0.184}
    assert set(implausible_costs(busy)) == {4} and 4 not in plausible_costs(busy)
    assert implausible_costs({1: 0.034, 2: 0.033, 4: 0.096, 16: 0.27}) == {}  # equal within noise: kept
    assert set(implausible_costs({1: 0.01, 16: 0.5})) == {16}  # more than 1.5·16·c(1)
    profile = Profile("k", {"file": "/m/target.gguf"}, costs=busy)
    assert any("thrown out" in line and "c(4) = 395.0 ms" in line and "c(16)" in line for line in describe(profile))


def test_a_decode_off_the_cpu_teaches_no_cost() -> None:
    from localspec.decoding.passes import ON_CPU, Decoded

    assert Decoded(4, 0.1, cpu_share=0.95).timed == 0.1
    assert Decoded(4, 0.1, cpu_share=ON_CPU / 2).timed is None  # the cores were taken by other work
    assert Decoded(4, 0.1, cpu_share=None).timed == 0.1  # not known (a GPU): kept
