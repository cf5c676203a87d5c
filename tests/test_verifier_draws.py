"""The C verifier against the independent numpy reference, draw for draw (same uniforms).

The reference is fed the C transform's float64 target probabilities (tested separately against
the numpy transform), so both sides compare identical numbers; remaining differences are sums
taken in another order (~1e-16 relative), which change a decision only if a uniform falls within
~1e-15 of a threshold: over the ~10^5 draws here, a probability below 1e-9.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import numpy as np
import pytest

from instances import random_instance
from masks import unpack_mask
from localspec.verify import reference, verifier
from localspec.settings.sampling import SamplingParams

METHODS = verifier.METHODS
N_CASES = 400


def run_c(inst, method=None, **extra):
    return verifier.verify(method or inst.method, inst.logits, inst.draft, inst.tokens, inst.parents,
                           uniforms=inst.uniforms, sampling=inst.settings, masks=inst.masks, **extra)


def run_reference(inst, method=None, lenience=0.0):
    tp = verifier.probs(inst.logits, sampling=inst.settings, masks=inst.masks)
    return reference.verify(method or inst.method, tp, inst.draft.astype(np.float64), inst.tokens,
                            inst.parents, reference.Uniforms(inst.uniforms), lenience, masks=inst.masks)


@pytest.mark.parametrize("method", METHODS)
def test_c_equals_reference_draw_for_draw(method):
    rng = np.random.default_rng(1000 + METHODS.index(method))
    accepted = 0
    for _ in range(N_CASES):
        inst = random_instance(rng, method)
        c = run_c(inst)
        path, token = run_reference(inst)
        assert (c.path, c.token) == (path, token), (inst, c, path, token)
        assert c.n_accepted == len(c.path)
        accepted += c.n_accepted
    assert accepted > 0 or method == "greedy"


@pytest.mark.parametrize("method", METHODS)
def test_c_equals_reference_draw_for_draw_with_masks(method):
    """Token masks (every density, junk in the disallowed logits, drafters that honour or ignore
    the mask): C and reference agree draw for draw; no forbidden token is ever output."""
    rng = np.random.default_rng(2000 + METHODS.index(method))
    accepted = forbidden_drafted = 0
    for _ in range(N_CASES):
        inst = random_instance(rng, method, masked=True)
        c = run_c(inst)
        path, token = run_reference(inst)
        assert (c.path, c.token) == (path, token), (inst, c, path, token)
        allowed = unpack_mask(inst.masks, inst.logits.shape[1])
        rows = [0] + [j + 1 for j in c.path]
        out = [inst.tokens[j] for j in c.path] + [c.token]
        assert all(allowed[r, x] for r, x in zip(rows, out)), "a forbidden token was output"
        forbidden_drafted += sum(not allowed[p + 1, x] for p, x in zip(inst.parents, inst.tokens))
        accepted += c.n_accepted
    assert (accepted > 0 and forbidden_drafted > 0) or method == "greedy"


def test_masks_all_set_equal_no_masks():
    """An all-ones mask is the unconstrained verifier, draw for draw."""
    rng = np.random.default_rng(17)
    for method in METHODS:
        for _ in range(40):
            inst = random_instance(rng, method)
            V = inst.logits.shape[1]
            ones = verifier.pack_mask(np.ones((inst.n + 1, V), dtype=bool))
            assert run_c(inst) == verifier.verify(method, inst.logits, inst.draft, inst.tokens, inst.parents,
                                                  uniforms=inst.uniforms, sampling=inst.settings, masks=ones)


def test_lenience_zero_is_token_and_positive_matches_reference():
    rng = np.random.default_rng(7)
    for _ in range(300):
        inst = random_instance(rng, "token")
        base = run_c(inst)
        assert run_c(inst, lenience=0.0) == base
        eps = float(rng.choice([0.01, 0.1, 0.5]))
        c = run_c(inst, lenience=eps)
        assert (c.path, c.token) == run_reference(inst, lenience=eps)


def test_lenience_with_masks_matches_reference_and_never_admits_a_forbidden_token():
    rng = np.random.default_rng(8)
    for _ in range(300):
        inst = random_instance(rng, "token", masked=True)
        eps = float(rng.choice([0.1, 0.5, 5.0]))
        c = run_c(inst, lenience=eps)
        assert (c.path, c.token) == run_reference(inst, lenience=eps)
        allowed = unpack_mask(inst.masks, inst.logits.shape[1])
        assert all(allowed[inst.parents[j] + 1, inst.tokens[j]] for j in c.path)


# one chain / one path: several methods must coincide draw for draw
EQUIVALENT = [
    ("gbv", "block"),  # K = 1: q^Gamma = q
    ("traversal", "block"),  # single chain: traversal = block verification (Thm 3.4)
    ("rrs", "token"),  # one child per node: recursive rejection sampling = token verification
    ("rrsw", "token"),
    ("batch", "token"),
]


@pytest.mark.parametrize("method,same_as", EQUIVALENT)
def test_single_chain_equivalences(method, same_as):
    rng = np.random.default_rng(99)
    for _ in range(300):
        inst = random_instance(rng, "token")
        assert run_c(inst, method) == run_c(inst, same_as)


def test_batch_equals_rrs_on_paths():
    rng = np.random.default_rng(5)
    for _ in range(300):
        inst = random_instance(rng, "batch")
        assert run_c(inst, "batch") == run_c(inst, "rrs")


def test_seed_is_deterministic_and_seeds_differ():
    rng = np.random.default_rng(3)
    inst = random_instance(rng, "block", V=50)
    while inst.n < 4:
        inst = random_instance(rng, "block", V=50)
    kw = {"sampling": replace(inst.settings, temperature=1.0)}
    a = [verifier.verify("block", inst.logits, inst.draft, inst.tokens, inst.parents, seed=s, **kw)
         for s in range(40)]
    b = [verifier.verify("block", inst.logits, inst.draft, inst.tokens, inst.parents, seed=s, **kw)
         for s in range(40)]
    assert a == b
    assert len({(v.path, v.token) for v in a}) > 1


@pytest.mark.parametrize("settings", [
    SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8), SamplingParams(1.0, min_p=0.1),
    SamplingParams(0.9, top_k=20, top_p=0.9, min_p=0.05), SamplingParams(0.0), SamplingParams(1.0, top_k=1),
])
def test_transform_matches_numpy(settings):
    rng = np.random.default_rng(11)
    for V in (7, 100, 5000):
        logits = rng.normal(0, 3, size=(6, V)).astype(np.float32)
        c = verifier.probs(logits, sampling=settings)
        ref = reference.transform(logits, **asdict(settings))
        assert np.array_equal(c > 0, ref > 0)
        np.testing.assert_allclose(c, ref, rtol=2e-6, atol=1e-12)
        np.testing.assert_allclose(c.sum(axis=1), 1.0, atol=1e-9)
        f32 = verifier.probs(logits, dtype=np.float32, sampling=settings)
        np.testing.assert_allclose(f32, c, rtol=1e-6)


def test_transform_tie_breaking_is_lowest_id():
    signed_zeros = np.array([-1.0, -0.0, -2.0, 0.0] + [-3.0] * 200, dtype=np.float32)
    assert np.argmax(verifier.probs(signed_zeros, sampling=SamplingParams(0))) == 1  # -0 == +0: the first one
    late = np.full(300, -1.0, dtype=np.float32)
    late[[70, 250]] = [-0.0, 0.0]  # in different 64-logit chunks
    assert np.argmax(verifier.probs(late, sampling=SamplingParams(0))) == 70
    logits = np.array([1.0, 3.0, 3.0, 3.0, 0.0], dtype=np.float32)
    assert verifier.probs(logits, sampling=SamplingParams(0)).tolist() == [0, 1, 0, 0, 0]
    top2 = verifier.probs(logits, sampling=SamplingParams(top_k=2))
    assert (top2 > 0).tolist() == [False, True, True, False, False]
    assert np.array_equal(reference.transform(logits, top_k=2)[0] > 0, top2 > 0)


def test_sample_probs_without_replacement():
    row = np.array([0.5, 0.25, 0.25, 0.0], dtype=np.float32)
    assert verifier.sample_probs(row, 0.0) == 0
    assert verifier.sample_probs(row, 0.99) == 2
    assert verifier.sample_probs(row, 0.0, exclude=[0]) == 1
    assert verifier.sample_probs(row, 0.6, exclude=[0]) == 2
    with pytest.raises(verifier.VerifierError, match="no probability mass"):
        verifier.sample_probs(row, 0.5, exclude=[0, 1, 2])
