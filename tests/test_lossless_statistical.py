"""Monte Carlo goodness of fit of the C verifier's one-step output against the exact target joint.

Each case runs N steps (drafting included, fixed seeds) and a Pearson chi-square test. A correct
verifier fails a case with probability ALPHA = 1e-4 over the choice of seed, so the whole module
(< 20 positive cases, token-masked ones included) has a false-positive rate below 2e-3; with the
seeds fixed, the outcome is deterministic. The negative controls (broken verifiers, same N, same
ALPHA) must be rejected.

Token masks: the C verifier gets a toy grammar's bitmasks (the drafter drafts under them, or
ignores them), and its output continued by constrained sampling is compared with the exact
constrained joint; controls that drop the masks or shift them by one row must be rejected.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from localspec.verify import lossless, reference, reference_tree
from localspec.settings.sampling import SamplingParams
from localspec.settings.shape import Shape
from localspec.verify.lossless import ToyGrammar, ToyModel

ALPHA = 1e-4
N = 20_000


def models(vocab: int, noise: float = 1.0) -> tuple[ToyModel, ToyModel]:
    target = ToyModel(vocab, seed=vocab * 10 + 1)
    return target, ToyModel(vocab, seed=vocab * 10 + 2, base=target, noise=noise)


CASES = [
    ("token", Shape.chain(3), SamplingParams(1.0), 5),
    ("block", Shape.chain(3), SamplingParams(0.7, top_k=3), 5),
    ("block", Shape.chain(4), SamplingParams(1.0, top_p=0.85), 4),
    ("gbv", Shape.k_paths(3, 2), SamplingParams(1.0), 4),
    ("gbv", Shape.k_paths(2, 3), SamplingParams(0.8, top_p=0.9), 4),
    ("batch", Shape.k_paths(3, 2), SamplingParams(1.0, top_p=0.8), 4),
    ("rrs", Shape.tree((2, 2)), SamplingParams(1.0), 4),
    ("rrsw", Shape.tree((2, 2)), SamplingParams(1.2, min_p=0.1), 4),
    ("traversal", Shape.tree((3, 2)), SamplingParams(1.0), 5),
    ("traversal", Shape.tree((2, 2, 1)), SamplingParams(1.0, top_k=3), 4),
    ("match", Shape.tree((2, 1)), SamplingParams(1.0), 4),
    ("greedy", Shape.tree((2, 2)), SamplingParams(0.0), 4),
    ("token", Shape.chain(0), SamplingParams(0.9, top_k=4, top_p=0.9), 12),  # empty draft: plain sampling
    ("block", Shape.chain(1), SamplingParams(1.0), 20),
]


@pytest.mark.parametrize("method,shape,settings,vocab", CASES,
                         ids=[f"{c[0]}-{c[1].branching}x{c[1].paths}-V{c[3]}" for c in CASES])
def test_c_verifier_output_matches_target(method, shape, settings, vocab):
    target, draft = models(vocab)
    p = lossless.monte_carlo_pvalue(method, target, draft, shape, settings, N, seed=vocab + len(method))
    assert p > ALPHA, f"p = {p:.3g}"


def _reference_step(method, lenience=0.0, **patch):
    def step(m, logits, dprobs, tree, seed, settings):
        tp = reference.transform(logits, **asdict(settings))
        u = reference.Uniforms(np.random.default_rng(seed).random(len(tree.tokens) + 1))
        return reference.verify(method, tp, dprobs, tree.tokens, tree.parents, u, lenience)
    return step


def _always_accept(m, logits, dprobs, tree, seed, settings):
    n = len(tree.tokens)
    tp = reference.transform(logits[n], **asdict(settings))[0]
    return tuple(range(n)), int(np.random.default_rng(seed).choice(len(tp), p=tp))


def _target_residual(method):
    inner = _reference_step(method)

    def step(*args):
        saved = reference_tree.sample_residual
        reference_tree.sample_residual = lambda t, d, a, r, slot: r.categorical(t, 1.0, slot)
        try:
            return inner(*args)
        finally:
            reference_tree.sample_residual = saved
    return step


NEGATIVE = [
    ("always-accept", _always_accept, "token", Shape.chain(3)),
    ("residual=target", _target_residual("token"), "token", Shape.chain(3)),
    ("residual=target", _target_residual("block"), "block", Shape.chain(3)),
    ("lenience 0.3", _reference_step("token", lenience=0.3), "token", Shape.chain(3)),
]


@pytest.mark.parametrize("name,step,method,shape", NEGATIVE, ids=[f"{c[0]}-{c[2]}" for c in NEGATIVE])
def test_negative_controls_are_rejected(name, step, method, shape):
    target, draft = models(5)
    p = lossless.monte_carlo_pvalue(method, target, draft, shape, SamplingParams(1.0), N, seed=5, step=step)
    assert p < ALPHA, f"{name}: p = {p:.3g} - the test has no power"


def test_reference_passes_the_same_test():
    """The harness itself: the (correct) numpy reference is accepted at the same N."""
    target, draft = models(5)
    p = lossless.monte_carlo_pvalue("block", target, draft, Shape.chain(3), SamplingParams(1.0), N, seed=5,
                                    step=_reference_step("block"))
    assert p > ALPHA


# ----------------------------------------------------------------------------- token masks

GRAMMAR = ToyGrammar(4, seed=3)

MASKED_CASES = [  # (method, shape, settings, drafter drafts under the mask?)
    ("traversal", Shape.tree((2, 2)), SamplingParams(1.0), True),
    ("block", Shape.chain(3), SamplingParams(0.8, top_p=0.9), True),
    ("gbv", Shape.k_paths(2, 2), SamplingParams(1.0), False),
]


@pytest.mark.parametrize("method,shape,settings,draft_masked", MASKED_CASES,
                         ids=[f"{c[0]}-masked-draft{c[3]}" for c in MASKED_CASES])
def test_c_verifier_with_masks_matches_constrained_sampling(method, shape, settings, draft_masked):
    target, draft = models(4)
    p = lossless.monte_carlo_pvalue(method, target, draft, shape, settings, N, seed=31 + len(method),
                                    grammar=GRAMMAR, draft_masked=draft_masked)
    assert p > ALPHA, f"p = {p:.3g}"


def _c_masks(transform_masks):
    def step(m, logits, dprobs, tree, seed, settings):
        masks = transform_masks(tree)
        v = lossless.verifier.verify(m, logits, dprobs.astype(np.float32), tree.tokens, tree.parents, seed=seed,
                                     sampling=settings, masks=masks)
        return v.path, v.token
    return step


def _parent_masks(tree):
    """Row r gets the mask of its context one token shorter (the grammar state one step behind)."""
    return lossless.verifier.pack_mask(np.stack([GRAMMAR.allowed(c[:-1]) for c in tree.contexts]))


def _unmasked_draft_rows(m, logits, dprobs, tree, seed, settings):
    """A drafter that draws under the mask but reports its unmasked rows: every output token is
    still allowed (no zero-probability category), only the distribution is wrong."""
    target, draft = models(4)
    rows = np.stack([lossless.draft_distribution(draft, c, settings) for c in tree.contexts])
    return lossless.c_step(m, logits, rows, tree, seed, settings)


MASKED_NEGATIVE = [
    ("masks dropped", _c_masks(lambda tree: None), "traversal", Shape.tree((2, 2))),
    ("parent's mask", _c_masks(_parent_masks), "block", Shape.chain(3)),
    ("unmasked draft rows", _unmasked_draft_rows, "block", Shape.chain(3)),
]


@pytest.mark.parametrize("name,step,method,shape", MASKED_NEGATIVE, ids=[c[0] for c in MASKED_NEGATIVE])
def test_masked_negative_controls_are_rejected(name, step, method, shape):
    target, draft = models(4)
    p = lossless.monte_carlo_pvalue(method, target, draft, shape, SamplingParams(1.0), N, seed=7, step=step,
                                    grammar=GRAMMAR)
    assert p < ALPHA, f"{name}: p = {p:.3g} - the test has no power"
