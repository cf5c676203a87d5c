"""Tiny random-weight llama GGUF models: the model the CPU kernel check quantizes
(:func:`write_check_model`, ``localspec.llama.kernel_check``), and the parts tests build theirs from.

The files are written with the ``gguf`` package and load in llama.cpp in milliseconds. They
have no knowledge of language, but they are *proper* models: a SentencePiece-style vocabulary
with byte fallback (so any UTF-8 text round-trips), a ChatML chat template, and random weights
scaled so that the next-token distribution is neither uniform nor one-hot and depends on the
whole context, not only on the last token.

Vocabulary ids::

    0 <unk> (UNKNOWN)   1 <s> (CONTROL, BOS)   2 </s> (CONTROL, EOS)
    3 .. 258            <0x00> .. <0xFF> (BYTE)
    259 .. n-3          normal pieces: BPE merges and base characters (score = -rank)
    n-2 <|im_start|>    n-1 <|im_end|>  (CONTROL; <|im_end|> is also the EOT token)

(then a vocabulary's user-defined pieces, if it has any). ``<|im_end|>`` is registered as the
EOT token, so llama.cpp's ``llama_vocab_is_eog`` is true for both ``</s>`` and ``<|im_end|>``.
BOS is added automatically when tokenizing with ``add_special``. As in llama-2,
``add_space_prefix`` is on: llama.cpp prepends ``▁`` to the text and to every text fragment
that follows a special token, and ``llama_detokenize`` strips that space again only when the
first token is not BOS.

Writing files needs the ``gguf`` package (a dependency of localspec); it is imported when a
file is written, so importing this module costs nothing.
"""

from __future__ import annotations

import collections
import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import gguf

SPACE = "\u2581"  # SentencePiece's word-boundary marker "▁"
SPECIAL_PIECES = ("<unk>", "<s>", "</s>")
CHAT_PIECES = ("<|im_start|>", "<|im_end|>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_BYTE_ID = 3
FIRST_PIECE_ID = FIRST_BYTE_ID + 256

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TEXT_EN = """
hello world, write a python function that returns the sum of a list of numbers.
the quick brown fox jumps over the lazy dog. in the beginning there was the word, and the
word was with the model. this is a test of the tokenizer: it should split text into pieces
that are shorter than words but longer than letters. we want to see how the model handles
common english words such as the, and, of, to, in, is, that, for, it, with, as, on, be, at.
please explain what a function is and how to define one in python. here is an example:
def add(a, b): return a + b. the function takes two arguments and returns their sum.
write a short story about a cat who wants to learn to code. the cat opens the laptop, reads
the documentation and writes her first program. it prints hello world on the screen.
"""

TEXT_CODE = """
def main():
    import os
    for index, value in enumerate(values):
        if value is None:
            continue
        print(index, value)
    return result
class Model:
    def __init__(self, path, options=None):
        self.path = path
        self.options = options
    def forward(self, tokens):
        return self.layers(tokens)
Question: What is the capital of France? Answer: Paris is the capital of France.
User: Can you help me write a Python script? Assistant: Sure, here is a Python script.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 2024 and names like Alice, Bob, London, Tokyo.
"""

LOWER = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class VocabSpec:
    """How to build one vocabulary: base characters, the BPE training text, merges count."""

    name: str
    base_chars: str
    text: str
    n_merges: int
    merges_first: bool = True  # SentencePiece BPE order; False puts base characters first
    user_defined: tuple[str, ...] = ()  # USER_DEFINED pieces after the chat pieces (e.g. <tool_call>)

    @property
    def size(self) -> int:
        """Number of tokens in the vocabulary."""
        return (FIRST_PIECE_ID + 1 + len(self.base_chars) + self.n_merges + len(CHAT_PIECES)
                + len(self.user_defined))


# 40 base characters (▁, a-z, .,:;!?()=_-'") and 105 BPE merges learnt from a built-in English +
# Python text; 406 tokens. Uppercase letters, digits and anything else go through byte fallback.
SPM406 = VocabSpec("spm406", LOWER + ".,:;!?()=_-'\"", TEXT_EN + TEXT_CODE, 105)


@dataclass(frozen=True)
class Vocab:
    """A built vocabulary: pieces, scores and token types, index = token id."""

    name: str
    pieces: list[str]
    scores: list[float]
    types: list[int]

    @property
    def im_end_id(self) -> int:
        """Id of ``<|im_end|>`` (the EOT token)."""
        return self.pieces.index(CHAT_PIECES[1])


def _words(text: str) -> collections.Counter[str]:
    """Whitespace-split words of ``text`` with SentencePiece's ``▁`` prefix, counted."""
    return collections.Counter(SPACE + w for w in text.split())


def _alphabet_runs(text: str, alphabet: set[str]) -> collections.Counter[tuple[str, ...]]:
    """The runs of alphabet characters in the words of ``text``, counted (other characters break
    words: they will be byte tokens)."""
    words: collections.Counter[tuple[str, ...]] = collections.Counter()
    for word, count in _words(text).items():
        run: list[str] = []
        for ch in word:
            if ch in alphabet:
                run.append(ch)
            elif run:
                words[tuple(run)] += count
                run = []
        if run:
            words[tuple(run)] += count
    return words


def _bpe_merges(text: str, alphabet: set[str], n_merges: int) -> list[str]:
    """Train ``n_merges`` BPE merges over the words of ``text``; return the merged pieces.

    Every merged piece is made of alphabet characters and has a merge path from single
    characters. Ties are broken by the pair's text, which makes the result deterministic.
    """
    words = _alphabet_runs(text, alphabet)
    merged: list[str] = []
    seen = set(alphabet)
    while len(merged) < n_merges:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for symbols, count in words.items():
            for a, b in zip(symbols, symbols[1:], strict=False):
                if a + b not in seen:
                    pairs[(a, b)] += count
        if not pairs:
            raise ValueError(f"training text too short for {n_merges} merges")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        piece = best[0] + best[1]
        merged.append(piece)
        seen.add(piece)
        words = collections.Counter({_merge_pair(s, best): c for s, c in words.items()})
    return merged


def _merge_pair(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """Replace every adjacent occurrence of ``pair`` in ``symbols`` by its concatenation."""
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def gguf_package() -> Any:
    """The gguf package, or an ImportError saying how to get it."""
    try:
        import gguf
    except ImportError:
        raise ImportError("writing tiny GGUF models needs the gguf package, a dependency of localspec: "
                          "pip install gguf==0.19.0") from None
    return gguf


def build_vocab(spec: VocabSpec) -> Vocab:
    """Build the vocabulary a spec describes."""
    T = gguf_package().TokenType
    pieces = list(SPECIAL_PIECES)
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    types += [T.BYTE] * 256
    base = [SPACE] + list(spec.base_chars)
    merges = _bpe_merges(spec.text, set(base), spec.n_merges)
    pieces += merges + base if spec.merges_first else base + merges
    types += [T.NORMAL] * (len(merges) + len(base))
    pieces += list(CHAT_PIECES)
    types += [T.CONTROL] * len(CHAT_PIECES)
    scores = [0.0] * FIRST_PIECE_ID
    scores += [-float(i) for i in range(len(merges) + len(base))]
    scores += [0.0] * len(CHAT_PIECES)
    pieces += list(spec.user_defined)
    types += [T.USER_DEFINED] * len(spec.user_defined)
    scores += [0.0] * len(spec.user_defined)
    if not len(pieces) == len(set(pieces)) == spec.size:
        raise ValueError(f"vocab {spec.name}: {len(pieces)} pieces, {len(set(pieces))} distinct, "
                         f"expected {spec.size}")
    return Vocab(spec.name, pieces, scores, [int(t) for t in types])


def add_vocab(writer: gguf.GGUFWriter, vocab: Vocab, chat_template: str | None) -> None:
    """Write the tokenizer metadata of ``vocab`` (and the chat template, if any)."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.pieces)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_eot_token_id(vocab.im_end_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


@dataclass(frozen=True)
class LlamaShape:
    """Hyper-parameters of a tiny llama model."""

    n_vocab: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int

    @property
    def head_dim(self) -> int:
        """Dimension of one attention head."""
        return self.n_embd // self.n_head


# Initial scales (multiples of 1/sqrt(fan_in) unless noted), tuned so that the next-token
# distribution has an entropy of a few nats and depends on earlier tokens, not only the last.
EMBED_STD = 1.0  # token_embd entries (absolute)
QK_GAIN = 1.2  # attention logits scale: more -> sharper patterns, more context dependence
VO_GAIN = 0.6
FFN_GAIN = 0.6
OUTPUT_GAIN = 3.2  # logit scale


def llama_tensors(shape: LlamaShape, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random llama weights, numpy layout (rows = output features; ggml reverses the dims)."""
    e, ff, kv = shape.n_embd, shape.n_ff, shape.n_head_kv * shape.head_dim

    def linear(n_out: int, n_in: int, gain: float) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * gain / np.sqrt(n_in)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(e)).astype(np.float32)

    tensors = {"token_embd.weight": (rng.standard_normal((shape.n_vocab, e)) * EMBED_STD).astype(np.float32)}
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = norm()
        tensors[p + "attn_q.weight"] = linear(e, e, QK_GAIN)
        tensors[p + "attn_k.weight"] = linear(kv, e, QK_GAIN)
        tensors[p + "attn_v.weight"] = linear(kv, e, VO_GAIN)
        tensors[p + "attn_output.weight"] = linear(e, e, VO_GAIN)
        tensors[p + "ffn_norm.weight"] = norm()
        tensors[p + "ffn_gate.weight"] = linear(ff, e, FFN_GAIN)
        tensors[p + "ffn_up.weight"] = linear(ff, e, FFN_GAIN)
        tensors[p + "ffn_down.weight"] = linear(e, ff, FFN_GAIN)
    tensors["output_norm.weight"] = norm()
    tensors["output.weight"] = linear(shape.n_vocab, e, OUTPUT_GAIN)
    return tensors


def rngs(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent random streams for the base weights and for a draft's noise."""
    base, noise = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(base), np.random.default_rng(noise)


def write_file(path: Path, writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> Path:
    """Add ``tensors`` (as F32) and write the whole file (none left half-written)."""
    for name, data in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    return write_added(path, writer)


def write_added(path: Path, writer: gguf.GGUFWriter) -> Path:
    """Write the file of a writer whose tensors are added, and close it; none left half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        path.unlink(missing_ok=True)  # no half-written model left behind
        raise
    writer.close()
    return path


def write_llama(path: Path, tensors: dict[str, np.ndarray], shape: LlamaShape, vocab: Vocab, *, name: str,
                n_ctx_train: int = 2048, chat_template: str | None = CHATML_TEMPLATE, arch: str = "llama") -> Path:
    """Write a llama-architecture GGUF file (F32) of these weights and vocabulary (``arch``: a name
    llama.cpp loads llama's tensors and hyper-parameters under, "llama" or "qwen2")."""
    gguf = gguf_package()
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(shape.n_vocab)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    add_vocab(w, vocab, chat_template)
    return write_file(path, w, tensors)


QUANTIZABLE = dict(n_embd=256, n_head=4, n_head_kv=2, n_ff=512)  # rows k-quants, repack and AMX all take


def write_check_model(path: str | Path) -> Path:
    """The F32 model the CPU kernel check quantizes: 2 layers in QUANTIZABLE dimensions (which the
    quantized types, CPU_REPACK's interleaves and AMX's tiles all take), the ``spm406`` vocabulary."""
    vocab = build_vocab(SPM406)
    shape = LlamaShape(len(vocab.pieces), n_layer=2, **QUANTIZABLE)
    tensors = llama_tensors(shape, rngs(0)[0])
    return write_llama(Path(path), tensors, shape, vocab, name="tiny-llama-spm406-s0-n0")


def quantize(source: str | Path, dest: str | Path, ftype: int, threads: int = 1) -> Path:
    """Quantize a GGUF file with llama.cpp's own quantizer (``llama_model_quantize``, milliseconds
    for a tiny model) to a ``llama_ftype``, on `threads` CPU threads. Matrices whose rows the
    type's blocks do not divide fall back to another type, as in llama-quantize."""
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    dest = Path(dest)
    if lc.llama_model_quantize(os.fsencode(source), os.fsencode(dest), ctypes.byref(params)) != 0:
        dest.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize {source} to ftype {ftype}")
    return dest
