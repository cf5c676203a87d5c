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

from localspec.llama.tiny_model import (BOS_ID, CHATML_TEMPLATE, EOS_ID, FIRST_BYTE_ID, FIRST_PIECE_ID, QUANTIZABLE,
                                        UNK_ID, add_vocab, gguf_package, quantize, rngs, write_file)
from localspec.llama.tiny_pairs import (DEFAULT_VOCAB, MISMATCHED_VOCAB, QUANTIZATIONS, TOOLS_TEMPLATE, TOOLS_VOCAB,
                                        VOCABS, build_vocab, make_mismatched_draft, make_pair, write_tiny_model)

__all__ = ["BOS_ID", "EOS_ID", "UNK_ID", "FIRST_BYTE_ID", "FIRST_PIECE_ID", "CHATML_TEMPLATE", "TOOLS_TEMPLATE",
           "QUANTIZABLE", "QUANTIZATIONS", "VOCABS", "DEFAULT_VOCAB", "TOOLS_VOCAB", "MISMATCHED_VOCAB",
           "build_vocab", "write_tiny_model", "make_pair", "make_mismatched_draft", "write_tiny_recurrent",
           "quantize", "main"]


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
