"""Tiny random-weight GGUF models: for tests, and for checking CPU kernels before first use.

The files are written with the ``gguf`` package and load in llama.cpp in milliseconds. They
have no knowledge of language, but they are *proper* models: a SentencePiece-style vocabulary
with byte fallback (so any UTF-8 text round-trips), a ChatML chat template, and random weights
scaled so that the next-token distribution is neither uniform nor one-hot and depends on the
whole context, not only on the last token.

Draft models are the target's weights plus Gaussian noise (``noise`` × the standard deviation
of each tensor, drawn from a separate random stream), which makes their next-token
distributions agree with the target's to a tunable degree.

Vocabularies (``VOCABS``), ids shared by all of them::

    0 <unk> (UNKNOWN)   1 <s> (CONTROL, BOS)   2 </s> (CONTROL, EOS)
    3 .. 258            <0x00> .. <0xFF> (BYTE)
    259 .. n-3          normal pieces: BPE merges and base characters (score = -rank)
    n-2 <|im_start|>    n-1 <|im_end|>  (CONTROL; <|im_end|> is also the EOT token)

``<|im_end|>`` is registered as the EOT token, so llama.cpp's ``llama_vocab_is_eog`` is true
for both ``</s>`` and ``<|im_end|>``; generation code should stop on ``is_eog``, not on the EOS
id alone. BOS is added automatically when tokenizing with ``add_special``. As in llama-2,
``add_space_prefix`` is on: llama.cpp prepends ``▁`` to the text and to every text fragment
that follows a special token (``<|im_start|>user`` -> ``<|im_start|>``, ``▁``, ``u``, ``s``,
``er``), and ``llama_detokenize`` strips that space again only when the first token is not BOS.

- ``spm406`` (default): 40 base characters (``▁``, ``a``-``z``, ``.,:;!?()=_-'"``) and
  105 BPE merges learnt from a built-in English + Python text; 406 tokens. Uppercase letters, digits and anything else go through byte fallback.
- ``spm406t``: ``spm406`` plus ``<tool_call>`` and ``</tool_call>`` (ids 406 and 407, USER_DEFINED
  as in Qwen 2.5's vocabulary) and Qwen 2.5's chat template, which renders tools, tool calls and
  tool results: the models of the tool-calling tests.
- ``spm512``: a different piece list (``A``-``Z`` and digits as extra base characters, base
  characters before the 182 merges); 512 tokens. Ids 0..258 coincide with ``spm406`` and the
  sizes differ by less than llama.cpp's 128-token tolerance, so only a token-by-token comparison
  tells the two apart — the vocab-*mismatched* case for tests.

Command line: ``python -m localspec.models.tiny OUT_DIR [--seed N] [--noise X]`` writes a
target/draft pair and prints the two paths.

Writing files needs the ``gguf`` package (a dependency of localspec: ``localspec.llama.kernels`` writes
a tiny model to check llama.cpp's CPU kernels in a child process); it is imported when a file is
written, so importing this module costs nothing.
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import gguf

SPACE = "\u2581"  # SentencePiece's word-boundary marker "▁"
SPECIAL_PIECES = ("<unk>", "<s>", "</s>")
CHAT_PIECES = ("<|im_start|>", "<|im_end|>")
TOOL_PIECES = ("<tool_call>", "</tool_call>")  # USER_DEFINED, as in Qwen 2.5's vocabulary
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_BYTE_ID = 3
FIRST_PIECE_ID = FIRST_BYTE_ID + 256

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen 2.5's template (tools in the system turn, calls as <tool_call> JSON, results as user turns)
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TEXT_EN = """
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

_TEXT_CODE = """
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


@dataclass(frozen=True)
class VocabSpec:
    """How to build one vocabulary: base characters, the BPE training text, merges count."""

    name: str
    base_chars: str
    text: str
    n_merges: int
    merges_first: bool = True  # SentencePiece BPE order; False puts base characters first
    tool_tokens: bool = False  # <tool_call> and </tool_call> after the chat pieces, and Qwen 2.5's template

    @property
    def size(self) -> int:
        """Number of tokens in the vocabulary."""
        return (FIRST_PIECE_ID + 1 + len(self.base_chars) + self.n_merges + len(CHAT_PIECES)
                + (len(TOOL_PIECES) if self.tool_tokens else 0))


_LOWER = "abcdefghijklmnopqrstuvwxyz"
_UPPER = _LOWER.upper()

VOCABS: dict[str, VocabSpec] = {
    "spm406": VocabSpec("spm406", _LOWER + ".,:;!?()=_-'\"", _TEXT_EN + _TEXT_CODE, 105),
    "spm512": VocabSpec("spm512", _UPPER + "0123456789" + _LOWER + ".,:()=", _TEXT_CODE + _TEXT_EN, 182,
                        merges_first=False),
    "spm406t": VocabSpec("spm406t", _LOWER + ".,:;!?()=_-'\"", _TEXT_EN + _TEXT_CODE, 105, tool_tokens=True),
}
TOOLS_VOCAB = "spm406t"
DEFAULT_VOCAB = "spm406"
MISMATCHED_VOCAB = "spm512"
LLAMA_LIKE_ARCHS = ("llama", "qwen2")  # llama.cpp loads llama's tensors + hparams under these names


@dataclass(frozen=True)
class Vocab:
    """A built vocabulary: pieces, scores and token types, index = token id."""

    name: str
    pieces: list[str]
    scores: list[float]
    types: list[int]

    @property
    def im_start_id(self) -> int:
        """Id of ``<|im_start|>``."""
        return self.pieces.index(CHAT_PIECES[0])

    @property
    def im_end_id(self) -> int:
        """Id of ``<|im_end|>`` (the EOT token)."""
        return self.pieces.index(CHAT_PIECES[1])


def _words(text: str) -> collections.Counter[str]:
    """Whitespace-split words of ``text`` with SentencePiece's ``▁`` prefix, counted."""
    return collections.Counter(SPACE + w for w in text.split())


def _bpe_merges(text: str, alphabet: set[str], n_merges: int) -> list[str]:
    """Train ``n_merges`` BPE merges over the words of ``text``; return the merged pieces.

    Characters outside ``alphabet`` break words (they will be byte tokens), so every merged
    piece is made of alphabet characters and has a merge path from single characters.
    Ties are broken by the pair's text, which makes the result deterministic.
    """
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

    merged: list[str] = []
    seen = set(alphabet)
    while len(merged) < n_merges:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for symbols, count in words.items():
            for a, b in zip(symbols, symbols[1:]):
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


def _gguf() -> Any:
    """The gguf package, or an ImportError saying how to get it."""
    try:
        import gguf
    except ImportError:
        raise ImportError("writing tiny GGUF models needs the gguf package, a dependency of localspec: "
                          "pip install gguf==0.19.0") from None
    return gguf


def build_vocab(name: str = DEFAULT_VOCAB) -> Vocab:
    """Build the vocabulary ``name`` (a key of ``VOCABS``)."""
    try:
        spec = VOCABS[name]
    except KeyError:
        raise ValueError(f"unknown vocab {name!r}; known: {', '.join(VOCABS)}") from None
    T = _gguf().TokenType
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
    if spec.tool_tokens:
        pieces += list(TOOL_PIECES)
        types += [T.USER_DEFINED] * len(TOOL_PIECES)
        scores += [0.0] * len(TOOL_PIECES)
    if not len(pieces) == len(set(pieces)) == spec.size:
        raise ValueError(f"vocab {name}: {len(pieces)} pieces, {len(set(pieces))} distinct, "
                         f"expected {spec.size}")
    return Vocab(name, pieces, scores, [int(t) for t in types])


def _add_vocab(writer: gguf.GGUFWriter, vocab: Vocab, chat_template: bool) -> None:
    """Write the tokenizer metadata of ``vocab``."""
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
    if chat_template:
        writer.add_chat_template(TOOLS_TEMPLATE if TOOL_PIECES[0] in vocab.pieces else CHATML_TEMPLATE)


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


def _llama_tensors(shape: LlamaShape, rng: np.random.Generator) -> dict[str, np.ndarray]:
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


TOOL_CALL_GAIN = 1.5  # how strongly a tool model opens a call after a newline (see below)


def _favour_calls_after_newline(tensors: dict[str, np.ndarray], call_id: int) -> None:
    """Make ``<tool_call>`` likely after a newline, as in a model trained to call tools: its
    output row points along the newline's embedding, which dominates the last hidden state there
    (the reply starts after the template's "assistant\\n", so a call often opens at once)."""
    newline = tensors["token_embd.weight"][FIRST_BYTE_ID + ord("\n")]
    tensors["output.weight"][call_id] = (TOOL_CALL_GAIN * newline / np.sqrt(newline.size)).astype(np.float32)


def _add_noise(tensors: dict[str, np.ndarray], noise: float, rng: np.random.Generator) -> None:
    """In place: ``w += noise * N(0, 1) * std(w)`` for every tensor, in a fixed order."""
    for name in sorted(tensors):
        w = tensors[name]
        w += (noise * float(w.std()) * rng.standard_normal(w.shape)).astype(np.float32)


def _rngs(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent random streams for the base weights and for the draft noise."""
    base, noise = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(base), np.random.default_rng(noise)


def _write(path: Path, writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> Path:
    """Add ``tensors`` and write the whole file."""
    for name, data in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
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


def write_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    noise: float = 0.0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 2048,
    vocab: str = DEFAULT_VOCAB,
    chat_template: bool = True,
    arch: str = "llama",
) -> Path:
    """Write a tiny random-weight llama-architecture GGUF file (F32) and return its path.

    The file is a deterministic function of the arguments. ``noise > 0`` makes a draft of the
    ``noise == 0`` model with the same ``seed`` and shape: every tensor gets
    ``noise * N(0, 1) * std(tensor)`` added from a random stream separate from the weights'.
    ``arch`` is one of ``LLAMA_LIKE_ARCHS`` (``"qwen2"``: the same tensors, its q/k/v biases
    are optional in llama.cpp).
    """
    if arch not in LLAMA_LIKE_ARCHS:
        raise ValueError(f"arch must be one of {', '.join(LLAMA_LIKE_ARCHS)}, got {arch!r}")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be divisible by n_head, and n_head by n_head_kv")
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    path = Path(path)
    voc = build_vocab(vocab)
    shape = LlamaShape(len(voc.pieces), n_layer, n_embd, n_head, n_head_kv, n_ff)
    base_rng, noise_rng = _rngs(seed)
    tensors = _llama_tensors(shape, base_rng)
    if TOOL_PIECES[0] in voc.pieces:
        _favour_calls_after_newline(tensors, voc.pieces.index(TOOL_PIECES[0]))
    if noise > 0:
        _add_noise(tensors, noise, noise_rng)

    gguf = _gguf()
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}-{vocab}-s{seed}-n{noise:g}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(shape.n_vocab)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    _add_vocab(w, voc, chat_template)
    return _write(path, w, tensors)


# llama_ftype of the quantizations real GGUF files use (Q4_K_M mixes Q4_K with Q6_K tensors)
QUANTIZATIONS = {"q4_k_m": 15, "q4_0": 2, "q8_0": 7}
QUANTIZABLE = dict(n_embd=256, n_head=4, n_head_kv=2, n_ff=512)  # rows k-quants, repack and AMX all take


def quantize(source: str | Path, dest: str | Path, ftype: int) -> Path:
    """Quantize a GGUF file with llama.cpp's own quantizer (``llama_model_quantize``, milliseconds
    for a tiny model) to a ``llama_ftype`` (e.g. ``QUANTIZATIONS["q4_k_m"]``). Matrices whose rows
    the type's blocks do not divide fall back to another type, as in llama-quantize."""
    import ctypes

    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    dest = Path(dest)
    if lc.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params)) != 0:
        dest.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize {source} to ftype {ftype}")
    return dest


def make_pair(directory: str | Path, *, seed: int = 0, noise: float = 0.05,
              vocab: str = DEFAULT_VOCAB) -> tuple[Path, Path]:
    """Write a target and its draft (same seed, same vocab) into ``directory``; return both paths.

    The files are ``tiny-target-s<seed>.gguf`` and ``tiny-draft-s<seed>-n<noise>.gguf`` (with
    ``-<vocab>`` before ``.gguf`` for a vocabulary other than the default).
    """
    directory = Path(directory)
    tail = "" if vocab == DEFAULT_VOCAB else f"-{vocab}"
    target = write_tiny_model(directory / f"tiny-target-s{seed}{tail}.gguf", seed=seed, vocab=vocab)
    draft = write_tiny_model(directory / f"tiny-draft-s{seed}-n{noise:g}{tail}.gguf", seed=seed, noise=noise,
                             vocab=vocab)
    return target, draft


def make_mismatched_draft(directory: str | Path, seed: int = 0) -> Path:
    """Write a draft whose vocabulary (``spm512``) differs from the targets' (``spm406``)."""
    directory = Path(directory)
    return write_tiny_model(directory / f"tiny-mismatched-s{seed}.gguf", seed=seed, vocab=MISMATCHED_VOCAB)


def write_tiny_recurrent(path: str | Path, *, seed: int = 0, n_layer: int = 2, n_embd: int = 64,
                         d_state: int = 16, d_conv: int = 4, n_ctx_train: int = 2048) -> Path:
    """Write a tiny random-weight Mamba (recurrent) GGUF file with the ``spm406`` vocab.

    llama.cpp loads it and reports ``llama_model_is_recurrent``; its state cannot roll back
    rejected draft tokens, so speculative decoding must refuse it.
    """
    path = Path(path)
    voc = build_vocab(DEFAULT_VOCAB)
    n_vocab, d_inner = len(voc.pieces), 2 * n_embd  # llama.cpp supports expansion factor 2 only
    dt_rank = max(1, -(-n_embd // 16))
    rng, _ = _rngs(seed)

    def linear(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    tensors = {"token_embd.weight": rng.standard_normal((n_vocab, n_embd)).astype(np.float32)}
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = np.ones(n_embd, np.float32)
        tensors[p + "ssm_in.weight"] = linear(2 * d_inner, n_embd)
        tensors[p + "ssm_conv1d.weight"] = linear(d_inner, d_conv)
        tensors[p + "ssm_conv1d.bias"] = np.zeros(d_inner, np.float32)
        tensors[p + "ssm_x.weight"] = linear(dt_rank + 2 * d_state, d_inner)
        tensors[p + "ssm_dt.weight"] = linear(d_inner, dt_rank)
        tensors[p + "ssm_dt.bias"] = np.full(d_inner, -2.0, np.float32)
        a_log = np.log(np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1)))
        tensors[p + "ssm_a"] = -np.exp(a_log).astype(np.float32)  # stored as -exp(A_log)
        tensors[p + "ssm_d"] = np.ones(d_inner, np.float32)
        tensors[p + "ssm_out.weight"] = linear(n_embd, d_inner)
    tensors["output_norm.weight"] = np.ones(n_embd, np.float32)
    tensors["output.weight"] = linear(n_vocab, n_embd) * 3.0

    gguf = _gguf()
    w = gguf.GGUFWriter(path, "mamba")
    w.add_name(f"tiny-mamba-s{seed}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    _add_vocab(w, voc, chat_template=True)
    return _write(path, w, tensors)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m localspec.models.tiny OUT_DIR [--seed N] [--noise X]``: write a pair."""
    parser = argparse.ArgumentParser(prog="python -m localspec.models.tiny",
                                     description="Write a tiny random-weight target/draft GGUF pair.")
    parser.add_argument("out_dir", type=Path, help="directory for the two .gguf files")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--noise", type=float, default=0.05,
                        help="draft weight noise, in units of each tensor's std (default 0.05)")
    args = parser.parse_args(argv)
    for p in make_pair(args.out_dir, seed=args.seed, noise=args.noise):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
