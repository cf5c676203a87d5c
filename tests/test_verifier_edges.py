"""Edge cases and bad input: clear VerifierError messages, never a crash."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.verify import verifier
from localspec.config import SamplingParams
from localspec.errors import ConfigError
from localspec.verify.verifier import LogitsPointer, VerifierError

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
    assert v == verifier.Verdict((), 1, 0)
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
