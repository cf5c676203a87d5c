"""Random-weight GGUF models shaped like the default pair, for measuring costs (benchmarks/gpu_check.py).

What a decode costs depends on a model's shape and weight types, not on its weights: a model
with Qwen 2.5 1.5B's dimensions (28 layers of 1536, 12 query and 2 KV heads, FFN 8960, a
151,936-token vocabulary) quantized to Q4_K_M costs what the real target costs per pass. These
files are written in seconds on the machine that measures (no download): F16 weights filled
from one random block (cheap to make: the values do not change the cost), then quantized by
llama.cpp's own quantizer, on all cores.

The vocabulary is localspec.llama.tiny_model's ``spm406`` padded with unused pieces to the real size,
so tokenizing, detokenizing and the output layer's size are realistic; the text the models
write is noise.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localspec.llama import tiny_model as tiny


@dataclass(frozen=True)
class ModelShape:
    """A qwen2-architecture model's dimensions."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int = 151936

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def parameters(self) -> int:
        """Weights of the matrices (embedding and output layer included)."""
        kv = self.n_head_kv * self.head_dim
        per_layer = 2 * self.n_embd * self.n_embd + 2 * self.n_embd * kv + 3 * self.n_embd * self.n_ff
        return self.n_layer * per_layer + 2 * self.n_vocab * self.n_embd


# Qwen 2.5 (Coder) 1.5B and 0.5B, as in the registry's default pair's GGUF files
TARGET_1_5B = ModelShape("qwen2.5-1.5b-shaped", 28, 1536, 12, 2, 8960)
DRAFT_0_5B = ModelShape("qwen2.5-0.5b-shaped", 24, 896, 14, 2, 4864)
# the same code path at a size a 2-core CPU writes and runs in a second (the check's --cpu dry run)
SMALL_TARGET = ModelShape("small-target-shaped", 2, 256, 4, 2, 512, n_vocab=4096)
SMALL_DRAFT = ModelShape("small-draft-shaped", 2, 128, 4, 2, 256, n_vocab=4096)
SHAPES = {"default": (TARGET_1_5B, DRAFT_0_5B), "small": (SMALL_TARGET, SMALL_DRAFT)}

Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M (Q4_K with Q6_K tensors, as the real files)
_BLOCK = 1_048_573  # a prime: tiled weights do not repeat along a row or between rows


def padded_vocab(n_vocab: int) -> tiny.Vocab:
    """tiny's ``spm406`` vocabulary (byte fallback, chat pieces) plus unused pieces up to n_vocab."""
    import gguf

    base = tiny.build_vocab(tiny.SPM406)
    extra = n_vocab - len(base.pieces)
    if extra < 0:
        raise ValueError(f"n_vocab {n_vocab} is smaller than the base vocabulary ({len(base.pieces)})")
    return tiny.Vocab(f"{base.name}+{extra}", base.pieces + [f"<unused{i}>" for i in range(extra)],
                      base.scores + [-1e9] * extra, base.types + [int(gguf.TokenType.UNUSED)] * extra)


class _Filler:
    """Tensors of a given shape and scale, cut from one random block at a moving offset."""

    def __init__(self, seed: int) -> None:
        self.block = np.random.default_rng(seed).standard_normal(_BLOCK).astype(np.float32)
        self.offset = 0

    def __call__(self, shape: tuple[int, ...], scale: float, centre: float = 0.0) -> np.ndarray:
        n = int(np.prod(shape))
        start = self.offset % _BLOCK
        self.offset += 7919
        reps = -(-(start + n) // _BLOCK)
        flat = np.tile(self.block, reps)[start:start + n] if reps > 1 else self.block[start:start + n]
        return (flat * np.float32(scale) + np.float32(centre)).astype(np.float16).reshape(shape)


def write_shaped_model(path: str | Path, shape: ModelShape, seed: int = 0) -> Path:
    """Write an F16 qwen2 GGUF file of this shape with random weights (tiny's scales) and return its path."""
    import gguf

    path = Path(path)
    vocab = padded_vocab(shape.n_vocab)
    fill = _Filler(seed)
    e, ff, kv = shape.n_embd, shape.n_ff, shape.n_head_kv * shape.head_dim
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_name(shape.name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(shape.n_vocab)
    w.add_context_length(32768)
    w.add_embedding_length(e)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    tiny.add_vocab(w, vocab, tiny.CHATML_TEMPLATE)

    def linear(n_out: int, n_in: int, gain: float) -> np.ndarray:
        return fill((n_out, n_in), gain / np.sqrt(n_in))

    def norm() -> np.ndarray:
        return fill((e,), 0.1, 1.0).astype(np.float32)  # ggml keeps norms in F32

    w.add_tensor("token_embd.weight", fill((shape.n_vocab, e), tiny.EMBED_STD))
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm())
        w.add_tensor(p + "attn_q.weight", linear(e, e, tiny.QK_GAIN))
        w.add_tensor(p + "attn_q.bias", np.zeros(e, np.float32))
        w.add_tensor(p + "attn_k.weight", linear(kv, e, tiny.QK_GAIN))
        w.add_tensor(p + "attn_k.bias", np.zeros(kv, np.float32))
        w.add_tensor(p + "attn_v.weight", linear(kv, e, tiny.VO_GAIN))
        w.add_tensor(p + "attn_v.bias", np.zeros(kv, np.float32))
        w.add_tensor(p + "attn_output.weight", linear(e, e, tiny.VO_GAIN))
        w.add_tensor(p + "ffn_norm.weight", norm())
        w.add_tensor(p + "ffn_gate.weight", linear(ff, e, tiny.FFN_GAIN))
        w.add_tensor(p + "ffn_up.weight", linear(ff, e, tiny.FFN_GAIN))
        w.add_tensor(p + "ffn_down.weight", linear(e, ff, tiny.FFN_GAIN))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", linear(shape.n_vocab, e, tiny.OUTPUT_GAIN))
    return tiny.write_added(path, w)


def quantize(source: str | Path, dest: str | Path, ftype: int = Q4_K_M, threads: int | None = None) -> Path:
    """llama.cpp's quantizer (llama_model_quantize) on all cores (tiny_model.quantize uses one)."""
    import llama_cpp as lc

    from localspec.llama import backend

    backend.init()  # llama.cpp's log (a line per tensor) goes to logging, not to stderr
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads or os.cpu_count() or 1
    dest = Path(dest)
    if lc.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params)) != 0:
        dest.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize {source} to ftype {ftype}")
    return dest


def f16_file(directory: str | Path, shape: ModelShape, seed: int) -> Path:
    """The F16 file of a shape in `directory`: written unless a complete one is there (files
    appear whole: written under another name, then renamed)."""
    path = Path(directory) / f"{shape.name}-f16.gguf"
    if not path.exists():
        part = path.with_name(path.name + ".part")
        write_shaped_model(part, shape, seed=seed)
        part.rename(path)
    return path


def shaped_pair(directory: str | Path, which: str = "default") -> tuple[Path, Path]:
    """The Q4_K_M target and draft of SHAPES[which] in `directory` (written once, reused after;
    the F16 files are removed once quantized)."""
    directory = Path(directory)
    out = []
    for seed, shape in enumerate(SHAPES[which]):
        final = directory / f"{shape.name}-q4_k_m.gguf"
        if not final.exists():
            f16 = f16_file(directory, shape, seed)
            part = final.with_name(final.name + ".part")
            quantize(f16, part)
            part.rename(final)
            f16.unlink()
        out.append(final)
    return out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.gpu.models --f16 DIR [default|small]``: write the F16 files (no
    llama.cpp needed: the GPU check runs this while llama.cpp compiles)."""
    import argparse
    import time

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--f16", type=Path, required=True, metavar="DIR")
    p.add_argument("which", nargs="?", default="default", choices=sorted(SHAPES))
    args = p.parse_args(argv)
    for seed, shape in enumerate(SHAPES[args.which]):
        if (args.f16 / f"{shape.name}-q4_k_m.gguf").exists():
            continue
        t0 = time.perf_counter()
        path = f16_file(args.f16, shape, seed)
        print(f"{path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
