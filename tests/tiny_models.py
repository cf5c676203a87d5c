"""Tiny random-weight GGUF models for tests: targets, drafts, other vocabularies, a recurrent model.

Built on ``localspec.llama.tiny_model`` (the model the CPU kernel check quantizes: vocabulary,
weights, writer, quantizer). Draft models are the target's weights plus Gaussian noise
(``noise`` × the standard deviation of each tensor, drawn from a separate random stream), which
makes their next-token distributions agree with the target's to a tunable degree.

Vocabularies (``VOCABS``), ids 0..258 shared by all of them (see ``localspec.llama.tiny_model``):

- ``spm406`` (default): 40 base characters (``▁``, ``a``-``z``, ``.,:;!?()=_-'"``) and
  105 BPE merges learnt from a built-in English + Python text; 406 tokens. Uppercase letters,
  digits and anything else go through byte fallback.
- ``spm406t``: ``spm406`` plus ``<tool_call>`` and ``</tool_call>`` (ids 406 and 407, USER_DEFINED
  as in Qwen 2.5's vocabulary) and Qwen 2.5's chat template, which renders tools, tool calls and
  tool results: the models of the tool-calling tests.
- ``spm512``: a different piece list (``A``-``Z`` and digits as extra base characters, base
  characters before the 182 merges); 512 tokens. Ids 0..258 coincide with ``spm406`` and the
  sizes differ by less than llama.cpp's 128-token tolerance, so only a token-by-token comparison
  tells the two apart — the vocab-*mismatched* case for tests.

Command line: ``python tests/tiny_models.py OUT_DIR [--seed N] [--noise X]`` writes a
target/draft pair and prints the two paths.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import numpy as np

from localspec.llama.tiny_model import (BOS_ID, CHATML_TEMPLATE, EOS_ID, FIRST_BYTE_ID, FIRST_PIECE_ID, LOWER,
                                        QUANTIZABLE, SPM406, TEXT_CODE, TEXT_EN, UNK_ID, LlamaShape, Vocab,
                                        VocabSpec, add_vocab, build_vocab as build_spec, gguf_package,
                                        llama_tensors, quantize, rngs, write_file, write_llama)

__all__ = ["BOS_ID", "EOS_ID", "UNK_ID", "FIRST_BYTE_ID", "FIRST_PIECE_ID", "CHATML_TEMPLATE", "TOOLS_TEMPLATE",
           "QUANTIZABLE", "QUANTIZATIONS", "VOCABS", "DEFAULT_VOCAB", "TOOLS_VOCAB", "MISMATCHED_VOCAB",
           "build_vocab", "write_tiny_model", "make_pair", "make_mismatched_draft", "write_tiny_recurrent",
           "quantize", "main"]

TOOL_PIECES = ("<tool_call>", "</tool_call>")  # USER_DEFINED, as in Qwen 2.5's vocabulary

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

_UPPER = LOWER.upper()

VOCABS: dict[str, VocabSpec] = {
    "spm406": SPM406,
    "spm512": VocabSpec("spm512", _UPPER + "0123456789" + LOWER + ".,:()=", TEXT_CODE + TEXT_EN, 182,
                        merges_first=False),
    "spm406t": VocabSpec("spm406t", SPM406.base_chars, SPM406.text, 105, user_defined=TOOL_PIECES),
}
TOOLS_VOCAB = "spm406t"
DEFAULT_VOCAB = "spm406"
MISMATCHED_VOCAB = "spm512"
LLAMA_LIKE_ARCHS = ("llama", "qwen2")  # llama.cpp loads llama's tensors + hparams under these names
# llama_ftype of the quantizations real GGUF files use (Q4_K_M mixes Q4_K with Q6_K tensors)
QUANTIZATIONS = {"q4_k_m": 15, "q4_0": 2, "q8_0": 7}
TOOL_CALL_GAIN = 1.5  # how strongly a tool model opens a call after a newline (see below)


def build_vocab(name: str = DEFAULT_VOCAB) -> Vocab:
    """Build the vocabulary ``name`` (a key of ``VOCABS``)."""
    try:
        spec = VOCABS[name]
    except KeyError:
        raise ValueError(f"unknown vocab {name!r}; known: {', '.join(VOCABS)}") from None
    return build_spec(spec)


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
    voc = build_vocab(vocab)
    shape = LlamaShape(len(voc.pieces), n_layer, n_embd, n_head, n_head_kv, n_ff)
    base_rng, noise_rng = rngs(seed)
    tensors = llama_tensors(shape, base_rng)
    tools = TOOL_PIECES[0] in voc.pieces
    if tools:
        _favour_calls_after_newline(tensors, voc.pieces.index(TOOL_PIECES[0]))
    if noise > 0:
        _add_noise(tensors, noise, noise_rng)
    template = (TOOLS_TEMPLATE if tools else CHATML_TEMPLATE) if chat_template else None
    return write_llama(Path(path), tensors, shape, voc, name=f"tiny-{arch}-{vocab}-s{seed}-n{noise:g}",
                       n_ctx_train=n_ctx_train, chat_template=template, arch=arch)


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


def _mamba_tensors(rng: np.random.Generator, n_vocab: int, n_layer: int, n_embd: int, d_state: int,
                   d_conv: int) -> dict[str, np.ndarray]:
    """Random Mamba weights (numpy layout), expansion factor 2 (the only one llama.cpp supports)."""
    d_inner, dt_rank = 2 * n_embd, max(1, -(-n_embd // 16))

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
    return tensors


def write_tiny_recurrent(path: str | Path, *, seed: int = 0, n_layer: int = 2, n_embd: int = 64,
                         d_state: int = 16, d_conv: int = 4, n_ctx_train: int = 2048) -> Path:
    """Write a tiny random-weight Mamba (recurrent) GGUF file with the ``spm406`` vocab.

    llama.cpp loads it and reports ``llama_model_is_recurrent``; its state cannot roll back
    rejected draft tokens, so speculative decoding must refuse it.
    """
    path = Path(path)
    voc = build_vocab(DEFAULT_VOCAB)
    n_vocab = len(voc.pieces)
    tensors = _mamba_tensors(rngs(seed)[0], n_vocab, n_layer, n_embd, d_state, d_conv)
    gguf = gguf_package()
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
    w.add_ssm_inner_size(2 * n_embd)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(max(1, -(-n_embd // 16)))
    w.add_layer_norm_rms_eps(1e-5)
    add_vocab(w, voc, CHATML_TEMPLATE)
    return write_file(path, w, tensors)


def main(argv: Sequence[str] | None = None) -> int:
    """``python tests/tiny_models.py OUT_DIR [--seed N] [--noise X]``: write a pair."""
    parser = argparse.ArgumentParser(prog="python tests/tiny_models.py",
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
