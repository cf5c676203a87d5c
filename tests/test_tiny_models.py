"""The tiny random-weight GGUF models (tests/tiny_models.py, on localspec.llama.tiny_model) load and
behave in llama.cpp.

Everything goes through llama-cpp-python's low-level API, and every llama.cpp object created
here is freed again, so the file can run many times in a row in one process.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pytest

pytest.importorskip("gguf")
import llama_cpp as lc  # noqa: E402

import tiny_models as tiny  # noqa: E402

N_CONTEXTS = 200  # random contexts for the agreement statistics
AGREEMENT_005 = (0.72, 0.96)  # measured 0.845-0.87 for seeds 0-3 (binomial sd ~0.025 at n=200)


@lc.llama_log_callback
def _no_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Swallow llama.cpp's log lines (the callback object must stay alive: module global)."""


lc.llama_log_set(_no_log, ctypes.c_void_p(0))
lc.llama_backend_init()


# ---------------------------------------------------------------- llama.cpp helpers


class Loaded:
    """A model with a small F32-KV, flash-attention-off context (exact, deterministic logits)."""

    def __init__(self, model: int, ctx: int) -> None:
        self.model = model
        self.ctx = ctx
        self.vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))


@contextmanager
def loaded(path: Path, n_ctx: int = 256) -> Iterator[Loaded]:
    """Load ``path`` and a context; free both on exit, whatever happens."""
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    assert model, f"llama.cpp could not load {path}"
    ctx = None
    try:
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = 64
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = 2
        params.type_k = params.type_v = lc.GGML_TYPE_F32
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        ctx = lc.llama_init_from_model(model, params)
        assert ctx, f"llama.cpp could not create a context for {path}"
        yield Loaded(model, ctx)
    finally:
        if ctx:
            lc.llama_free(ctx)
        lc.llama_model_free(model)


def tokenize(m: Loaded, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
    """Text -> token ids."""
    data = text.encode()
    buf = (lc.llama_token * (len(data) + 8))()
    n = lc.llama_tokenize(m.vocab, data, len(data), buf, len(buf), add_special, parse_special)
    assert n >= 0
    return list(buf[:n])


def detokenize(m: Loaded, tokens: Sequence[int], *, remove_special: bool = True,
               unparse_special: bool = False) -> str:
    """Token ids -> text (llama_detokenize)."""
    arr = (lc.llama_token * max(1, len(tokens)))(*tokens)
    buf = ctypes.create_string_buffer(16 * len(tokens) + 16)
    n = lc.llama_detokenize(m.vocab, arr, len(tokens), buf, len(buf), remove_special, unparse_special)
    assert n >= 0
    return buf.raw[:n].decode("utf-8")


def piece(m: Loaded, token: int) -> bytes:
    """The bytes of one token (special tokens rendered)."""
    buf = ctypes.create_string_buffer(64)
    n = lc.llama_token_to_piece(m.vocab, token, buf, len(buf), 0, True)
    assert n >= 0
    return buf.raw[:n]


def token_text(m: Loaded, token: int) -> bytes:
    """The vocabulary entry of a token (e.g. ``<0x41>``, ``▁the``)."""
    return lc.llama_vocab_get_text(m.vocab, token)


def decode(m: Loaded, tokens: Sequence[int], *, start: int = 0, all_logits: bool = False,
           clear: bool = True) -> np.ndarray:
    """Decode ``tokens`` at positions ``start..`` of sequence 0; return logits rows (copies)."""
    if clear:
        lc.llama_memory_clear(lc.llama_get_memory(m.ctx), True)
    n = len(tokens)
    batch = lc.llama_batch_init(n, 0, 1)
    try:
        for i, tok in enumerate(tokens):
            batch.token[i] = tok
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits or i == n - 1
        batch.n_tokens = n
        assert lc.llama_decode(m.ctx, batch) == 0
        rows = range(n) if all_logits else [n - 1]
        return np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(m.ctx, i), shape=(m.n_vocab,)).copy()
                         for i in rows])
    finally:
        lc.llama_batch_free(batch)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64."""
    z = logits.astype(np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def entropy(probs: np.ndarray) -> np.ndarray:
    """Row-wise entropy in nats."""
    return -(probs * np.log(np.where(probs > 0, probs, 1.0))).sum(axis=-1)


def random_contexts(n: int, seed: int, n_vocab: int = 404) -> list[list[int]]:
    """``n`` random token contexts: BOS + 1..23 random normal/byte tokens."""
    rng = np.random.default_rng(seed)
    return [[tiny.BOS_ID] + [int(t) for t in rng.integers(3, n_vocab, size=rng.integers(1, 24))]
            for _ in range(n)]


def top1(path: Path, contexts: list[list[int]]) -> np.ndarray:
    """Argmax of the next-token logits after each context."""
    with loaded(path) as m:
        return np.array([int(decode(m, c)[0].argmax()) for c in contexts])


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """All tiny models, written once per session."""
    d = tmp_path_factory.mktemp("tiny_models")
    target, draft = tiny.make_pair(d, seed=0, noise=0.05)
    return {
        "target": target,
        "draft": draft,
        "draft0": tiny.write_tiny_model(d / "draft-n0.gguf", seed=0, noise=0.0),
        "draft05": tiny.write_tiny_model(d / "draft-n0.5.gguf", seed=0, noise=0.5),
        "other_seed": tiny.write_tiny_model(d / "seed1.gguf", seed=1),
        "mismatched": tiny.make_mismatched_draft(d, seed=0),
        "no_template": tiny.write_tiny_model(d / "no-template.gguf", chat_template=False),
        "recurrent": tiny.write_tiny_recurrent(d / "mamba.gguf"),
    }


@pytest.fixture(scope="session")
def contexts() -> list[list[int]]:
    return random_contexts(N_CONTEXTS, seed=1234)


@pytest.fixture(scope="session")
def target_top1(tiny_files: dict[str, Path], contexts: list[list[int]]) -> np.ndarray:
    return top1(tiny_files["target"], contexts)


@pytest.fixture()
def target(tiny_files: dict[str, Path]) -> Iterator[Loaded]:
    with loaded(tiny_files["target"]) as m:
        yield m


# ---------------------------------------------------------------- files


def test_deterministic_files(tiny_files: dict[str, Path], tmp_path: Path) -> None:
    again = tiny.write_tiny_model(tmp_path / "again.gguf", seed=0)
    assert again.read_bytes() == tiny_files["target"].read_bytes()
    assert tiny_files["draft0"].read_bytes() == tiny_files["target"].read_bytes()
    assert tiny_files["draft"].read_bytes() != tiny_files["target"].read_bytes()
    assert tiny_files["other_seed"].read_bytes() != tiny_files["target"].read_bytes()


def test_draft_is_target_plus_scaled_noise(tiny_files: dict[str, Path]) -> None:
    import gguf

    t = {x.name: np.array(x.data) for x in gguf.GGUFReader(tiny_files["target"]).tensors}
    d = {x.name: np.array(x.data) for x in gguf.GGUFReader(tiny_files["draft"]).tensors}
    assert t.keys() == d.keys()
    for name in ("token_embd.weight", "blk.1.attn_q.weight", "output.weight"):
        assert t[name].shape == d[name].shape
        rel = (d[name] - t[name]).std() / t[name].std()
        assert rel == pytest.approx(0.05, rel=0.05), name


def test_tensor_layout(tiny_files: dict[str, Path]) -> None:
    import gguf

    shapes = {x.name: tuple(int(s) for s in x.shape) for x in gguf.GGUFReader(tiny_files["target"]).tensors}
    # ggml order (ne0 first): token_embd {n_embd, n_vocab}, attn_k {n_embd, n_head_kv * head_dim}
    assert shapes["token_embd.weight"] == (64, 406)
    assert shapes["output.weight"] == (64, 406)
    assert shapes["blk.0.attn_q.weight"] == (64, 64)
    assert shapes["blk.0.attn_k.weight"] == (64, 32)
    assert shapes["blk.0.ffn_down.weight"] == (128, 64)
    assert len(shapes) == 2 + 2 * 9 + 1


def test_loads_fast(tiny_files: dict[str, Path]) -> None:
    t0 = time.perf_counter()
    with loaded(tiny_files["target"]) as m:
        elapsed = time.perf_counter() - t0
        assert m.n_vocab == 406
    assert elapsed < 0.25, f"load + context took {elapsed:.3f} s"


def test_repeated_load_and_free(tiny_files: dict[str, Path]) -> None:
    for i in range(20):
        with loaded(tiny_files["target" if i % 2 else "draft"]) as m:
            assert np.isfinite(decode(m, [tiny.BOS_ID, 300])).all()


# ---------------------------------------------------------------- vocabulary


def test_vocab_layout(target: Loaded) -> None:
    v = target.vocab
    assert target.n_vocab == tiny.VOCABS["spm406"].size == 406
    assert lc.llama_vocab_type(v) == lc.LLAMA_VOCAB_TYPE_SPM
    assert (lc.llama_vocab_bos(v), lc.llama_vocab_eos(v), lc.llama_vocab_eot(v)) == (1, 2, 405)
    assert lc.llama_vocab_get_add_bos(v) and not lc.llama_vocab_get_add_eos(v)
    assert [lc.llama_vocab_is_eog(v, t) for t in (1, 2, 404, 405, 300)] == [False, True, False, True, False]
    assert [token_text(target, t) for t in (0, 1, 2, 3, 258, 404, 405)] == [
        b"<unk>", b"<s>", b"</s>", b"<0x00>", b"<0xFF>", b"<|im_start|>", b"<|im_end|>"]
    assert lc.llama_vocab_is_control(v, 404) and lc.llama_vocab_is_control(v, 405)
    assert lc.llama_vocab_get_attr(v, 3 + 0x41) & lc.LLAMA_TOKEN_ATTR_BYTE
    assert lc.llama_vocab_get_attr(v, 300) & lc.LLAMA_TOKEN_ATTR_NORMAL
    assert piece(target, 3 + 0x41) == b"A"  # a byte token renders as its byte


@pytest.mark.parametrize("text", [
    "Hello world, write a python function",
    "def add(a, b):\n\treturn a + b  # two  spaces",
    "héllo wörld ✓ 日本語 🙂",
    "Ünïcödé at the start, and the end: ß",
    "",
])
def test_round_trip(target: Loaded, text: str) -> None:
    tokens = tokenize(target, text)
    assert tokens[0] == tiny.BOS_ID
    # llama.cpp strips the space prefix only when the first token is not BOS
    assert detokenize(target, tokens[1:]) == text
    joined = b"".join(piece(target, t) for t in tokens[1:]).decode()
    assert joined == (" " + text if text else "")  # the SPM space prefix, as a piece


def test_text_splits_into_pieces(target: Loaded) -> None:
    text = "Hello world, write a python function"
    tokens = tokenize(target, text, add_special=False)
    pieces = [piece(target, t) for t in tokens]
    assert 5 <= len(tokens) < len(text) // 2
    assert b" write" in pieces and b" function" in pieces
    assert all(t >= tiny.FIRST_BYTE_ID for t in tokens)


def test_non_ascii_uses_byte_fallback(target: Loaded) -> None:
    tokens = tokenize(target, "日", add_special=False)
    byte_ids = [3 + b for b in "日".encode()]
    assert tokens[-3:] == byte_ids


def test_special_tokens_parse(target: Loaded) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    parsed = tokenize(target, text, add_special=False, parse_special=True)
    assert parsed[0] == 404 and parsed[-1] == 405
    literal = tokenize(target, text, add_special=False, parse_special=False)
    assert 404 not in literal and 405 not in literal


# ---------------------------------------------------------------- chat template


def test_chat_template(target: Loaded) -> None:
    template = lc.llama_model_chat_template(target.model, None)
    assert template == tiny.CHATML_TEMPLATE.encode()
    msgs = (lc.llama_chat_message * 2)(
        lc.llama_chat_message(role=b"system", content=b"Be brief."),
        lc.llama_chat_message(role=b"user", content=b"Hi there"),
    )
    buf = ctypes.create_string_buffer(1024)
    n = lc.llama_chat_apply_template(template, msgs, 2, True, buf, len(buf))
    assert 0 < n <= len(buf)
    assert buf.raw[:n].decode() == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    tokens = tokenize(target, buf.raw[:n].decode(), parse_special=True)
    assert tokens.count(404) == 3 and tokens.count(405) == 2


def test_no_chat_template(tiny_files: dict[str, Path]) -> None:
    with loaded(tiny_files["no_template"]) as m:
        assert lc.llama_model_chat_template(m.model, None) is None


# ---------------------------------------------------------------- logits


def test_decode_gives_finite_logits(target: Loaded) -> None:
    tokens = tokenize(target, "Hello world, write a python function")[:9]
    rows = decode(target, tokens, all_logits=True)
    assert rows.shape == (9, 406) and rows.dtype == np.float32
    assert np.isfinite(rows).all()
    # a batch of 9 gives the same logits as 9 incremental single-token decodes (F32 KV)
    lc.llama_memory_clear(lc.llama_get_memory(target.ctx), True)
    for i, tok in enumerate(tokens):
        single = decode(target, [tok], start=i, clear=False)[0]
        np.testing.assert_allclose(single, rows[i], rtol=1e-4, atol=1e-4)


def test_distribution_is_reasonable(target: Loaded, contexts: list[list[int]]) -> None:
    probs = softmax(np.concatenate([decode(target, c) for c in contexts[:60]]))
    ent, top = entropy(probs), probs.max(axis=1)
    assert 1.8 < ent.mean() < 4.0, ent.mean()  # measured 2.7 (uniform would be 6.0)
    assert 0.15 < top.mean() < 0.6, top.mean()  # measured 0.35
    assert np.median(top) < 0.6 and (top > 0.99).mean() < 0.05
    assert len(set(probs.argmax(axis=1))) > 20  # not one favourite token


def test_distribution_depends_on_context(target: Loaded) -> None:
    rng = np.random.default_rng(7)
    tv, same = [], []
    for _ in range(40):
        a = [tiny.BOS_ID] + [int(t) for t in rng.integers(3, 404, size=8)]
        b = [tiny.BOS_ID] + [int(t) for t in rng.integers(3, 404, size=7)] + [a[-1]]
        pa, pb = softmax(decode(target, a)[0]), softmax(decode(target, b)[0])
        tv.append(0.5 * np.abs(pa - pb).sum())
        same.append(pa.argmax() == pb.argmax())
    # same last token, different earlier tokens: clearly different distributions
    assert np.mean(tv) > 0.15, np.mean(tv)  # measured ~0.33
    assert np.mean(same) < 0.8


# ---------------------------------------------------------------- target / draft agreement


def test_agreement_noise_zero(tiny_files: dict[str, Path], contexts: list[list[int]],
                              target_top1: np.ndarray) -> None:
    assert (top1(tiny_files["draft0"], contexts) == target_top1).all()


def test_agreement_noise_005(tiny_files: dict[str, Path], contexts: list[list[int]],
                             target_top1: np.ndarray) -> None:
    agree = (top1(tiny_files["draft"], contexts) == target_top1).mean()
    lo, hi = AGREEMENT_005
    assert lo <= agree <= hi, agree


def test_agreement_noise_05(tiny_files: dict[str, Path], contexts: list[list[int]],
                            target_top1: np.ndarray) -> None:
    agree = (top1(tiny_files["draft05"], contexts) == target_top1).mean()
    assert agree < 0.4, agree  # measured 0.17-0.24
    assert agree < AGREEMENT_005[0] - 0.3


def test_other_seed_is_a_different_model(tiny_files: dict[str, Path], contexts: list[list[int]],
                                         target_top1: np.ndarray) -> None:
    assert (top1(tiny_files["other_seed"], contexts[:50]) == target_top1[:50]).mean() < 0.2


# ---------------------------------------------------------------- mismatched vocab, recurrent


def test_mismatched_vocab(tiny_files: dict[str, Path], target: Loaded) -> None:
    with loaded(tiny_files["mismatched"]) as other:
        assert other.n_vocab == tiny.VOCABS["spm512"].size == 512
        # same type, same BOS/EOS, size gap within llama.cpp's tolerance of 128 ...
        assert lc.llama_vocab_type(other.vocab) == lc.llama_vocab_type(target.vocab)
        assert lc.llama_vocab_bos(other.vocab) == 1 and lc.llama_vocab_eos(other.vocab) == 2
        assert abs(other.n_vocab - target.n_vocab) <= 128
        # ... but the pieces differ: only a token-by-token comparison shows it
        assert [token_text(other, t) for t in range(259)] == [token_text(target, t) for t in range(259)]
        differ = [t for t in range(259, 406) if token_text(other, t) != token_text(target, t)]
        assert len(differ) > 100 and differ[0] == 259
        text = "Hello world, write a python function"
        assert tokenize(other, text) != tokenize(target, text)
        assert detokenize(other, tokenize(other, text)[1:]) == text


def test_recurrent_model(tiny_files: dict[str, Path], target: Loaded) -> None:
    assert not lc.llama_model_is_recurrent(target.model)
    with loaded(tiny_files["recurrent"]) as m:
        assert lc.llama_model_is_recurrent(m.model)
        assert m.n_vocab == 406
        assert np.isfinite(decode(m, tokenize(m, "hello world"))).all()


# ---------------------------------------------------------------- command line


def test_command_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("tiny_models.py")), str(tmp_path / "pair"),
                          "--seed", "3", "--noise", "0.1"],
                         capture_output=True, text=True, check=True, timeout=60)
    paths = [Path(line) for line in out.stdout.splitlines()]
    assert len(paths) == 2 and all(p.is_file() for p in paths)
    assert paths[0].read_bytes() == tiny.write_tiny_model(tmp_path / "t.gguf", seed=3).read_bytes()
    assert paths[1].read_bytes() == tiny.write_tiny_model(tmp_path / "d.gguf", seed=3, noise=0.1).read_bytes()
