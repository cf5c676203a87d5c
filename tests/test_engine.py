"""The engine on tiny llama.cpp models: lossless at T = 0 and T > 0 for every verifier and
drafter, tree batches equal chains, rollback equals a fresh run, and bad input is refused.

Models are random-weight GGUF files written at test time (tests/conftest.py); the target and
draft share a seed, the draft is the target plus noise.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from localspec.api import generate, stream_generate
from localspec.settings.generation import GenerationConfig
from localspec.errors import ConfigError, ModelError
from localspec.llama.model import Model
from localspec.decoding.pairing import check_pair

import tiny_models as tiny
from conftest import load
from greedy import assert_greedy_equal

PROMPT = "def add(a, b): return a"

# (verifier, drafter, shape keywords): every verifier with every drafter and shape it accepts
CONFIGS = [
    ("greedy", "model", dict(num_draft_tokens=4)),
    ("match", "model", dict(num_draft_tokens=4)),
    ("token", "model", dict(num_draft_tokens=4)),
    ("block", "model", dict(num_draft_tokens=4)),
    ("block", "model", dict(num_draft_tokens=8)),
    ("gbv", "model", dict(num_draft_tokens=4, paths=3)),
    ("batch", "model", dict(num_draft_tokens=4, paths=3)),
    ("rrs", "model", dict(tree=(3, 2, 1))),
    ("rrsw", "model", dict(tree=(3, 2, 1))),
    ("traversal", "model", dict(tree=(3, 2, 1))),
    ("greedy", "model", dict(tree=(2, 2))),
    ("match", "model", dict(tree=(2, 2))),
    ("block", "ngram", dict(num_draft_tokens=4)),
    ("token", "ngram", dict(num_draft_tokens=4)),
    ("match", "ngram", dict(num_draft_tokens=4)),
    ("greedy", "ngram", dict(num_draft_tokens=4)),
    ("block", "hybrid", dict(num_draft_tokens=4)),
    ("traversal", "hybrid", dict(tree=(2, 2))),
    ("gbv", "hybrid", dict(num_draft_tokens=3, paths=2)),
]
IDS = [f"{v}-{d}-{'x'.join(map(str, s['tree'])) if 'tree' in s else str(s.get('paths', 1)) + 'x' + str(s['num_draft_tokens'])}"
       for v, d, s in CONFIGS]
# the n-gram drafter needs a repetitive context to propose anything
NGRAM_PROMPT = "def add(a, b): return a + b. def add(a, b): return a + b. def add(a, b): return"


def tokens_of(target: Model, draft: Model | None, prompt: str, **kw) -> list[int]:
    kw.setdefault("plan", "fixed")  # always speculate (the planner may decline on tiny models)
    return [r.token for r in stream_generate(target, draft, prompt, **kw) if r.token is not None]


# ---------------------------------------------------------------- T = 0: token-identical


@pytest.mark.parametrize("verifier,drafter,shape", CONFIGS[:4] + CONFIGS[7:8] + CONFIGS[12:13] + CONFIGS[16:19],
                         ids=IDS[:4] + IDS[7:8] + IDS[12:13] + IDS[16:19])
def test_planned_speculation_equals_target_greedy(tiny_target: Model, tiny_draft: Model,
                                                  verifier: str, drafter: str, shape: dict) -> None:
    """plan="auto" (the default) picks each step's depth from costs; the output is unchanged."""
    for prompt in (PROMPT, NGRAM_PROMPT):
        plain = tokens_of(tiny_target, None, prompt, temperature=0, max_tokens=40)
        spec = tokens_of(tiny_target, tiny_draft, prompt, temperature=0, max_tokens=40,
                         verifier=verifier, drafter=drafter, plan="auto", **shape)
        assert_greedy_equal(tiny_target, prompt, spec, plain)


@pytest.mark.parametrize("verifier,drafter,shape", CONFIGS, ids=IDS)
def test_greedy_speculation_equals_target_greedy(tiny_target: Model, tiny_draft: Model,
                                                 verifier: str, drafter: str, shape: dict) -> None:
    for prompt in (PROMPT, NGRAM_PROMPT):
        plain = tokens_of(tiny_target, None, prompt, temperature=0, max_tokens=40)
        spec = tokens_of(tiny_target, tiny_draft, prompt, temperature=0, max_tokens=40,
                         verifier=verifier, drafter=drafter, **shape)
        assert_greedy_equal(tiny_target, prompt, spec, plain, f"{verifier}/{drafter} {shape} diverged from "
                            "target-only greedy")


def test_greedy_speculation_accepts_drafts(tiny_target: Model, tiny_draft: Model) -> None:
    """Not vacuous: the draft's tokens are accepted most of the time (85 % agreement)."""
    last = list(stream_generate(tiny_target, tiny_draft, PROMPT, temperature=0, max_tokens=60,
                                drafter="model", num_draft_tokens=4, plan="fixed"))[-1]
    assert last.stats.block_efficiency > 1.8
    assert last.stats.acceptance_rate > 0.4
    ngram = list(stream_generate(tiny_target, None, NGRAM_PROMPT, temperature=0, max_tokens=40,
                                 drafter="ngram", plan="fixed"))[-1]
    assert ngram.stats.accepted_tokens > 0


# ---------------------------------------------------------------- T > 0: same distribution

N_SPEC = 700  # generations per speculative configuration
N_PLAIN = 2100  # target-only generations (shared by all configurations)
ALPHA = 1e-3  # false-positive rate of each two-sample test (a correct engine fails 1 in 1000 seeds)
N_FIRST = 3  # the statistic: the first 3 generated tokens (they span the first draft block)
SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
DIST_CONFIGS = [
    ("match", "model", dict(num_draft_tokens=3)),
    ("token", "model", dict(num_draft_tokens=3)),
    ("block", "model", dict(num_draft_tokens=3)),
    ("gbv", "model", dict(num_draft_tokens=3, paths=2)),
    ("batch", "model", dict(num_draft_tokens=3, paths=2)),
    ("rrs", "model", dict(tree=(2, 2))),
    ("rrsw", "model", dict(tree=(2, 2))),
    ("traversal", "model", dict(tree=(2, 2))),
    ("block", "hybrid", dict(num_draft_tokens=3)),
    ("block", "model", dict(num_draft_tokens=3, plan="auto")),
]
N_BINS = 53


def first_tokens_key(target: Model, draft: Model | None, seed: int, prompt: str = "ab",
                     **kw) -> tuple[int, ...]:
    kw.setdefault("plan", "fixed")
    out = []
    for r in stream_generate(target, draft, prompt, max_tokens=N_FIRST, seed=seed, **SAMPLING, **kw):
        out.append(r.token)
    return tuple(out)


def bins(samples: list[tuple[int, ...]]) -> Counter:
    """A fixed function of the first tokens: the first token exactly (its frequent values) and a
    hash of the rest. Any function of the output must have the same law under both samplers."""
    return Counter((s[0], hash(s[1:]) % N_BINS) for s in samples)


def two_sample_p(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> float:
    ca, cb = bins(a), bins(b)
    keys = sorted(set(ca) | set(cb))
    table = np.array([[ca[k] for k in keys], [cb[k] for k in keys]], dtype=float)
    # pool categories with small expected counts into one (keeps the chi-square approximation valid)
    expected = table.sum(0) * table.sum(1, keepdims=True) / table.sum()
    small = expected.min(0) < 5
    pooled = np.column_stack([table[:, ~small], table[:, small].sum(1)]) if small.any() else table
    return float(stats.chi2_contingency(pooled)[1])


@pytest.fixture(scope="module")
def plain_samples(tiny_target: Model) -> list[tuple[int, ...]]:
    return [first_tokens_key(tiny_target, None, 10**6 + i) for i in range(N_PLAIN)]


@pytest.mark.parametrize("verifier,drafter,shape", DIST_CONFIGS,
                         ids=[f"{v}-{d}" + ("-tree" if "tree" in s else "") for v, d, s in DIST_CONFIGS])
def test_first_tokens_follow_target_distribution(tiny_target: Model, far_draft: Model, plain_samples,
                                                 verifier: str, drafter: str, shape: dict) -> None:
    spec = [first_tokens_key(tiny_target, far_draft, i, verifier=verifier, drafter=drafter, **shape)
            for i in range(N_SPEC)]
    p = two_sample_p(spec, plain_samples)
    assert p > ALPHA, f"{verifier}/{drafter}: first-token distribution differs from the target's (p={p:.2e})"


def test_ngram_drafts_keep_the_target_distribution(tiny_target: Model) -> None:
    """One-hot n-gram proposals on a repetitive prompt (they are proposed and partly accepted)."""
    prompt = "ab ab ab ab ab ab ab ab ab"
    plain = [first_tokens_key(tiny_target, None, 10**6 + i, prompt) for i in range(N_PLAIN)]
    runs = [list(stream_generate(tiny_target, None, prompt, max_tokens=N_FIRST, seed=i, drafter="ngram",
                                 verifier="block", num_draft_tokens=3, plan="fixed", **SAMPLING))
            for i in range(N_SPEC)]
    assert sum(r[-1].stats.drafted_tokens for r in runs) > N_SPEC  # the n-gram drafter did propose
    spec = [tuple(x.token for x in r) for r in runs]
    p = two_sample_p(spec, plain)
    assert p > ALPHA, f"n-gram drafting changed the first-token distribution (p={p:.2e})"


def test_negative_control_lossy_verifier_fails(tiny_target: Model, far_draft: Model, plain_samples) -> None:
    """The same test catches a lossy verifier: lenience over-accepts the draft's tokens."""
    spec = [first_tokens_key(tiny_target, far_draft, i, verifier="token", num_draft_tokens=3, lenience=0.9)
            for i in range(N_SPEC)]
    assert two_sample_p(spec, plain_samples) < ALPHA


def test_negative_control_draft_distribution_fails(tiny_target: Model, far_draft: Model,
                                                   plain_samples) -> None:
    """... and sampling from the draft model instead of the target."""
    draft_only = [first_tokens_key(far_draft, None, i) for i in range(N_SPEC)]
    assert two_sample_p(draft_only, plain_samples) < ALPHA


def test_same_seed_same_output(tiny_target: Model, tiny_draft: Model) -> None:
    kw = dict(max_tokens=30, seed=7, temperature=0.9, verifier="traversal", tree=(2, 2), plan="fixed")
    assert generate(tiny_target, tiny_draft, PROMPT, **kw) == generate(tiny_target, tiny_draft, PROMPT, **kw)


# ---------------------------------------------------------------- KV cache: trees and rollback


def test_tree_batch_logits_equal_chain_logits(tiny_paths: tuple[Path, Path]) -> None:
    """One decode of a 2x2 tree (branches as KV sequences) gives every node the logits a plain
    sequential chain decode gives it (F32 KV, flash attention off)."""
    with load(tiny_paths[0]) as m:
        prompt = m.tokenize(PROMPT)
        L = len(prompt)
        a, b, aa, ab, ba, bb = 300, 301, 302, 303, 304, 305
        m.prefill(prompt[:-1], 0)
        for s in (1, 2, 3):
            m.seq_cp(0, s)
        m.decode([prompt[-1], a, b, aa, ab, ba, bb], [L - 1, L, L, L + 1, L + 1, L + 1, L + 1],
                 [(0, 1, 2, 3), (0, 1), (2, 3), (0,), (1,), (2,), (3,)])
        tree = m.logits_array(7).copy()
        rows = {(): 0, (a,): 1, (b,): 2, (a, aa): 3, (a, ab): 4, (b, ba): 5, (b, bb): 6}
        for path in [(a, aa), (a, ab), (b, ba), (b, bb)]:
            m.clear()
            m.prefill(prompt[:-1], 0)
            m.decode([prompt[-1], *path], range(L - 1, L + 2))
            chain = m.logits_array(3)
            for depth in range(3):
                np.testing.assert_allclose(tree[rows[path[:depth]]], chain[depth], rtol=0, atol=1e-4,
                                           err_msg=f"node {path[:depth]}")


def test_rollback_then_redecode_equals_fresh_run(tiny_paths: tuple[Path, Path]) -> None:
    with load(tiny_paths[0]) as m:
        prompt = m.tokenize(PROMPT)
        L = len(prompt)
        m.prefill(prompt, 0)
        m.decode([310, 311, 312], range(L, L + 3))  # drafts that get rejected
        m.seq_rm(0, L, -1)
        m.decode([320, 321], range(L, L + 2))
        rolled = m.logits_array(2).copy()
        m.clear()
        m.prefill(prompt, 0)
        m.decode([320, 321], range(L, L + 2))
        np.testing.assert_allclose(rolled, m.logits_array(2), rtol=0, atol=1e-5)


def test_reused_prompt_prefix_equals_fresh_run(tiny_target: Model, tiny_draft: Model) -> None:
    """Two generations in a row share the KV prefix; the second equals one on fresh models."""
    kw = dict(temperature=0, max_tokens=20, verifier="rrsw", tree=(2, 2))
    tokens_of(tiny_target, tiny_draft, PROMPT + " + b", **kw)
    shared = tiny_target.tokenize(PROMPT)
    first = next(s for s in tiny_target.sequences if s.tokens[: len(shared) - 1] == shared[:-1])  # its slot
    assert first.n_cached > 0 and first.n_cached <= len(first.tokens)  # left for the second to reuse
    reused = tokens_of(tiny_target, tiny_draft, PROMPT + " * b", **kw)
    tiny_target.clear()
    tiny_draft.clear()
    # the shared prefix was decoded in another batch than a fresh prompt's: equal up to a near-tie
    assert_greedy_equal(tiny_target, PROMPT + " * b", reused, tokens_of(tiny_target, tiny_draft, PROMPT + " * b", **kw))


def test_context_full_stops_with_length(tiny_paths: tuple[Path, Path]) -> None:
    with load(tiny_paths[0], n_ctx=32) as t, load(tiny_paths[1], n_ctx=32) as d:
        prompt = t.tokenize(PROMPT)
        out = list(stream_generate(t, d, PROMPT, temperature=0, max_tokens=500, num_draft_tokens=6,
                                   plan="fixed"))
        assert out[-1].finish_reason == "length"
        generated = [r.token for r in out if r.token is not None]
        assert len(prompt) + len(generated) == t.n_ctx + 1  # the last token needs no KV cell
        plain = tokens_of(t, None, PROMPT, temperature=0, max_tokens=500)
        assert_greedy_equal(t, PROMPT, generated, plain)


# ---------------------------------------------------------------- stop conditions


def test_max_tokens_and_stop_strings(tiny_target: Model, tiny_draft: Model) -> None:
    full = generate(tiny_target, tiny_draft, PROMPT, temperature=0, max_tokens=40)
    out = list(stream_generate(tiny_target, tiny_draft, PROMPT, temperature=0, max_tokens=7))
    assert len(out) == 7 and out[-1].finish_reason == "length"
    stop = full[5:8]
    cut = list(stream_generate(tiny_target, tiny_draft, PROMPT, temperature=0, max_tokens=40, stop=[stop]))
    text = "".join(r.text for r in cut)
    assert cut[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]


def test_end_of_generation_token_stops(tiny_target: Model, tiny_draft: Model) -> None:
    """A chat prompt: the tiny models end a reply with <|im_end|> (an EOG token) eventually."""
    messages = [{"role": "user", "content": "hi"}]
    for seed in range(40):
        out = list(stream_generate(tiny_target, tiny_draft, messages, temperature=1.0, top_k=0,
                                   top_p=1.0, min_p=0.0, max_tokens=200, seed=seed))
        if out[-1].finish_reason == "stop":
            assert tiny_target.is_eog(out[-1].token)
            # the EOG token adds no text of its own; the last response only flushes bytes still held
            # back (a character left incomplete by the tokens before it becomes U+FFFD)
            before = b"".join(tiny_target.token_bytes(r.token) for r in out[:-1])
            assert "".join(r.text for r in out) == before.decode("utf-8", errors="replace")
            return
    pytest.fail("no generation ended with an end-of-generation token")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("load_mode", ["mmap", "auto"])
def test_load_modes_give_the_same_logits(tiny_paths: tuple[Path, Path], load_mode: str) -> None:
    """Weights read into memory (the default) or mapped from the file compute the same logits."""
    with load(tiny_paths[0], load_mode="read") as read, load(tiny_paths[0], load_mode=load_mode) as other:
        prompt = read.tokenize(PROMPT)
        read.prefill(prompt, 0)
        other.prefill(prompt, 0)
        np.testing.assert_array_equal(read.logits_array(1), other.logits_array(1))


def test_quantized_kv_cache_needs_flash_attention(tiny_paths: tuple[Path, Path]) -> None:
    with pytest.raises(ConfigError, match="q8_0 .*needs flash attention"):
        load(tiny_paths[0], cache_type="q8_0", flash_attn="off")
    # the tiny models' heads are too small for q8_0 blocks: a clear error, not a crash
    with pytest.raises(ModelError, match="try --cache-type f16"):
        load(tiny_paths[0], cache_type="q8_0", flash_attn="auto")


def test_bad_load_mode(tiny_paths: tuple[Path, Path]) -> None:
    with pytest.raises(ConfigError, match="load_mode must be one of .*got .lazy."):
        load(tiny_paths[0], load_mode="lazy")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="model file not found: .*nope.gguf"):
        load(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(ModelError, match="weights.gguf is not a GGUF file"):
        load(bad)


def test_truncated_gguf_file(tmp_path: Path, tiny_paths: tuple[Path, Path]) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_paths[0].read_bytes()[:5000])
    with pytest.raises(ModelError, match="could not load .*cut.gguf"):
        load(bad)


def test_vocab_mismatched_pair(tmp_path: Path, tiny_target: Model) -> None:
    with load(tiny.make_mismatched_draft(tmp_path)) as other:
        with pytest.raises(ModelError, match=r"cannot draft for target .*: token \d+ is"):
            check_pair(tiny_target, other)
        with pytest.raises(ModelError, match="cannot draft for target"):
            generate(tiny_target, other, PROMPT, max_tokens=3)


def test_prompt_longer_than_context(tiny_paths: tuple[Path, Path]) -> None:
    with load(tiny_paths[0], n_ctx=256) as t:
        with pytest.raises(ModelError, match=r"the prompt has \d+ tokens but the context holds 256"):
            generate(t, None, PROMPT * 30, max_tokens=3)


def test_batch_larger_than_n_batch_is_an_error_not_an_abort(tiny_paths: tuple[Path, Path]) -> None:
    """llama.cpp caps n_batch at the requested context (32 cells here: one slot) and aborts the
    process beyond it."""
    with load(tiny_paths[0], n_ctx=32, parallel=1) as t:
        assert t.n_batch == 32
        with pytest.raises(ModelError, match="exceed n_batch=32"):
            t.decode(list(range(300, 340)), range(40))
        prompt = t.tokenize(PROMPT * 4)
        assert len(prompt) > 32
        assert generate(t, None, PROMPT * 4, max_tokens=3, temperature=0)  # prefilled in chunks


def test_tree_too_large(tiny_target: Model, tiny_draft: Model) -> None:
    with pytest.raises(ConfigError, match="n_batch"):
        generate(tiny_target, tiny_draft, PROMPT, verifier="traversal", tree=(2, 2, 2, 2) + (1,) * 15)  # 270 nodes
    with pytest.raises(ConfigError, match="branches"):
        generate(tiny_target, tiny_draft, PROMPT, verifier="traversal", tree=(16, 8))


@pytest.mark.parametrize("kw,message", [
    (dict(verifier="nope"), "verifier must be one of greedy, .*, got 'nope'"),
    (dict(verifier="block", paths=3), "verifies one chain"),
    (dict(verifier="gbv", tree=(2, 2)), "takes K paths"),
    (dict(verifier="rrsw", paths=2), "without replacement"),
    (dict(drafter="ngram", paths=2, verifier="gbv"), "n-gram drafter proposes a single chain"),
    (dict(drafter="psychic"), "drafter must be one of"),
    (dict(lenience=0.5, verifier="block"), "needs verifier 'token'"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens must be an integer in"),
    (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*64\)"),
    (dict(num_draft_tokens=-1), "num_draft_tokens"),
])
def test_bad_settings(tiny_target: Model, tiny_draft: Model, kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        generate(tiny_target, tiny_draft, PROMPT, **{"max_tokens": 3, **kw})


def test_bad_prompt(tiny_target: Model) -> None:
    with pytest.raises(ModelError, match="empty"):
        generate(tiny_target, None, [], max_tokens=3)
    with pytest.raises(ModelError, match="token ids in"):
        generate(tiny_target, None, [1, 99999], max_tokens=3)


def test_recurrent_model_refused(tmp_path: Path) -> None:
    path = tiny.write_tiny_recurrent(tmp_path / "mamba.gguf")
    with pytest.raises(ModelError, match="recurrent/hybrid model .* cannot roll back"):
        load(path)


def test_hybrid_without_draft_model(tiny_target: Model) -> None:
    with pytest.raises(ConfigError, match="needs a draft model"):
        generate(tiny_target, None, PROMPT, drafter="hybrid", max_tokens=3)


def test_combine_sums_generations() -> None:
    from localspec.decoding.stats import GenerationStats, combine

    a = GenerationStats(5, 10, 4, 12, 6, 0.1, 1.0, 0.2, 0.6, 0.05, (1, 0, 3))
    b = GenerationStats(7, 6, 6, 0, 0, 0.2, 0.5, 0.0, 0.4, 0.01, ())
    t = combine([a, b])
    assert (t.prompt_tokens, t.generated_tokens, t.target_passes, t.drafted_tokens, t.accepted_tokens) == \
        (12, 16, 10, 12, 6)
    assert t.accept_histogram == (1, 0, 3)
    assert t.tokens_per_second == pytest.approx(16 / 1.5)
    assert t.block_efficiency == pytest.approx(1.6)
    assert t.verifier_share == pytest.approx(0.06 / 1.26)
    assert combine([]).generated_tokens == 0


def test_a_context_beyond_the_machines_memory_is_refused_before_allocating(tiny_paths: tuple[Path, Path],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from localspec.llama import host

    with load(tiny_paths[0]) as m:
        per_cell = m.kv_bytes(1)
        assert per_cell == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16 dims, f32
    monkeypatch.setattr(host, "available_memory", lambda: 100 * per_cell)
    with pytest.raises(ModelError, match=r"ctx_size=4096 needs .* use --ctx-size 16 or less"):
        load(tiny_paths[0], n_ctx=4096)
    with load(tiny_paths[0], n_ctx=64):  # what fits loads
        pass


@pytest.mark.parametrize("options,param", [
    (dict(max_tokens=2**31), "max_tokens"), (dict(top_k=2**40), "top_k"), (dict(temperature=1e-300), "temperature"),
    (dict(stop=["x"] * 17), "stop"), (dict(stop=["x" * 257]), "stop"),
])
def test_settings_past_what_the_code_underneath_holds_are_refused(options: dict, param: str) -> None:
    with pytest.raises(ConfigError) as exc:
        GenerationConfig.from_options(**options)
    assert exc.value.param == param


@pytest.mark.parametrize("options,param", [(dict(ctx_size=2**40), "ctx_size"), (dict(threads=10**9), "threads"),
                                           (dict(n_gpu_layers=2**33), "n_gpu_layers")])
def test_model_options_past_int32_are_refused(options: dict, param: str) -> None:
    from localspec.settings.models import ModelOptions

    with pytest.raises(ConfigError) as exc:
        ModelOptions(**options)
    assert exc.value.param == param


def test_two_generations_on_one_model_run_side_by_side(tiny_target: Model, tiny_draft: Model) -> None:
    """A generator started while another is unfinished, and another thread's, run in slots of
    their own: each gives what it gives alone (greedy, up to near ties of batch shapes)."""
    import threading

    first = iter(stream_generate(tiny_target, tiny_draft, PROMPT, temperature=0, max_tokens=20, plan="fixed"))
    head = next(first)  # under way
    second = [r.token for r in stream_generate(tiny_target, None, PROMPT, temperature=0, max_tokens=5)]
    results: list[list[int | None]] = []
    t = threading.Thread(target=lambda: results.append(
        [r.token for r in stream_generate(tiny_target, tiny_draft, PROMPT, temperature=0, max_tokens=5)]))
    t.start()
    t.join()
    rest = list(first)  # the first goes on, unharmed
    plain = tokens_of(tiny_target, None, PROMPT, temperature=0, max_tokens=20)
    got = [r.token for r in [head, *rest] if r.token is not None]
    assert_greedy_equal(tiny_target, PROMPT, got, plain)
    assert_greedy_equal(tiny_target, PROMPT, [x for x in second if x is not None], plain[:5])
    assert_greedy_equal(tiny_target, PROMPT, [x for x in results[0] if x is not None], plain[:5])


def test_a_closed_model_raises_a_model_error(tiny_paths: tuple[Path, Path]) -> None:
    m = load(tiny_paths[0])
    m.close()
    for use in (lambda: m.tokenize("ab"), lambda: m.decode([1], [0]), lambda: m.chat_template, lambda: m.is_eog(2),
                lambda: list(stream_generate(m, None, "ab", max_tokens=2))):
        with pytest.raises(ModelError, match="is closed"):
            use()
