"""A setting validation accepts never fails later: the sampling settings are checked with the
ranges the C verifier accepts after its float64 -> float32 conversion (native/verify.c and
native/sampling.c: LS_ERR_SAMPLING, "sampling settings out of range"). The extremes accepted run
through the real C verifier; the values just outside are refused by the settings, the server's
request schema and the CLI, naming the setting."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from localspec.cli import cli
from localspec.settings.generation import SEED_LIMIT, GenerationConfig
from localspec.settings.sampling import MAX_TEMPERATURE, MIN_PROBABILITY, MIN_TEMPERATURE, SamplingParams
from localspec.settings.validation import INT32_MAX
from localspec.errors import ConfigError, RequestError, VerifierError
from localspec.llama.model import Model
from localspec.verify import verifier

TINY = 2.0**-1074  # the smallest float64 > 0 (a subnormal)
METHODS = ("token", "block", "greedy", "match", "traversal")


def below(x: float) -> float:
    return math.nextafter(x, -math.inf)


def above(x: float) -> float:
    return math.nextafter(x, math.inf)


# each setting: its accepted extremes (with the others at their neutral values) and the values just outside
ACCEPTED = {
    "temperature": [0.0, MIN_TEMPERATURE, MAX_TEMPERATURE],
    "top_k": [0, 1, INT32_MAX],
    "top_p": [MIN_PROBABILITY, below(1.0), 1.0],
    "min_p": [0.0, -0.0, MIN_PROBABILITY, 1.0],
}
REFUSED = {
    "temperature": [-TINY, TINY, below(MIN_TEMPERATURE), above(MAX_TEMPERATURE), math.inf, math.nan],
    "top_k": [-1, INT32_MAX + 1],
    "top_p": [0.0, TINY, 1e-320, 2.0**-150, below(MIN_PROBABILITY), above(1.0), math.inf, math.nan],
    "min_p": [-TINY, TINY, below(MIN_PROBABILITY), above(1.0), math.nan],
}
CASES_OK = [(k, v) for k, vs in ACCEPTED.items() for v in vs]
CASES_BAD = [(k, v) for k, vs in REFUSED.items() for v in vs]


def unchecked(**settings: float) -> SamplingParams:
    """SamplingParams as they were before validation refused these values (bypassing it)."""
    s = object.__new__(SamplingParams)
    for key, value in {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **settings}.items():
        object.__setattr__(s, key, value)
    return s


@pytest.fixture(scope="module")
def problem() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 64)) * 40).astype(np.float32)  # wide: temperature 1e-4 scales them by 1e4
    draft = rng.dirichlet(np.ones(64), size=4).astype(np.float32)
    return logits, draft


def run_c(sampling: SamplingParams, problem: tuple[np.ndarray, np.ndarray], lenience: float = 0.0) -> None:
    logits, draft = problem
    for method in METHODS if lenience == 0 else ("token",):
        verifier.verify(method, logits, draft, [1, 2, 3], [-1, 0, 1], sampling=sampling, seed=7, lenience=lenience)
    assert np.isfinite(verifier.probs(logits, sampling=sampling)).all()


@pytest.mark.parametrize("key,value", CASES_OK, ids=[f"{k}={v!r}" for k, v in CASES_OK])
def test_accepted_extremes_run_through_the_c_verifier(key: str, value: float,
                                                      problem: tuple[np.ndarray, np.ndarray]) -> None:
    run_c(SamplingParams(**{key: value}), problem)
    if key != "temperature":  # the same at temperature 1e-4 (the largest logit scale) and 1e6
        for t in (MIN_TEMPERATURE, MAX_TEMPERATURE):
            run_c(SamplingParams(**{key: value, "temperature": t}), problem)


def test_all_extremes_at_once_run_through_the_c_verifier(problem: tuple[np.ndarray, np.ndarray]) -> None:
    run_c(SamplingParams(MIN_TEMPERATURE, INT32_MAX, MIN_PROBABILITY, 1.0), problem)
    run_c(SamplingParams(MAX_TEMPERATURE, 1, MIN_PROBABILITY, MIN_PROBABILITY), problem)


@pytest.mark.parametrize("key,value", CASES_BAD, ids=[f"{k}={v!r}" for k, v in CASES_BAD])
def test_values_just_outside_are_refused_naming_the_setting(key: str, value: float) -> None:
    with pytest.raises(ConfigError) as info:
        SamplingParams(**{key: value})
    assert info.value.param == key and key in str(info.value)
    with pytest.raises(ConfigError) as info:
        GenerationConfig.from_options(**{key: value})
    assert info.value.param == key


def test_negative_control_the_c_verifier_refuses_what_validation_once_let_through(
        problem: tuple[np.ndarray, np.ndarray]) -> None:
    """top_p 1e-320 passed the old check (0 < top_p <= 1) and became 0 in float32: the server
    answered 500. The C side accepts any top_p whose float32 is > 0 (2**-150 rounds to 0, the next
    float64 to a subnormal); validation keeps to normal float32s, inside that."""
    for top_p in (1e-320, 2.0**-150):
        with pytest.raises(VerifierError, match="sampling settings out of range"):
            run_c(unchecked(top_p=top_p), problem)
    run_c(unchecked(top_p=above(2.0**-150)), problem)
    assert above(2.0**-150) < MIN_PROBABILITY


@pytest.mark.parametrize("key,value", [("lenience", 0.0), ("lenience", TINY), ("lenience", sys.float_info.max)])
def test_lenience_extremes_run_through_the_c_verifier(key: str, value: float,
                                                      problem: tuple[np.ndarray, np.ndarray]) -> None:
    config = GenerationConfig.from_options(verifier="token", lenience=value)
    run_c(config.sampling, problem, lenience=config.lenience)


@pytest.mark.parametrize("options,param", [
    ({"verifier": "token", "lenience": -TINY}, "lenience"), ({"verifier": "token", "lenience": math.inf}, "lenience"),
    ({"verifier": "token", "lenience": math.nan}, "lenience"), ({"verifier": "block", "lenience": TINY}, "lenience"),
    ({"seed": -1}, "seed"), ({"seed": SEED_LIMIT}, "seed"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": INT32_MAX + 1}, "max_tokens"),
])
def test_other_settings_just_outside_are_refused(options: dict, param: str) -> None:
    with pytest.raises(ConfigError) as info:
        GenerationConfig.from_options(**options)
    assert info.value.param == param


def test_seed_and_max_tokens_extremes_are_usable() -> None:
    for seed in (0, SEED_LIMIT - 1):
        config = GenerationConfig.from_options(seed=seed)
        np.random.default_rng(config.seed).integers(0, 2**63)  # what the engine draws its verifier seeds with
    assert GenerationConfig.from_options(max_tokens=INT32_MAX).max_tokens == INT32_MAX


# ---------------------------------------------------------------- the server's schema and the CLI


@pytest.mark.parametrize("key,value", [c for c in CASES_BAD if not math.isnan(c[1]) and not math.isinf(c[1])],
                         ids=[f"{k}={v!r}" for k, v in CASES_BAD if not math.isnan(v) and not math.isinf(v)])
def test_the_request_schema_refuses_values_just_outside(key: str, value: float) -> None:
    from localspec.server import schemas

    body = {"messages": [{"role": "user", "content": "hi"}], key: value}
    with pytest.raises(RequestError) as info:
        schemas.parse(body, chat=True).config(GenerationConfig())
    assert info.value.param == key and info.value.status == 400


@pytest.mark.parametrize("key,value", CASES_OK, ids=[f"{k}={v!r}" for k, v in CASES_OK])
def test_the_request_schema_accepts_the_extremes(key: str, value: float) -> None:
    from localspec.server import schemas

    config = schemas.parse({"messages": [{"role": "user", "content": "hi"}], key: value}, chat=True) \
        .config(GenerationConfig())
    assert getattr(config.sampling, key) == value


def test_the_server_answers_the_extremes_not_500(tiny_target: Model) -> None:
    """The 500 of the issue: top_p 1e-320 was accepted, then refused by the C verifier mid-request."""
    from starlette.testclient import TestClient

    from localspec.server.app import create_app
    from localspec.server.jobs import Pair

    app = create_app(Pair.adopting(tiny_target, None, "tiny"), model_id="tiny")
    with TestClient(app) as client:
        for fields in ({"top_p": MIN_PROBABILITY, "min_p": MIN_PROBABILITY}, {"temperature": MIN_TEMPERATURE},
                       {"temperature": MAX_TEMPERATURE, "top_k": INT32_MAX}):
            r = client.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 3, "seed": 1, **fields})
            assert r.status_code == 200, (fields, r.text)
        r = client.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 3, "top_p": 1e-320})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text


def test_the_cli_refuses_values_just_outside_and_runs_the_extremes(tiny_paths: tuple[Path, Path]) -> None:
    common = ["-m", str(tiny_paths[0]), "-d", "none", "--ctx-size", "256", "--threads", "1", "-n", "3",
              "--keep-alive", "0", "--seed", "1"]
    for flag, value in (("--top-p", "1e-320"), ("--min-p", "1e-40"), ("--temperature", "1e-5"), ("--top-k", "-1")):
        r = CliRunner().invoke(cli, [*common, flag, value, "def f("])
        assert r.exit_code == 2 and f"Invalid value for {flag}" in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(cli, [*common, "-t", "1", "--top-p", repr(MIN_PROBABILITY), "--min-p",
                                 repr(MIN_PROBABILITY), "--top-k", str(INT32_MAX), "def f("])
    assert r.exit_code == 0, r.output
