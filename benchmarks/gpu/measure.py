"""A pair shaped like the default one, written where the real one cannot be fetched, and its target's
cost curve. ``python -m benchmarks.gpu.measure DIR SHAPES`` writes the F32 files (no llama.cpp needed,
so the check runs it during the build); with a third argument JSON it quantizes and measures them.

Qwen 2.5 1.5B's and 0.5B's shapes and vocabulary size in Q4_K_M cost per pass what the default target
and draft cost, whatever the weights (localspec.llama.tiny_model's, its spm406 vocabulary padded).
Random weights never agree, so both models predict a fixed successor of the current token: the layers'
contributions to the residual stream are scaled down (QUIET), leaving the token's embedding as the last
hidden state, which the output layer maps to its successor (logit TOP above the others). The draft's
successor is the target's for a share AGREEMENT of the tokens, so about that share of drafted tokens is
accepted at any temperature (both models are near one-hot)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

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
    return tiny.Vocab(f"spm406+{extra}", base.pieces + [f"<unused{i}>" for i in range(extra)],
                      base.scores + [-1e9] * extra, base.types + [int(tiny.gguf_package().TokenType.UNUSED)] * extra)


def successors(ids: Sequence[int], agreement: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, the target's successor of each, the draft's): one cycle through `ids` in a random
    order; the draft's successor skips one for a random share 1 - `agreement` of the tokens."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.asarray(ids))
    target, draft = np.roll(order, -1), np.roll(order, -1)
    wrong = rng.choice(len(order), size=round((1 - agreement) * len(order)), replace=False)
    draft[wrong] = np.roll(order, -2)[wrong]
    return order, target, draft


def write_pair(directory: Path, shapes: str, quantized: bool = False) -> tuple[Path, Path]:
    """The target and draft of SHAPES[shapes] in `directory`, in F32 or, `quantized`, Q4_K_M (on all
    cores), each written unless there (renamed once whole)."""
    vocab = padded_vocab(SHAPES[shapes][0].n_vocab)
    normal = [i for i, t in enumerate(vocab.types) if t == int(tiny.gguf_package().TokenType.NORMAL)]
    tokens, *nexts = successors(normal, AGREEMENT)
    paths = []
    for seed, (role, shape, next_ids) in enumerate(zip(("target", "draft"), SHAPES[shapes], nexts, strict=True)):
        f32, q4 = (directory / f"{shapes}-{role}-{kind}.gguf" for kind in ("f32", "q4_k_m"))
        if not f32.exists() and not q4.exists():
            tensors = tiny.llama_tensors(shape, np.random.default_rng(seed))
            embd = tensors["token_embd.weight"]
            tensors["output.weight"] = out = np.zeros_like(tensors["output.weight"])
            np.add.at(out, next_ids, embd[tokens] * np.float32(TOP / embd.shape[1]))
            for name, w in tensors.items():
                if name.endswith(("attn_output.weight", "ffn_down.weight")):
                    w *= np.float32(QUIET)
            tiny.write_llama(f32.with_suffix(".part"), tensors, shape, vocab, name=f"shaped-{shapes}-{role}",
                             n_ctx_train=32768, arch="qwen2").rename(f32)
        if quantized and not q4.exists():
            tiny.quantize(f32, q4.with_suffix(".part"), QUANTIZATIONS["q4_k_m"], threads=os.cpu_count() or 1)
            q4.with_suffix(".part").rename(q4)
            f32.unlink()
        paths.append(q4 if quantized else f32)
    return paths[0], paths[1]


def measure(target_path: Path, draft_path: Path) -> dict:
    """Both models, every layer offloaded: the target's c(n) for n in CURVE and the draft's c(1) (median
    seconds of ROUNDS passes with every row's logits), where their weights went, the llama.cpp build."""
    from localspec.llama.host import machine
    from localspec.llama.model import Model
    from localspec.settings.models import ModelOptions

    from benchmarks.common.target import cost_curve

    options = ModelOptions(ctx_size=2048, n_gpu_layers=-1)
    with Model(target_path, options) as target, Model(draft_path, options) as draft:
        curve = cost_curve(target, sizes=CURVE, rounds=ROUNDS)
        draft_c1 = cost_curve(draft, sizes=(1,), rounds=ROUNDS)[1]
        weights = {"target": target.weight_buffers, "draft": draft.weight_buffers}
    return {"target": str(target_path), "draft": str(draft_path), "curve": curve, "draft_c1": draft_c1,
            "rounds": ROUNDS, "weights_mib": weights, "agreement": AGREEMENT, **machine()}


if __name__ == "__main__":
    directory, shapes, *json_path = Path(sys.argv[1]), *sys.argv[2:]
    directory.mkdir(parents=True, exist_ok=True)
    pair = write_pair(directory, shapes, quantized=bool(json_path))
    if json_path:
        Path(json_path[0]).write_text(json.dumps({"shapes": shapes, **measure(*pair)}, indent=1) + "\n")
