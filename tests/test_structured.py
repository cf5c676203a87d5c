"""Constrained generation end to end (localspec.decoding.grammar.steps, the engine, the API) on the
tiny models: outputs that finish match their schema with every verifier and drafter; greedy
speculative output equals the constrained target's own; at T > 0 the output follows the
constrained target's distribution (two-sample chi-square, with negative controls); bad schemas
and grammars are ConfigErrors before anything decodes.

The statistical tests each fail a correct engine with probability ALPHA = 1e-3 over the choice of
seeds (4 positive tests: a false-positive rate below 0.4 % for the module); the seeds are fixed,
so the outcome is deterministic.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import numpy as np
import pytest
from scipy import stats

from localspec.api import Generation, Response, generate, stream_generate
from localspec.settings.constraints import Constraint
from localspec.settings.generation import GenerationConfig
from localspec.decoding.grammar import follower as F
from localspec.decoding.drafters import ModelDrafter
from localspec.decoding.profiles import Profiles
from localspec.errors import ConfigError
from localspec.llama.model import Model
from localspec.prompt import prompt_tokens
from greedy import NEAR_TIE, first_difference, next_token_logits
from masks import mask_logits

PROMPT = "def add(a, b): return a + b"
PERSON = {  # bounded: a random tiny model finishes it within ~60 tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "high"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "ok", "level", "n"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def matches_person(value: Any) -> bool:
    return (isinstance(value, dict) and list(value) == ["name", "tags", "ok", "level", "n"]
            and isinstance(value["name"], str) and 1 <= len(value["name"]) <= 8
            and isinstance(value["tags"], list) and 1 <= len(value["tags"]) <= 2
            and all(isinstance(t, str) and len(t) <= 4 for t in value["tags"])
            and isinstance(value["ok"], bool) and value["level"] in ("low", "high")
            and isinstance(value["n"], int) and not isinstance(value["n"], bool) and 0 <= value["n"] <= 99)


def run(target: Model, draft: Model | None, **kw: Any) -> list[Response]:
    kw.setdefault("profiles", Profiles.in_memory())
    return list(stream_generate(target, draft, PROMPT, **kw))


def text_of(responses: list[Response]) -> str:
    return "".join(r.text for r in responses)


# ---------------------------------------------------------------- outputs match the schema

CONFIGS = [
    dict(verifier="token", drafter="model", num_draft_tokens=4),
    dict(verifier="block", drafter="model", num_draft_tokens=4),
    dict(verifier="block", drafter="ngram", num_draft_tokens=4),
    dict(verifier="block", drafter="hybrid", num_draft_tokens=4),
    dict(verifier="gbv", drafter="model", num_draft_tokens=3, paths=2),
    dict(verifier="traversal", drafter="model", tree="2x2x1"),
    dict(verifier="traversal", drafter="hybrid", tree="2x2"),
]


@pytest.mark.parametrize("plan", ["fixed", "auto"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_finished_outputs_match_the_schema(tiny_target: Model, tiny_draft: Model, config: dict, plan: str) -> None:
    finished = 0
    for seed, temperature in ((1, 0.0), (2, 0.8), (3, 1.0)):
        rs = run(tiny_target, tiny_draft, max_tokens=120, seed=seed, temperature=temperature, plan=plan,
                 response_format=RESPONSE_FORMAT, **config)
        last = rs[-1]
        assert all(r.finish_reason is None for r in rs[:-1]) and last.finish_reason in ("stop", "length")
        assert all(r.constraint_satisfied is None for r in rs[:-1])
        if last.finish_reason == "stop":
            finished += 1
            assert last.constraint_satisfied is True
            value = json.loads(text_of(rs))
            assert matches_person(value), value
            assert text_of(rs) == json.dumps(value, ensure_ascii=False)  # the layout of json.dumps
        else:
            assert last.constraint_satisfied is False  # truncated: never presented as complete
    assert finished >= 2, f"only {finished} of 3 runs finished within 120 tokens"


def test_forced_tokens_are_drafted_and_accepted(tiny_target: Model) -> None:
    """The forced-token drafter proposes the schema's structure; every forced token is accepted."""
    rs = run(tiny_target, None, max_tokens=120, seed=4, temperature=0.9, drafter="ngram", plan="fixed",
             num_draft_tokens=8, response_format=RESPONSE_FORMAT)
    s = rs[-1].stats
    assert rs[-1].finish_reason == "stop" and s.drafted_tokens >= 10
    assert s.block_efficiency > 1.5, s  # keys and separators come several per target pass
    by_kind = dict(s.accepted_by_kind)
    assert by_kind.get("forced", 0) >= 10 and sum(by_kind.values()) == s.accepted_tokens, by_kind
    assert 0 < s.constraint_seconds < s.elapsed_seconds


def test_forced_runs_decode_with_one_logits_row(tiny_target: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forced run asks the target for the last row's logits only (its other rows are certain)
    and its pass is not taken for a verification pass's cost; other passes get every row."""
    from localspec.decoding.planner import Planner

    from localspec.llama.sequence import KVSequence

    decodes: list[tuple[int, str]] = []  # the target passes of steps: (tokens, outputs)
    real = KVSequence.step_part

    def step_part(self: KVSequence, tokens: list[int], *a, outputs: str = "all", **k):  # type: ignore[no-untyped-def]
        if self.model is tiny_target:
            decodes.append((len(tokens), outputs))
        return real(self, tokens, *a, outputs=outputs, **k)

    monkeypatch.setattr(KVSequence, "step_part", step_part)
    costs: list[float | None] = []
    observe = Planner.observe
    monkeypatch.setattr(Planner, "observe", lambda self, *a: costs.append(a[4]) or observe(self, *a))  # target_seconds
    rs = run(tiny_target, None, max_tokens=120, seed=4, temperature=0.0, drafter="ngram",
             num_draft_tokens=8, response_format=RESPONSE_FORMAT)
    assert rs[-1].finish_reason == "stop" and json.loads(text_of(rs))
    last = [n for n, outputs in decodes if outputs == "last"]
    assert last and max(last) > 1, decodes  # forced runs of several tokens, one logits row each
    verifications = [n for n, outputs in decodes if outputs == "all"]
    assert len(costs) - costs.count(None) == len(verifications)  # only verification passes are points of the curve


def test_truncated_output_is_not_complete(tiny_target: Model, tiny_draft: Model) -> None:
    rs = run(tiny_target, tiny_draft, max_tokens=5, seed=1, temperature=0.0, response_format=RESPONSE_FORMAT)
    assert rs[-1].finish_reason == "length" and rs[-1].constraint_satisfied is False
    with pytest.raises(ValueError):
        json.loads(text_of(rs))


def test_regex_and_grammars(tiny_target: Model, tiny_draft: Model) -> None:
    lark = '%llguidance {}\nstart: "def " NAME "():"\nNAME: /[a-z_]{1,6}/'
    gbnf = 'root ::= "def " name "():"\nname ::= [a-z_] [a-z_]? [a-z_]?'
    for kw, pattern in ((dict(regex=r"(yes|no)[0-9]{1,3}"), r"(yes|no)[0-9]{1,3}"),
                        (dict(grammar=lark), r"def [a-z_]{1,6}\(\):"), (dict(grammar=gbnf), r"def [a-z_]{1,3}\(\):")):
        for seed in (1, 2):
            rs = run(tiny_target, tiny_draft, max_tokens=40, seed=seed, temperature=0.8, drafter="hybrid",
                     num_draft_tokens=3, plan="fixed", **kw)
            assert rs[-1].finish_reason == "stop" and re.fullmatch(pattern, text_of(rs)), (kw, text_of(rs))


def test_json_object(tiny_target: Model) -> None:
    rs = run(tiny_target, None, max_tokens=200, seed=3, temperature=0.0, response_format={"type": "json_object"})
    if rs[-1].finish_reason == "stop":
        assert isinstance(json.loads(text_of(rs)), dict)
    else:
        assert rs[-1].constraint_satisfied is False


# ---------------------------------------------------------------- greedy: the constrained target's own output

def masked_logits(target: Model, constraint: Constraint, prompt: list[int], generated: list[int]) -> np.ndarray:
    logits = next_token_logits(target, prompt + generated)
    f = F.GrammarFollower.for_model(constraint, target)
    f.reset(prompt)
    f.commit(generated)
    return mask_logits(logits, f.mask(np.zeros(f.words, dtype=np.uint32)))


def assert_constrained_greedy_equal(target: Model, constraint: Constraint, got: list[int], want: list[int]) -> None:
    """Equal up to a near-tie of the MASKED target's two best tokens (see tests/greedy.py)."""
    i = first_difference(got, want)
    if i is None:
        return
    assert i < min(len(got), len(want)), f"one output stops early at token {i}"
    logits = masked_logits(target, constraint, prompt_tokens(target, PROMPT), list(want[:i]))
    gaps = logits.max() - logits[got[i]], logits.max() - logits[want[i]]
    assert max(gaps) <= NEAR_TIE, f"outputs differ at token {i} by {gaps} logits (not a near-tie)"


@pytest.mark.parametrize("config", CONFIGS + [dict(verifier="greedy", drafter="model", tree="2x2")],
                         ids=lambda c: "-".join(str(v) for v in c.values()))
def test_greedy_equals_the_constrained_target_alone(tiny_target: Model, tiny_draft: Model, config: dict) -> None:
    kw = dict(max_tokens=80, temperature=0.0, response_format=RESPONSE_FORMAT)
    want = [r.token for r in run(tiny_target, None, num_draft_tokens=0, **kw) if r.token is not None]
    got = [r.token for r in run(tiny_target, tiny_draft, plan="fixed", **config, **kw) if r.token is not None]
    assert_constrained_greedy_equal(tiny_target, GenerationConfig.from_options(**kw).constraint, got, want)


# ---------------------------------------------------------------- T > 0: the constrained target's distribution

REGEX = r"(yes|no|maybe)[abc]{1,3}"  # ~120 outputs: the whole text is the statistic
N_SPEC, N_PLAIN = 1500, 3000
ALPHA = 1e-3


def outputs(target: Model, draft: Model | None, n: int, seed0: int, **kw: Any) -> Counter:
    out: Counter = Counter()
    for i in range(n):
        rs = list(stream_generate(target, draft, "ab", max_tokens=12, seed=seed0 + i, regex=REGEX, **PLAIN, **kw))
        out[text_of(rs) + "|" + str(rs[-1].finish_reason)] += 1
    return out


def two_sample_p(a: Counter, b: Counter) -> float:
    keys = sorted(set(a) | set(b))
    table = np.array([[a[k] for k in keys], [b[k] for k in keys]], dtype=float)
    expected = table.sum(0) * table.sum(1, keepdims=True) / table.sum()
    small = expected.min(0) < 5  # pooled: keeps the chi-square approximation valid
    pooled = np.column_stack([table[:, ~small], table[:, small].sum(1)]) if small.any() else table
    return float(stats.chi2_contingency(pooled)[1])


@pytest.fixture(scope="module")
def plain_outputs(tiny_target: Model) -> Counter:
    return outputs(tiny_target, None, N_PLAIN, 10**6, num_draft_tokens=0)


SPEC_CONFIGS = [
    dict(verifier="block", drafter="model", num_draft_tokens=3),
    dict(verifier="gbv", drafter="model", num_draft_tokens=3, paths=2),
    dict(verifier="traversal", drafter="model", tree="2x2"),
    dict(verifier="token", drafter="hybrid", num_draft_tokens=3),
]


@pytest.mark.parametrize("config", SPEC_CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_constrained_outputs_follow_the_constrained_target(tiny_target: Model, far_draft: Model,
                                                          plain_outputs: Counter, config: dict) -> None:
    spec = outputs(tiny_target, far_draft, N_SPEC, 0, plan="fixed", **config)
    assert all(re.fullmatch(REGEX, k.split("|")[0]) for k in spec)
    p = two_sample_p(spec, plain_outputs)
    assert p > ALPHA, f"{config}: the constrained output's distribution differs from the target's (p={p:.2e})"


def test_negative_control_unmasked_draft_rows_fail(tiny_target: Model, far_draft: Model, plain_outputs: Counter,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafter that draws under the mask but hands the verifier its UNMASKED rows (it lies about
    what it drew from) over-accepts its own choices: the same test rejects it."""
    fill = ModelDrafter._fill_row
    unmasked: dict[int, np.ndarray] = {}

    def fill_row(self, r, logits, sampling, mask=None):
        unmasked[r] = fill(self, r, logits, sampling).copy()
        return fill(self, r, logits, sampling, mask)

    draft = ModelDrafter.draft

    def lying_draft(self, *args, **kw):
        made = yield from draft(self, *args, **kw)
        for r in range(made.tree.n + 1):
            if r in unmasked:
                made.tree.probs[r] = unmasked[r]
        unmasked.clear()
        return made

    monkeypatch.setattr(ModelDrafter, "_fill_row", fill_row)
    monkeypatch.setattr(ModelDrafter, "draft", lying_draft)
    spec = outputs(tiny_target, far_draft, N_SPEC, 0, plan="fixed", verifier="block", drafter="model",
                   num_draft_tokens=3)
    assert two_sample_p(spec, plain_outputs) < ALPHA


def test_negative_control_the_draft_model_fails(far_draft: Model, plain_outputs: Counter) -> None:
    """... and constrained sampling from the draft model instead of the target."""
    assert two_sample_p(outputs(far_draft, None, N_SPEC, 0, num_draft_tokens=0), plain_outputs) < ALPHA


# ---------------------------------------------------------------- bad settings: errors before decoding

BAD = [
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object",
      "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}}}), "response_format"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(response_format="json"), "response_format"),
    (dict(json_schema={"type": "nonsense"}), "json_schema"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="root ::= undefined_rule"), "grammar"),
    (dict(grammar="%llguidance {}\nstart: @@@"), "grammar"),
    (dict(regex="a", grammar='root ::= "a"'), "grammar"),
    (dict(regex="a", stop=["x"]), "stop"),
]


@pytest.mark.parametrize("options,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_constraints_fail_before_decoding(tiny_target: Model, options: dict, param: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoding(*args, **kw):
        raise AssertionError("decoded before the constraint was checked")

    monkeypatch.setattr(Model, "decode_parts", no_decoding)
    with pytest.raises(ConfigError) as err:
        stream_generate(tiny_target, None, PROMPT, max_tokens=8, **options)
    assert err.value.param == param, err.value


def test_settings_round_trip() -> None:
    for options in (dict(response_format=RESPONSE_FORMAT), dict(response_format={"type": "json_object"}),
                    dict(regex="a+"), dict(grammar='root ::= "a"'), dict(json_schema=PERSON),
                    dict(constraint=Constraint.grammar('start: "a"', lark=True))):
        config = GenerationConfig.from_options(**options)
        assert config.constraint is not None
        again = GenerationConfig.from_options(**config.options())
        assert again.options() == config.options() and again.constraint.kind == config.constraint.kind
        json.dumps(config.options())  # JSON values (the CLI's --json settings)
    assert GenerationConfig.from_options(response_format={"type": "text"}).constraint is None


def test_no_constraint_loads_no_grammar(tiny_target: Model) -> None:
    g = Generation(tiny_target, None, PROMPT, GenerationConfig(max_tokens=4), Profiles.in_memory())
    assert g.engine.structured is None and not any(isinstance(d, type) for d in g.engine.drafters)
    satisfied = [r.constraint_satisfied for r in g]  # a random seed: the model may end before 4 tokens
    assert satisfied and all(s is None for s in satisfied)
    assert not any(isinstance(f, F.GrammarFollower) for seq in tiny_target.sequences for f in seq.followers)


def test_grammar_stops_following_after_the_generation(tiny_target: Model) -> None:
    generate(tiny_target, None, PROMPT, max_tokens=6, regex="[a-z]{1,20}", profiles=Profiles.in_memory())
    assert not any(isinstance(f, F.GrammarFollower) for seq in tiny_target.sequences for f in seq.followers)
    generate(tiny_target, None, PROMPT, max_tokens=6, profiles=Profiles.in_memory())  # free text again
