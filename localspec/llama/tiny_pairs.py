"""Tiny random-weight target/draft pairs (llama architecture, F32) on the vocabularies of
:mod:`localspec.llama.tiny_model`: the models of the test suite (tests/tiny_models.py), which
writes them from here.

Draft models are the target's weights plus Gaussian noise (``noise`` × the standard deviation of
each tensor, drawn from a separate random stream), which makes their next-token distributions
agree with the target's to a tunable degree. Vocabularies (``VOCABS``), ids 0..258 shared by all:

- ``spm406`` (default): 40 base characters (``▁``, ``a``-``z``, ``.,:;!?()=_-'"``) and 105 BPE
  merges learnt from a built-in English + Python text; 406 tokens.
- ``spm406t``: ``spm406`` plus ``<tool_call>`` and ``</tool_call>`` (ids 406 and 407,
  USER_DEFINED as in Qwen 2.5's vocabulary) and Qwen 2.5's chat template, which renders tools,
  tool calls and tool results.
- ``spm512``: a different piece list; 512 tokens. Ids 0..258 coincide with ``spm406`` and the
  sizes differ by less than llama.cpp's 128-token tolerance, so only a token-by-token comparison
  tells the two apart (a vocab-mismatched draft).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from localspec.llama.tiny_model import (
    CHATML_TEMPLATE,
    FIRST_BYTE_ID,
    LOWER,
    SPM406,
    TEXT_CODE,
    TEXT_EN,
    LlamaShape,
    Vocab,
    VocabSpec,
    build_vocab as build_spec,
    llama_tensors,
    rngs,
    write_llama,
)

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

