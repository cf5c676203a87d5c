"""The kernels users run: the engine and the verifier on tiny models quantized by llama.cpp's own
quantizer (Q4_K_M with its Q6_K tensors, Q4_0, Q8_0), loaded through the default CPU kernel
configuration (``cpu_kernels="auto"``, checked in a child process first), beside the same model in
F32. Greedy speculation equals the target alone up to a near-tie, sampled speculation keeps the
target's distribution (two-sample test, with a negative control), and the C verifier equals the
numpy reference draw for draw on the quantized models' own logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from localspec.llama import buffer_types
from localspec.verify import reference, verifier
from localspec.api import stream_generate
from localspec.settings.sampling import SamplingParams
from localspec.llama.model import Model

import tiny_models as tiny
from conftest import QUANTIZATIONS, load
from greedy import assert_greedy_equal
from test_engine import ALPHA, N_PLAIN, N_SPEC, NGRAM_PROMPT, PROMPT, first_tokens_key, tokens_of, two_sample_p

KINDS = ("f32", *QUANTIZATIONS)
# quantized kernels give a token's logits that differ in the last bits between batch shapes
# (repacked Q4 kernels run n <= 3 rows apart and blocks of 4 beyond); the tiny models' logits
# are ~5 wide, so a near-tie is looser than on F32
NEAR_TIE = 0.02
GREEDY_CONFIGS = [
    ("block", "model", dict(num_draft_tokens=4)),
    ("token", "model", dict(num_draft_tokens=4)),
    ("gbv", "model", dict(num_draft_tokens=4, paths=3)),
    ("traversal", "model", dict(tree=(3, 2, 1))),
    ("match", "model", dict(num_draft_tokens=4)),
    ("block", "ngram", dict(num_draft_tokens=4)),
    ("block", "hybrid", dict(num_draft_tokens=4)),
]
GREEDY_IDS = [f"{v}-{d}" for v, d, _ in GREEDY_CONFIGS]


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest,
         quantized_paths: dict[str, tuple[Path, Path]]) -> Iterator[tuple[str, Model, Model]]:
    target, draft = quantized_paths[request.param]
    with load(target) as t, load(draft) as d:
        yield request.param, t, d


def test_default_kernels_hold_the_quantized_weights(pair: tuple[str, Model, Model]) -> None:
    """The default configuration was checked and chosen; where this CPU has repacked kernels for a
    type, the weights went to them (the kernels under test are the fast ones users get)."""
    kind, target, _ = pair
    assert target.kernels is not None and target.kernels.config in ("llama", "repack", "plain")
    assert sum(target.weight_buffers.values()) > 0
    weights = buffer_types.read_weights(target.path)
    if (kind in ("q4_0", "q4_k_m") and target.kernels.config != "plain"
            and buffer_types.REPACK_BUFFER in buffer_types.extra_buffer_types()
            and buffer_types.repackable(weights, buffer_types.cpu_features())):
        assert target.weight_buffers.get(buffer_types.REPACK_BUFFER, 0) > 0, target.weight_buffers
    if kind != "f32":
        assert set(buffer_types.checked_types(weights)) - {"F32"}, "the file holds no quantized matrices"


@pytest.mark.parametrize("verifier_name,drafter,shape", GREEDY_CONFIGS, ids=GREEDY_IDS)
def test_greedy_speculation_equals_target_alone(pair: tuple[str, Model, Model], verifier_name: str,
                                                drafter: str, shape: dict) -> None:
    kind, target, draft = pair
    for prompt in (PROMPT, NGRAM_PROMPT):
        plain = tokens_of(target, None, prompt, temperature=0, max_tokens=40)
        spec = tokens_of(target, draft, prompt, temperature=0, max_tokens=40, verifier=verifier_name,
                         drafter=drafter, **shape)
        assert_greedy_equal(target, prompt, spec, plain, f"{kind} {verifier_name}/{drafter} diverged", NEAR_TIE)


def test_planned_speculation_equals_target_alone(pair: tuple[str, Model, Model]) -> None:
    kind, target, draft = pair
    plain = tokens_of(target, None, NGRAM_PROMPT, temperature=0, max_tokens=40)
    spec = tokens_of(target, draft, NGRAM_PROMPT, temperature=0, max_tokens=40, plan="auto")
    assert_greedy_equal(target, NGRAM_PROMPT, spec, plain, f"{kind} planned speculation diverged", NEAR_TIE)


def test_drafts_are_accepted(pair: tuple[str, Model, Model]) -> None:
    """Not vacuous: the quantized draft agrees with the quantized target often."""
    _, target, draft = pair
    last = list(stream_generate(target, draft, PROMPT, temperature=0, max_tokens=40, drafter="model",
                                num_draft_tokens=4, plan="fixed"))[-1]
    assert last.stats.accepted_tokens > 0 and last.stats.block_efficiency > 1.3


# ---------------------------------------------------------------- T > 0 on Q4_K_M


@pytest.fixture(scope="module")
def q4km(quantized_paths: dict[str, tuple[Path, Path]], tiny_dir: Path) -> Iterator[tuple[Model, Model, list]]:
    """The Q4_K_M target, a Q4_K_M draft far from it (50 % noise: many rejections, a strong test)
    and the target's own samples."""
    far = tiny.write_tiny_model(tiny_dir / "q-draft-far-f32.gguf", seed=1, noise=0.5, **tiny.QUANTIZABLE)
    far = tiny.quantize(far, tiny_dir / "q-draft-far-q4_k_m.gguf", tiny.QUANTIZATIONS["q4_k_m"])
    with load(quantized_paths["q4_k_m"][0]) as t, load(far) as d:
        yield t, d, [first_tokens_key(t, None, 10**6 + i) for i in range(N_PLAIN)]


@pytest.mark.parametrize("verifier_name,shape", [("block", dict(num_draft_tokens=3)),
                                                 ("traversal", dict(tree=(2, 2)))], ids=["block", "traversal"])
def test_sampled_speculation_keeps_the_distribution(q4km: tuple[Model, Model, list], verifier_name: str,
                                                    shape: dict) -> None:
    """Two-sample chi-square on the first 3 tokens, false-positive rate ALPHA (1e-3) per test."""
    target, draft, plain = q4km
    spec = [first_tokens_key(target, draft, i, verifier=verifier_name, drafter="model", **shape)
            for i in range(N_SPEC)]
    p = two_sample_p(spec, plain)
    assert p > ALPHA, f"Q4_K_M {verifier_name}: the first tokens' distribution differs from the target's (p={p:.2e})"


def test_negative_control_lossy_verifier_fails(q4km: tuple[Model, Model, list]) -> None:
    """The same test has power on these models: a lossy verifier (lenience over-accepts the
    draft's tokens) is caught, and so is sampling from the draft instead of the target."""
    target, draft, plain = q4km
    lossy = [first_tokens_key(target, draft, i, verifier="token", num_draft_tokens=3, lenience=0.9)
             for i in range(N_SPEC)]
    assert two_sample_p(lossy, plain) < ALPHA
    draft_only = [first_tokens_key(draft, None, i) for i in range(N_SPEC)]
    assert two_sample_p(draft_only, plain) < ALPHA


# ---------------------------------------------------------------- the verifier on their logits


def chain_rows(target: Model, draft: Model, prompt: str, k: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """A k-token chain sampled from the draft model (T = 1), the draft's k + 1 probability rows and
    the target's k + 1 logit rows for it (one batch, as a verification pass decodes)."""
    ids = target.tokenize(prompt)
    draft.clear()
    draft.prefill(ids, 0)
    rows, tokens = [], []
    for i in range(k + 1):
        row = verifier.probs(draft.logits_array(1)[:1].copy(), sampling=SamplingParams(1.0))[0]
        rows.append(row.astype(np.float32))
        if i == k:
            break
        tokens.append(int(rng.choice(len(row), p=row / row.sum())))
        draft.decode([tokens[-1]], [len(ids) + i])
    target.clear()
    target.prefill(ids[:-1], 0)
    target.decode([ids[-1], *tokens], range(len(ids) - 1, len(ids) + k))
    logits = target.logits_array(k + 1).copy()
    draft.clear()
    target.clear()
    return logits, np.stack(rows), tokens


@pytest.mark.parametrize("method", ["token", "block", "rrs", "traversal"])
def test_verifier_equals_reference_on_model_logits(pair: tuple[str, Model, Model], method: str) -> None:
    """Same uniforms, same outcome: C against the numpy reference on real rows of these models."""
    kind, target, draft = pair
    rng = np.random.default_rng(5)
    accepted = 0
    for sampling in (SamplingParams(1.0), SamplingParams(0.8, top_k=40, top_p=0.95, min_p=0.05)):
        logits, draft_probs, tokens = chain_rows(target, draft, PROMPT, 4, rng)
        parents = [-1, 0, 1, 2]
        tp = verifier.probs(logits, sampling=sampling)
        for _ in range(100):
            u = rng.random(len(tokens) + 1)
            c = verifier.verify(method, logits, draft_probs, tokens, parents, uniforms=u, sampling=sampling)
            want = reference.verify(method, tp, draft_probs.astype(np.float64), tokens, parents,
                                    reference.Uniforms(u))
            assert (c.path, c.token) == want, (kind, method, c, want)
            accepted += c.n_accepted
    assert accepted > 0, f"{kind} {method}: no draft token was ever accepted"
