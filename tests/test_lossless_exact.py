"""Exact losslessness of every method (numpy reference, all randomness enumerated; C is tied to
the reference draw for draw in test_verifier_draws.py), the block paper's toy example, Theorem 2,
Yin et al.'s Pareto front for lenience, and negative controls that must fail the same check.
With token masks (a toy grammar), every method is exactly plain constrained sampling, and
mask-handling mistakes (mask ignored on the residual, the parent's mask, no mask) are caught."""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pytest

from localspec.verify import lossless, reference, reference_tree
from localspec.settings.sampling import SamplingParams
from localspec.settings.shape import Shape
from localspec.verify.lossless import ToyGrammar, ToyModel

TOL = 1e-9
V = 3
TARGET = ToyModel(V, seed=1)
DRAFT = ToyModel(V, seed=2, base=TARGET, noise=1.0)
FAR_DRAFT = ToyModel(V, seed=3)  # unrelated to the target: many rejections

SHAPES = {
    "chain": [Shape.chain(3)],
    "paths": [Shape.k_paths(2, 2), Shape.k_paths(3, 2)],
    "tree": [Shape.tree((2, 1)), Shape.tree((3,)), Shape.tree((1, 2)), Shape.tree((2, 2)), Shape.tree((3, 1))],
}
SETTINGS = [SamplingParams(1.0), SamplingParams(0.6, top_k=2), SamplingParams(1.4, top_p=0.8), SamplingParams(1.0, min_p=0.3),
            SamplingParams(0.0)]


def cases():
    for method, kind in lossless.SHAPES_BY_METHOD.items():
        for shape in SHAPES[kind]:
            for settings in SETTINGS:
                if method == "greedy" and settings.temperature > 0:
                    continue  # greedy is lossless for the greedy target only
                yield pytest.param(method, shape, settings, id=f"{method}-{shape.label}-{settings}")


@pytest.mark.parametrize("method,shape,settings", list(cases()))
def test_one_step_is_exactly_the_target(method, shape, settings):
    for draft in (DRAFT, FAR_DRAFT):
        assert lossless.exact_error(method, TARGET, draft, shape, settings) <= TOL


def test_block_paper_toy_example():
    """Sec. 2: M_b = (1/3, 2/3), M_s = (2/3, 1/3), gamma = 2: 10/9 vs 11/9 accepted tokens."""
    target = ToyModel(2, 0, fixed=(math.log(1 / 3), math.log(2 / 3)))
    draft = ToyModel(2, 0, fixed=(math.log(2 / 3), math.log(1 / 3)))
    chain = Shape.chain(2)
    s = SamplingParams(1.0)
    assert lossless.expected_accepted("token", target, draft, chain, s) == pytest.approx(10 / 9, abs=1e-12)
    assert lossless.expected_accepted("block", target, draft, chain, s) == pytest.approx(11 / 9, abs=1e-12)
    assert lossless.expected_accepted("traversal", target, draft, chain, s) == pytest.approx(11 / 9, abs=1e-12)
    assert lossless.expected_accepted("gbv", target, draft, chain, s) == pytest.approx(11 / 9, abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_block_accepts_at_least_as_much_as_token_theorem_2(seed):
    target = ToyModel(4, seed=100 + seed)
    draft = ToyModel(4, seed=200 + seed, base=target, noise=float(1 + seed % 3))
    chain = Shape.chain(3)
    s = SamplingParams(1.0)
    tok = lossless.expected_accepted("token", target, draft, chain, s)
    blk = lossless.expected_accepted("block", target, draft, chain, s)
    trav = lossless.expected_accepted("traversal", target, draft, chain, s)
    assert blk >= tok - 1e-12
    assert trav == pytest.approx(blk, abs=1e-12)  # traversal on a chain is optimal too (Thm 3.4)


def test_more_paths_accept_more_gbv():
    s = SamplingParams(1.0)
    one = lossless.expected_accepted("gbv", TARGET, FAR_DRAFT, Shape.chain(2), s)
    three = lossless.expected_accepted("gbv", TARGET, FAR_DRAFT, Shape.k_paths(3, 2), s)
    assert three > one


@pytest.mark.parametrize("eps", [0.0, 0.05, 0.2, 1.0])
def test_lenience_sits_on_the_pareto_front(eps):
    """Yin et al. Thm 5: P(reject) + TV(output, target) = TV(draft, target), one token."""
    target = ToyModel(4, seed=7)
    draft = ToyModel(4, seed=8)
    s = SamplingParams(1.0)

    def step(method, tp, dp, tree, rng):
        return reference.verify("token", tp, dp, tree.tokens, tree.parents, rng, lenience=eps)

    dist = lossless.exact_distribution("token", target, draft, Shape.chain(1), s, step=step)
    first = np.zeros(4)
    reject = 0.0
    for seq, p in dist.items():
        first[seq[0]] += p
        reject += p if len(seq) == 1 else 0.0
    t = lossless.target_distribution(target, (), s)
    d = lossless.draft_distribution(draft, (), s)
    tv_out = 0.5 * np.abs(first - t).sum()
    assert reject + tv_out == pytest.approx(0.5 * np.abs(t - d).sum(), abs=1e-12)
    assert (tv_out <= 1e-12) == (eps == 0.0)  # lossy exactly when eps > 0


# ----------------------------------------------------------------------------- negative controls


def always_accept(method, tp, dp, tree, rng):
    n = len(tree.tokens)
    return tuple(range(n)), rng.categorical(tp[n], 1.0, n)


def target_residual(method, tp, dp, tree, rng, _orig=reference_tree.sample_residual):
    """Residual = the target row instead of max(target - draft, 0)."""
    saved = reference_tree.sample_residual
    reference_tree.sample_residual = lambda t, d, a, r, slot: r.categorical(t, 1.0, slot)
    try:
        return reference.verify(method, tp, dp, tree.tokens, tree.parents, rng)
    finally:
        reference_tree.sample_residual = saved


def skip_draft_renormalisation(method, tp, dp, tree, rng):
    """RRSw that forgets to remove rejected tokens from the draft (treats them as i.i.d.)."""
    return reference.verify("rrs", tp, dp, tree.tokens, tree.parents, rng)


@pytest.mark.parametrize("broken,method,shape", [
    (always_accept, "token", Shape.chain(3)),
    (target_residual, "token", Shape.chain(3)),
    (target_residual, "block", Shape.chain(3)),
    (skip_draft_renormalisation, "rrsw", Shape.tree((3,))),
])
def test_broken_verifiers_fail_the_exact_check(broken, method, shape):
    """The positive test checks both drafts; failing it means exceeding TOL on either."""
    errors = [lossless.exact_error(method, TARGET, d, shape, SamplingParams(1.0), step=broken)
              for d in (DRAFT, FAR_DRAFT)]
    assert max(errors) > 1e-3


# ----------------------------------------------------------------------------- token masks (constrained decoding)

GRAMMAR = ToyGrammar(V, seed=1)  # root allows 2 tokens; below it rows allow 1, 2 or all 3
MASKED_DRAFTS = [(DRAFT, True), (FAR_DRAFT, True), (FAR_DRAFT, False)]  # (drafter, drafts under the mask?)


def test_toy_grammar_has_every_kind_of_row():
    import itertools

    sizes = {int(GRAMMAR.allowed(c).sum()) for L in range(4) for c in itertools.product(range(V), repeat=L)}
    assert sizes == {1, 2, 3}
    assert GRAMMAR.allowed(()).sum() == 2
    assert np.array_equal(GRAMMAR.allowed((0, 1)), GRAMMAR.allowed((0, 1)))  # deterministic


def test_masked_target_joint_is_constrained_sampling():
    """The reference of "the target alone": no forbidden continuation, rows renormalised."""
    joint = lossless.target_joint(TARGET, (), 3, SamplingParams(1.0), GRAMMAR)
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-12)
    for seq in joint:
        assert all(GRAMMAR.allowed(seq[:i])[x] for i, x in enumerate(seq))


@pytest.mark.parametrize("method,shape,settings", list(cases()))
def test_masked_step_is_exactly_the_constrained_target(method, shape, settings):
    """Every method x shape x sampling setting, masked target: exact output = constrained sampling,
    for a drafter that drafts under the mask (near and far) and one that ignores it."""
    for draft, draft_masked in MASKED_DRAFTS:
        err = lossless.exact_error(method, TARGET, draft, shape, settings, grammar=GRAMMAR,
                                   draft_masked=draft_masked)
        assert err <= TOL, (draft.seed, draft_masked, err)


def _masked_rows(tree, settings, mask_of):
    return np.stack([reference.transform(TARGET.logits(c), **asdict(settings), mask=mask_of(c))[0]
                     for c in tree.contexts])


def mask_ignored_on_residual(settings):
    """Acceptance tests use the masked target, but the correction (residual) draw uses the
    unmasked target row: max(t_unmasked - d, 0)."""

    def step(method, tp, dp, tree, rng):
        raw = _masked_rows(tree, settings, lambda c: None)
        base, stride = tp.ctypes.data, tp.strides[0]
        saved = reference_tree.sample_residual

        def residual(t, d, a, r, slot):
            row = (t.ctypes.data - base) // stride  # t is a row view of tp
            assert 0 <= row < len(raw) and t.base is not None
            return saved(raw[row], d, a, r, slot)

        reference_tree.sample_residual = residual
        try:
            return reference.verify(method, tp, dp, tree.tokens, tree.parents, rng)
        finally:
            reference_tree.sample_residual = saved

    return step


def parent_mask_off_by_one(settings):
    """Row r masked with its parent's mask (the grammar state one token behind)."""

    def step(method, tp, dp, tree, rng):
        wrong = _masked_rows(tree, settings, lambda c: GRAMMAR.allowed(c[:-1]))
        return reference.verify(method, wrong, dp, tree.tokens, tree.parents, rng)

    return step


def unmasked_target(settings):
    """The verifier is not given the masks at all (the drafter still drafts under them)."""

    def step(method, tp, dp, tree, rng):
        return reference.verify(method, _masked_rows(tree, settings, lambda c: None), dp, tree.tokens,
                                tree.parents, rng)

    return step


@pytest.mark.parametrize("broken,method,shape", [
    (mask_ignored_on_residual, "token", Shape.chain(3)),
    (mask_ignored_on_residual, "block", Shape.chain(3)),
    (mask_ignored_on_residual, "gbv", Shape.k_paths(2, 2)),
    (mask_ignored_on_residual, "batch", Shape.k_paths(2, 2)),
    (parent_mask_off_by_one, "token", Shape.chain(3)),
    (parent_mask_off_by_one, "block", Shape.chain(3)),
    (parent_mask_off_by_one, "traversal", Shape.tree((2, 1))),
    (parent_mask_off_by_one, "rrsw", Shape.tree((2, 1))),
    (parent_mask_off_by_one, "match", Shape.tree((2, 1))),
    (unmasked_target, "traversal", Shape.tree((2, 1))),
])
def test_broken_mask_handling_fails_the_exact_check(broken, method, shape):
    """Negative controls: the same check as the positive test (same drafts) must fail."""
    s = SamplingParams(1.0)
    errors = [lossless.exact_error(method, TARGET, d, shape, s, step=broken(s), grammar=GRAMMAR, draft_masked=m)
              for d, m in MASKED_DRAFTS]
    assert max(errors) > 1e-3, errors
