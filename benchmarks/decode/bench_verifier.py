"""Verifier micro-benchmark: microseconds per call of the C verifier next to the numpy reference.

    python benchmarks/bench_verifier.py            # full table (a few minutes)
    python benchmarks/bench_verifier.py --quick    # V = 151936 only

Inputs imitate a language model: target logits N(0, 3) per row plus a shared component, draft
probabilities from the target logits with N(0, 1) noise, draft tokens drawn from the draft rows
(trees without replacement). Two samplers: "T=1" keeps every token (dense passes over the whole
vocabulary) and "default" is llama.cpp's (T=0.8, top-k 40, top-p 0.95, min-p 0.05), where the
verifier only walks the kept tokens. Timings are medians over seeds, one thread; the table goes to stdout
as markdown, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from localspec.settings.sampling import DEFAULT_SAMPLING, SamplingParams
from localspec.verify import reference, verifier

log = logging.getLogger(__name__)

VOCABS = (32000, 151936, 262144)
CHAIN_METHODS = ("greedy", "match", "token", "block", "rrsw", "traversal")
TREE_METHODS = ("greedy", "match", "rrs", "rrsw", "traversal")
TREE_15 = (3, 2, 1)  # 3 + 6 + 6 = 15 nodes
SAMPLINGS = {
    "T=1": SamplingParams(1.0),  # every token kept: dense passes over the vocabulary
    "default": DEFAULT_SAMPLING,  # llama.cpp's defaults
}


@dataclass
class Row:
    method: str
    shape: str
    vocab: int
    sampling: str
    c_us: float
    numpy_us: float
    accepted: float

    @property
    def speedup(self) -> float:
        return self.numpy_us / self.c_us


def _draft_rows(logits: np.ndarray, rng: np.random.Generator, sampling: SamplingParams) -> np.ndarray:
    noisy = (logits + rng.normal(0.0, 1.0, size=logits.shape)).astype(np.float32)
    return verifier.probs(noisy, dtype=np.float32, sampling=sampling)


def make_instance(shape: str, vocab: int, rng: np.random.Generator, sampling: SamplingParams = SamplingParams()):
    """(logits, draft, tokens, parents) for 'chain-G', 'paths-KxL' or 'tree-15'."""
    if shape.startswith("chain-"):
        parents = [j - 1 for j in range(int(shape.split("-")[1]))]
    elif shape.startswith("paths-"):
        k, length = (int(v) for v in shape.split("-")[1].split("x"))
        parents = [(-1 if j % length == 0 else j - 1) for j in range(k * length)]
    else:
        parents, frontier = [], [-1]
        for width in TREE_15:
            nxt = []
            for p in frontier:
                for _ in range(width):
                    parents.append(p)
                    nxt.append(len(parents) - 1)
            frontier = nxt
    n = len(parents)
    shared = rng.normal(0.0, 3.0, size=vocab)
    logits = (shared + rng.normal(0.0, 1.5, size=(n + 1, vocab))).astype(np.float32)
    draft = _draft_rows(logits, rng, sampling)
    tokens: list[int] = []
    siblings: dict[int, list[int]] = {}
    for p in parents:
        taken = siblings.setdefault(p, [])
        tokens.append(verifier.sample_probs(draft[p + 1], float(rng.random()), exclude=taken))
        taken.append(tokens[-1])
    return logits, draft, tokens, parents


def _median_us(fn: Callable[[int], object], seeds: range) -> float:
    times = []
    for s in seeds:
        t = time.perf_counter()
        fn(s)
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e6)


def bench_one(method: str, shape: str, vocab: int, repeat: int, numpy_repeat: int,
              sampling: str = "T=1") -> Row:
    rng = np.random.default_rng(vocab + len(shape))
    settings = SAMPLINGS[sampling]
    logits, draft, tokens, parents = make_instance(shape, vocab, rng, settings)
    accepted = []

    def run_c(seed: int) -> None:
        v = verifier.verify(method, logits, draft, tokens, parents, seed=seed, sampling=settings)
        accepted.append(v.n_accepted)

    def run_numpy(seed: int) -> None:
        u = np.random.default_rng(seed).random(len(tokens) + 1)
        tp = reference.transform(logits, **asdict(settings))
        reference.verify(method, tp, draft, tokens, parents, reference.Uniforms(u))

    run_c(0)  # warm the workspace
    c_us = _median_us(run_c, range(repeat))
    numpy_us = _median_us(run_numpy, range(numpy_repeat))
    return Row(method, shape, vocab, sampling, c_us, numpy_us, float(np.mean(accepted)))


def bench_cases(quick: bool) -> list[tuple[str, str, int, str]]:
    vocabs = (151936,) if quick else VOCABS
    cases = []
    for sampling in SAMPLINGS:
        for vocab in vocabs:
            for g in (4, 8):
                cases += [(m, f"chain-{g}", vocab, sampling) for m in CHAIN_METHODS]
                cases += [(m, f"paths-{k}x{g}", vocab, sampling) for m in ("gbv", "batch") for k in (1, 3)]
            cases += [(m, "tree-15", vocab, sampling) for m in TREE_METHODS]
    return cases


def markdown(rows: list[Row]) -> str:
    out = ["| sampling | method | shape | V | C µs/call | numpy µs/call | C speed-up | mean accepted |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r.sampling} | {r.method} | {r.shape} | {r.vocab} | {r.c_us:,.0f} | {r.numpy_us:,.0f} | "
                   f"{r.speedup:,.1f}× | {r.accepted:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only V = 151936")
    ap.add_argument("--repeat", type=int, default=30, help="C calls per case (default 30)")
    ap.add_argument("--numpy-repeat", type=int, default=3, help="numpy reference calls per case (default 3)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    rows = []
    for method, shape, vocab, sampling in tqdm(bench_cases(args.quick), desc="verifier bench", file=sys.stderr):
        rows.append(bench_one(method, shape, vocab, args.repeat, args.numpy_repeat, sampling))
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}")
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) | {"speedup": r.speedup} for r in rows], fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
