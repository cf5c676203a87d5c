"""A pair shaped like the default one, written where the real one cannot be fetched, and its
target's cost curve (benchmarks/gpu/check.py).

A pass costs what the model's shape and weight types cost, whatever the weights: Qwen 2.5 1.5B's
and 0.5B's dimensions and vocabulary size, in Q4_K_M, cost per pass what the default target and
draft cost. The files are written by localspec.llama.tiny_model (random weights at its scales, its
spm406 vocabulary padded with unused pieces) and quantized by llama.cpp. Random weights never
agree, so both models predict a fixed successor of the current token: each layer's contribution
to the residual stream is scaled down (QUIET), leaving the token's embedding as the last hidden
state, which the output layer maps to its successor's logit (TOP above the others). The
successors form one cycle through the normal pieces; the draft's is the target's after a share
AGREEMENT of the tokens and the next one after the rest, so drafted tokens are accepted about
that often, at any temperature (both models are near one-hot)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from localspec.llama import tiny_model as tiny
from localspec.llama.tiny_pairs import QUANTIZATIONS

SHAPES = {  # (target, draft)
    "default": (tiny.LlamaShape(151936, 28, 1536, 12, 2, 8960), tiny.LlamaShape(151936, 24, 896, 14, 2, 4864)),
    "small": (tiny.LlamaShape(4096, 2, 256, 4, 2, 512), tiny.LlamaShape(4096, 2, 128, 4, 2, 256)),  # a CPU dry run
}
AGREEMENT = 0.8  # share of tokens after which the draft predicts the target's next token
TOP = 24.0  # logit of the successor; the others' are ~N(0, TOP / sqrt(n_embd))
QUIET = 1e-3  # scale of the layers' contributions to the residual stream
CURVE = (1, 2, 4, 8, 16, 32)  # tokens per target pass
ROUNDS = 5


def padded_vocab(n_vocab: int) -> tiny.Vocab:
    """tiny's spm406 vocabulary plus unused pieces up to n_vocab."""
    base = tiny.build_vocab(tiny.SPM406)
    extra = n_vocab - len(base.pieces)
    unused = int(tiny.gguf_package().TokenType.UNUSED)
    return tiny.Vocab(f"spm406+{extra}", base.pieces + [f"<unused{i}>" for i in range(extra)],
                      base.scores + [-1e9] * extra, base.types + [unused] * extra)


def successors(ids: Sequence[int], agreement: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, the target's successor of each, the draft's): one cycle through `ids` in a random
    order; the draft's successor skips one for a random share 1 - `agreement` of the tokens."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.asarray(ids))
    target, draft = np.roll(order, -1), np.roll(order, -1)
    wrong = rng.choice(len(order), size=round((1 - agreement) * len(order)), replace=False)
    draft[wrong] = np.roll(order, -2)[wrong]
    return order, target, draft


def follow(tensors: dict[str, np.ndarray], tokens: np.ndarray, nexts: np.ndarray) -> None:
    """In place: the model's next token after tokens[i] is nexts[i] (the module's docstring)."""
    embd = tensors["token_embd.weight"]
    out = np.zeros_like(tensors["output.weight"])
    np.add.at(out, nexts, embd[tokens] * np.float32(TOP / embd.shape[1]))
    tensors["output.weight"] = out
    for name, w in tensors.items():
        if name.endswith(("attn_output.weight", "ffn_down.weight")):
            w *= np.float32(QUIET)


def write_pair(directory: Path, shapes: str = "default") -> tuple[Path, Path]:
    """The F32 target and draft of SHAPES[shapes] in `directory` (written unless there; a file
    appears whole, renamed once written)."""
    vocab = padded_vocab(SHAPES[shapes][0].n_vocab)
    normal = [i for i, t in enumerate(vocab.types) if t == int(tiny.gguf_package().TokenType.NORMAL)]
    tokens, *nexts = successors(normal, AGREEMENT)
    paths = []
    for seed, (role, shape, next_ids) in enumerate(zip(("target", "draft"), SHAPES[shapes], nexts)):
        path = directory / f"{shapes}-{role}-f32.gguf"
        if not path.exists():
            tensors = tiny.llama_tensors(shape, np.random.default_rng(seed))
            follow(tensors, tokens, next_ids)
            part = tiny.write_llama(path.with_suffix(".part"), tensors, shape, vocab, name=f"shaped-{shapes}-{role}",
                                    n_ctx_train=32768, arch="qwen2")
            part.rename(path)
        paths.append(path)
    return paths[0], paths[1]


def quantized_pair(directory: Path, shapes: str = "default") -> tuple[Path, Path]:
    """The Q4_K_M target and draft (written and quantized on all cores unless there)."""
    out = []
    for f32 in write_pair(directory, shapes):
        path = f32.with_name(f32.name.replace("-f32", "-q4_k_m"))
        if not path.exists():
            tiny.quantize(f32, path.with_suffix(".part"), QUANTIZATIONS["q4_k_m"], threads=os.cpu_count() or 1)
            path.with_suffix(".part").rename(path)
            f32.unlink()
        out.append(path)
    return out[0], out[1]


def measure(target_path: Path, draft_path: Path, rounds: int = ROUNDS) -> dict:
    """Both models loaded with every layer offloaded: the target's c(n) for n in CURVE (median
    seconds of `rounds`, every row's logits: a verification pass), the draft's c(1), where each
    model's weights went, and the llama.cpp build."""
    import llama_cpp

    from localspec.llama.host import machine
    from localspec.llama.model import Model
    from localspec.settings.models import ModelOptions

    from benchmarks.common.target import cost_curve

    options = ModelOptions(ctx_size=2048, n_gpu_layers=-1)
    with Model(target_path, options) as target, Model(draft_path, options) as draft:
        curve = cost_curve(target, sizes=CURVE, rounds=rounds)
        draft_c1 = cost_curve(draft, sizes=(1,), rounds=rounds)[1]
        weights = {"target": target.weight_buffers, "draft": draft.weight_buffers}
    return {"target": str(target_path), "draft": str(draft_path), "curve": curve, "draft_c1": draft_c1, "rounds": rounds,
            "weights_mib": weights, "agreement": AGREEMENT, "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
            **machine()}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.gpu.measure DIR [--shapes S] [--write-only | --json PATH]``."""
    p = argparse.ArgumentParser(description="The shaped pair in DIR and its target's cost curve.")
    p.add_argument("directory", type=Path)
    p.add_argument("--shapes", choices=sorted(SHAPES), default="default")
    p.add_argument("--write-only", action="store_true", help="only write the F32 files (needs no llama.cpp)")
    p.add_argument("--json", type=Path, help="where the measurement goes (JSON)")
    args = p.parse_args(argv)
    args.directory.mkdir(parents=True, exist_ok=True)
    if args.write_only:
        write_pair(args.directory, args.shapes)
        return 0
    result = {"shapes": args.shapes, **measure(*quantized_pair(args.directory, args.shapes))}
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
