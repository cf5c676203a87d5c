"""Edge cases and bad input: clear VerifierError messages, never a crash."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.verify import verifier
from localspec.settings.sampling import SamplingParams
from localspec.errors import ConfigError
from localspec.llama.logits import LogitsPointer
from localspec.verify.verifier import VerifierError

from masks import unpack_mask

V = 6
RNG = np.random.default_rng(0)


def chain(n, V=V, logits=None, draft=None):
    logits = RNG.normal(size=(n + 1, V)).astype(np.float32) if logits is None else logits
    draft = np.full((n + 1, V), 1.0 / V, dtype=np.float32) if draft is None else draft
    return logits, draft, list(range(1, n + 1)), [j - 1 for j in range(n)]


@pytest.mark.parametrize("method", ["token", "block", "gbv", "rrs", "rrsw", "traversal", "batch", "match"])
def test_draft_equal_to_target_accepts_everything(method):
    logits, _, tokens, parents = chain(5)
    draft = verifier.probs(logits, dtype=np.float32)
    tokens = [int(np.argmax(draft[j])) for j in range(5)]
    accepted = [verifier.verify(method, logits, draft, tokens, parents, seed=s).n_accepted
                for s in range(50)]
    if method == "match":  # sample-and-match keeps a token only when the target draws it again
        assert 0 < np.mean(accepted) < 5
    else:
        assert accepted == [5] * 50


@pytest.mark.parametrize("method", ["token", "block", "gbv", "rrs", "rrsw", "traversal", "batch"])
def test_zero_draft_probability_token_is_rejected(method):
    logits, draft, tokens, parents = chain(1)
    draft[0] = 0.0
    draft[0, 0] = 1.0  # the drafted token 1 has draft probability 0
    for s in range(30):
        v = verifier.verify(method, logits, draft, tokens, parents, seed=s)
        assert v.n_accepted == 0


def test_one_hot_rows_greedy_target():
    logits, _, tokens, parents = chain(3)
    am = logits.argmax(axis=1)
    draft = np.zeros((4, V), np.float32)
    draft[np.arange(4), am] = 1.0
    tokens = [int(am[j]) for j in range(3)]
    for method in ("greedy", "token", "block", "traversal", "rrsw"):
        v = verifier.verify(method, logits, draft, tokens, parents, sampling=SamplingParams(0.0), seed=1)
        assert v.path == (0, 1, 2) and v.token == int(am[3])
    wrong = [(t + 1) % V for t in tokens]
    v = verifier.verify("block", logits, draft, wrong, parents, sampling=SamplingParams(0.0), seed=1)
    assert v.path == () and v.token == int(am[0])


@pytest.mark.parametrize("method", verifier.METHODS)
def test_empty_draft_samples_the_target(method):
    logits = np.array([[0.0, 5.0, 0.0, 4.9]], dtype=np.float32)
    v = verifier.verify(method, logits, None, [], [], sampling=SamplingParams(0.0))
    assert v == verifier.VerifyOutcome((), 1, 0)
    draws = [verifier.verify(method, logits, None, [], [], seed=s, sampling=SamplingParams(1.0)).token for s in range(400)]
    if method != "greedy":
        assert set(draws) <= {0, 1, 2, 3} and 0.4 < draws.count(3) / 400 < 0.6


def test_raw_pointer_input():
    logits, draft, tokens, parents = chain(3)
    ptr = LogitsPointer(logits.ctypes.data, 4, V)
    a = verifier.verify("block", ptr, draft, tokens, parents, seed=3)
    b = verifier.verify("block", logits, draft, tokens, parents, seed=3)
    assert a == b
    wide = np.zeros((4, V + 10), np.float32)
    wide[:, :V] = logits
    strided = LogitsPointer(wide.ctypes.data, 4, V, row_stride=V + 10)
    assert verifier.verify("block", strided, draft, tokens, parents, seed=3) == b
    assert verifier.verify("block", wide[:, :V], draft, tokens, parents, seed=3) == b  # view, no copy


@pytest.mark.parametrize("change,message", [
    (lambda a: a["tokens"].__setitem__(1, V), r"tokens\[1\] = 6 is outside the vocabulary \[0, 6\)"),
    (lambda a: a["tokens"].__setitem__(0, -3), r"tokens\[0\] = -3"),
    (lambda a: a["parents"].__setitem__(2, 2), r"parents\[2\] = 2 must be -1"),
    (lambda a: a["logits"].__setitem__((2, 3), np.nan), "target_logits row 2 contains NaN or infinity"),
    (lambda a: a["logits"].__setitem__((0, 0), np.inf), "target_logits row 0 contains NaN or infinity"),
    (lambda a: a["draft"].__setitem__((0, 0), -0.5), "draft_probs row 0 is not a probability distribution"),
    (lambda a: a["draft"].__setitem__((1, 2), np.nan), "draft_probs row 1"),
])
def test_bad_input_names_the_culprit(change, message):
    logits, draft, tokens, parents = chain(3)
    args = {"logits": logits, "draft": draft, "tokens": tokens, "parents": parents}
    change(args)
    with pytest.raises(VerifierError, match=message):
        for method in ("token", "block", "traversal"):
            for s in range(20):  # some rows are only read on some paths
                verifier.verify(method, args["logits"], args["draft"], args["tokens"], args["parents"], seed=s)


def test_draft_row_that_does_not_sum_to_one():
    """Rows are validated where they are read in full (a rejection's residual pass)."""
    logits, draft, tokens, parents = chain(2)
    logits[0, 1] = -20.0  # the target rejects the drafted token 1 ...
    draft[0] = 0.0
    draft[0, 1] = 0.5  # ... whose draft row sums to 0.5
    with pytest.raises(VerifierError, match="draft_probs row 0"):
        verifier.verify("token", logits, draft, tokens, parents, seed=0)


@pytest.mark.parametrize("method,tokens,parents,message", [
    ("token", [1, 2], [-1, -1], "method 'token' verifies a single chain.*node 1 is a second child of the root"),
    ("block", [1, 2, 3], [-1, 0, 0], "method 'block' verifies a single chain.*node 2 is a second child of node 0"),
    ("gbv", [1, 2, 3], [-1, 0, -1], r"equal length.*its chains have lengths \[1, 2\]"),
    ("gbv", [1, 2, 3], [-1, 0, 0], "method 'gbv'.*node 2 is a second child of node 0"),
    ("batch", [1, 2, 3, 4], [-1, 0, 0, -1], "method 'batch'.*node 2 is a second child of node 0"),
    ("rrsw", [1, 1], [-1, -1], "without replacement.*node 1 repeats"),
    ("traversal", [1, 2, 2], [-1, 0, 0], "node 2 repeats"),
])
def test_shape_errors(method, tokens, parents, message):
    n = len(tokens)
    logits = RNG.normal(size=(n + 1, V)).astype(np.float32)
    draft = np.full((n + 1, V), 1.0 / V, dtype=np.float32)
    with pytest.raises(VerifierError, match=message):
        verifier.verify(method, logits, draft, tokens, parents, seed=0)


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -1.0}, "temperature must be"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"top_k": -2}, "top_k must be"),
    ({"top_k": 1.5}, "top_k must be"),
    ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
])
def test_bad_sampling_params(kwargs, message):
    """Sampling settings are checked once, when they are made (ConfigError naming the parameter)."""
    with pytest.raises(ConfigError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs))


@pytest.mark.parametrize("kwargs,message", [
    ({"lenience": -1.0}, "lenience must be"),
    ({"uniforms": [0.1, 0.2]}, "uniforms must hold n_nodes \\+ 1 = 4"),
    ({"uniforms": [0.1, 0.2, 1.0, 0.3]}, r"uniforms\[2\] = 1.0 is outside \[0, 1\)"),
    ({"uniforms": [0.1, np.nan, 0.5, 0.3]}, r"uniforms\[1\]"),
])
def test_bad_settings(kwargs, message):
    logits, draft, tokens, parents = chain(3)
    with pytest.raises(VerifierError, match=message):
        verifier.verify("block", logits, draft, tokens, parents, **kwargs)


def test_lenience_only_for_token_and_unknown_method():
    logits, draft, tokens, parents = chain(2)
    with pytest.raises(VerifierError, match="lenience applies to method 'token' only"):
        verifier.verify("block", logits, draft, tokens, parents, lenience=0.1)
    with pytest.raises(VerifierError, match="unknown method 'nope'; choose one of greedy, match"):
        verifier.verify("nope", logits, draft, tokens, parents)


@pytest.mark.parametrize("build,message", [
    (lambda l, d: (l[:3], d), "target_logits has 3 rows; expected 4"),
    (lambda l, d: (l, d[:, :4]), "draft_probs has 4 columns; target_logits has 6"),
    (lambda l, d: (l[0, 0], d), "must be a 2-D array"),
    (lambda l, d: (l, None), "draft_probs is required"),
])
def test_bad_array_shapes(build, message):
    logits, draft, tokens, parents = chain(3)
    lg, dr = build(logits, draft)
    with pytest.raises(VerifierError, match=message):
        verifier.verify("block", lg, dr, tokens, parents)


def test_float64_and_noncontiguous_inputs_are_accepted():
    logits, draft, tokens, parents = chain(3)
    a = verifier.verify("traversal", logits, draft, tokens, parents, seed=9)
    b = verifier.verify("traversal", logits.astype(np.float64), np.asfortranarray(draft), tokens,
                        np.array(parents, dtype=np.int64), seed=9)
    assert a == b


# ----------------------------------------------------------------------------- token masks


def test_pack_mask_layout():
    allowed = np.zeros(40, dtype=bool)
    allowed[[0, 5, 33]] = True
    packed = verifier.pack_mask(allowed)
    assert packed.dtype == np.uint32 and packed.tolist() == [1 | 1 << 5, 1 << 1]  # bit t % 32 of word t // 32
    assert np.array_equal(unpack_mask(packed, 40), allowed)
    rows = np.random.default_rng(1).random((3, 70)) < 0.5
    assert verifier.pack_mask(rows).shape == (3, 3)
    assert np.array_equal(unpack_mask(verifier.pack_mask(rows), 70), rows)
    with pytest.raises(ValueError, match="boolean"):
        verifier.pack_mask(np.ones(5, dtype=np.int64))


@pytest.mark.parametrize("method", verifier.METHODS)
def test_all_zero_mask_row_is_a_clear_error(method):
    logits, draft, tokens, parents = chain(3)
    allowed = np.ones((4, V), dtype=bool)
    allowed[2] = False
    with pytest.raises(VerifierError, match=r"masks row 2 allows no token") as info:
        verifier.verify(method, logits, draft, tokens, parents, seed=0, masks=verifier.pack_mask(allowed))
    assert info.value.status == -13 and info.value.index == 2
    with pytest.raises(VerifierError, match=r"masks row 2 allows no token"):
        verifier.probs(logits, masks=verifier.pack_mask(allowed))


def test_bits_past_the_vocabulary_are_ignored():
    logits, draft, tokens, parents = chain(3)
    masks = np.zeros((4, 1), dtype=np.uint32)
    masks[:, 0] = 0xFFFFFFC0  # only tokens >= 6 = V: no token allowed
    with pytest.raises(VerifierError, match="masks row 0 allows no token"):
        verifier.verify("block", logits, draft, tokens, parents, masks=masks)
    masks[:, 0] |= 1 << 4
    v = verifier.verify("block", logits, draft, tokens, parents, seed=1, masks=masks)
    assert v.token == 4 and v.path == ()  # token 4 is the only allowed token of every row


@pytest.mark.parametrize("method", ["token", "block", "gbv", "rrs", "rrsw", "traversal", "batch", "match", "greedy"])
def test_forbidden_draft_token_is_never_accepted(method):
    """The drafter ignores the mask and is certain of token 1, which the target loves and the
    mask forbids: the rule rejects it every time, and the output token is allowed."""
    logits, _, tokens, parents = chain(2)
    logits[:, 1] = 20.0
    draft = np.zeros((3, V), np.float32)
    draft[:, 1] = 1.0
    tokens = [1, 1]
    allowed = np.ones((3, V), dtype=bool)
    allowed[0, 1] = False
    for s in range(60):
        v = verifier.verify(method, logits, draft, tokens, parents, seed=s, masks=verifier.pack_mask(allowed),
                            sampling=SamplingParams(0.0) if method == "greedy" else SamplingParams(1.0))
        assert v.n_accepted == 0 and v.token != 1


def test_lenience_never_admits_a_forbidden_token():
    logits, _, tokens, parents = chain(1)
    draft = np.zeros((2, V), np.float32)
    draft[:, 1] = 1.0
    tokens = [1]
    allowed = np.ones((2, V), dtype=bool)
    allowed[0, 1] = False
    for s in range(60):
        v = verifier.verify("token", logits, draft, tokens, parents, seed=s, lenience=10.0,
                            masks=verifier.pack_mask(allowed))
        assert v.n_accepted == 0  # unmasked, lenience 10 >= draft 1 would accept every time


def test_greedy_with_masks_is_the_lowest_id_allowed_argmax():
    logits = np.array([[9.0, 3.0, 5.0, 5.0, 5.0, 1.0]], dtype=np.float32)
    cases = {(1, 2, 3, 4): 2, (3, 4, 5): 3, (1, 5): 1, (5,): 5, (0, 1, 2, 3, 4, 5): 0}
    for allowed_ids, expected in cases.items():
        allowed = np.zeros((1, 6), dtype=bool)
        allowed[0, list(allowed_ids)] = True
        m = verifier.pack_mask(allowed)
        assert verifier.verify("greedy", logits, None, [], [], masks=m).token == expected
        assert np.argmax(verifier.probs(logits, sampling=SamplingParams(0.0), masks=m)[0]) == expected
        for k in (1, 2):  # top-k picks among the allowed tokens
            p = verifier.probs(logits, sampling=SamplingParams(1.0, top_k=k), masks=m)[0]
            assert p[expected] > 0 and np.count_nonzero(p) == min(k, len(allowed_ids))
            assert (p[[x for x in range(6) if x not in allowed_ids]] == 0).all()
    # a disallowed token's logit is never read: NaN / inf there are fine, on an allowed one an error
    logits[0, 0] = np.nan
    m = verifier.pack_mask(np.array([[False, True, True, True, True, True]]))
    assert verifier.verify("greedy", logits, None, [], [], masks=m).token == 2
    with pytest.raises(VerifierError, match="row 0 contains NaN"):
        verifier.verify("greedy", logits, None, [], [], masks=verifier.pack_mask(np.ones((1, 6), dtype=bool)))


def test_drafter_draws_from_its_own_masked_distribution():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 70)).astype(np.float32)
    allowed = rng.random((3, 70)) < 0.2
    allowed[:, 0] = True
    p = verifier.probs(logits, masks=verifier.pack_mask(allowed), sampling=SamplingParams(0.8, top_p=0.9))
    assert (p[~allowed] == 0).all() and np.allclose(p.sum(axis=1), 1.0)
    p32 = verifier.probs(logits, masks=verifier.pack_mask(allowed), dtype=np.float32)
    assert p32.dtype == np.float32 and (p32[~allowed] == 0).all()


@pytest.mark.parametrize("build,message", [
    (lambda m: m.astype(np.int64), "masks must have dtype uint32"),
    (lambda m: m.astype(bool), "masks must have dtype uint32"),
    (lambda m: m.tolist(), "masks must be a numpy uint32 array"),
    (lambda m: m[:3], "masks has 3 rows; expected 4"),
    (lambda m: m[:, :0], r"masks has 0 words per row; a vocabulary of 6 needs ceil\(6/32\) = 1"),
    (lambda m: np.repeat(m, 2, axis=1)[:, ::2], "masks rows must be contiguous"),
    (lambda m: m[None], "masks must be a 2-D array"),
])
def test_bad_masks_argument(build, message):
    logits, draft, tokens, parents = chain(3)
    masks = verifier.pack_mask(np.ones((4, V), dtype=bool))
    with pytest.raises(VerifierError, match=message):
        verifier.verify("block", logits, draft, tokens, parents, masks=build(masks))


def test_wider_and_strided_masks_are_the_same():
    logits, draft, tokens, parents = chain(3)
    allowed = np.random.default_rng(3).random((4, V)) < 0.6
    allowed[:, 2] = True
    m = verifier.pack_mask(allowed)
    wide = np.zeros((4, 5), dtype=np.uint32)
    wide[:, :1] = m
    for s in range(20):
        a = verifier.verify("traversal", logits, draft, tokens, parents, seed=s, masks=m)
        assert verifier.verify("traversal", logits, draft, tokens, parents, seed=s, masks=wide) == a
        assert verifier.verify("traversal", logits, draft, tokens, parents, seed=s, masks=wide[:, :1]) == a
