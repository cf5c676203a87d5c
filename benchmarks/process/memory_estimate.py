"""The memory estimate against what loading the default pair takes.

For each load configuration a fresh process estimates the pair (``localspec.estimate_memory``, from
the GGUF headers), then loads the target and the draft through localspec's loader with that
context, capturing llama.cpp's log (its weights, KV cache, compute and output buffer sizes), and
reads its resident memory (VmRSS) before the load, after it, and after a 512-token prompt in each
model. The estimate is checked against llama.cpp's own sizes (the target is ±15 %); the resident
memory shows what the buffers cost the process: llama.cpp's bookkeeping comes on top, and the
compute and output buffers take pages only as decodes reach them.

``--sweep`` checks the estimate much more widely instead: on tiny models of several shapes
(written here) and on the default pair's two models, each loaded once, it creates contexts over a
grid of cell counts, micro-batches, sequences, flash attention and cache types, and counts the
buffers whose estimate agrees with llama.cpp's log to the 0.01 MiB it prints.

    python benchmarks/memory_estimate.py
    python benchmarks/memory_estimate.py --configs default,q8_0
    python benchmarks/memory_estimate.py --sweep

Progress goes to stderr, the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.host import host_header
from benchmarks.common.options import progress

MiB = 2**20
CONFIGS: dict[str, dict[str, Any]] = {  # name -> load options (localspec.load_model's keywords)
    "default": {},
    "ctx 8192 x 1": {"ctx_size": 8192, "parallel": 1},
    "ctx 2048 x 8": {"ctx_size": 2048, "parallel": 8},
    "q8_0 cache": {"cache_type": "q8_0"},
    "batch 64": {"batch_size": 64},
    "no flash attn, ctx 4096 x 1": {"flash_attn": "off", "parallel": 1},
    "mmap": {"load_mode": "mmap"},
}
PROMPT_TOKENS = 512

CHILD = r'''
import json, re, sys, time
import localspec
from localspec.llama import backend, registry
from localspec.llama.memory import one_slot, reported_mib
from localspec.llama.model import Model
from localspec.settings.models import ModelOptions

def rss():
    return int(re.search(r"VmRSS:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

load = json.loads(sys.argv[1])
reg = registry.load_registry()
pair = reg.pairs[reg.default_pair]
paths = [registry.resolve(pair.target), registry.resolve(pair.draft)]
backend.init()
started = time.perf_counter()
estimate = localspec.estimate_memory(*paths, **load)
seconds = time.perf_counter() - started
options = one_slot(ModelOptions(**load))  # the context localspec creates for `load`
before = rss()
models, reported = [], []
for path in paths:
    with backend.capture_log() as lines:
        models.append(Model(path, options))
    reported.append(reported_mib(lines))
loaded = rss()
for model in models:
    model.prefill([model.bos if model.bos >= 0 else 0] + [100 + i % 1000 for i in range(511)], 0)
prompted = rss()
print(json.dumps({"estimate": estimate.as_dict(), "reported": reported, "seconds": seconds,
                  "rss": [before, loaded, prompted]}))
'''


def measure(load: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(load)], capture_output=True, text=True,
                         timeout=900, stdin=subprocess.DEVNULL, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the measuring process failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary_row(name: str, m: dict) -> str:
    estimate = m["estimate"]["total"] / MiB
    reported = sum(sum(r.values()) for r in m["reported"])
    before, loaded, prompted = (v / MiB for v in m["rss"])
    return (f"| {name} | {estimate:,.0f} | {reported:,.0f} | {estimate / reported:.3f} | {loaded - before:,.0f} | "
            f"{prompted - before:,.0f} | {m['seconds']:.2f} s |")


def terms_rows(name: str, m: dict) -> list[str]:
    rows = []
    for role, estimate, reported in zip(("target", "draft"), (m["estimate"]["target"], m["estimate"]["draft"]),
                                        m["reported"], strict=True):
        cells = " | ".join(f"{estimate[t] / MiB:,.2f} / {reported[t]:,.2f}"
                           for t in ("weights", "kv_cache", "compute", "output"))
        rows.append(f"| {name} | {role} | {cells} |")
    return rows


# ---------------------------------------------------------------- --sweep

SWEEP_SHAPES: dict[str, dict[str, Any]] = {  # tiny models (localspec.llama.tiny_pairs.write_tiny_model's keywords)
    "tiny (the tests' target)": {},
    "ffn 8x": dict(n_embd=128, n_head=4, n_head_kv=4, n_ff=1024),
    "4 layers, 64-value heads": dict(n_embd=128, n_head=2, n_head_kv=1, n_ff=256, n_layer=4),
    "no GQA, ffn 8x": dict(n_embd=256, n_head=8, n_head_kv=8, n_ff=2048),
    "qwen2, 128-value heads, ffn < embd": dict(n_embd=512, n_head=4, n_head_kv=1, n_ff=384, arch="qwen2"),
}
TINY_GRID = dict(ctx=(200, 1000, 4096, 20000), seqs=(4, 64), batch=(16, 50, 100, 512, 1024),
                 fa=("auto", "off"), cache=("f16", "f32", "q8_0"))
PAIR_GRID = dict(ctx=(256, 4096, 16384, 40000), seqs=(64,), batch=(16, 64, 512, 2048), fa=("auto", "off"),
                 cache=("f16", "f32", "q8_0"))
TERMS = ("weights", "kv_cache", "compute", "output")


def sweep_options(grid: dict, head_dim: int) -> Iterator[Any]:
    """The ModelOptions (one slot) of the grid that llama.cpp can create a context for."""
    from localspec.settings.models import ModelOptions

    for ctx, seqs, batch, fa, cache in itertools.product(*grid.values()):
        if seqs > batch or (cache == "q8_0" and (fa == "off" or head_dim % 32)):
            continue
        yield ModelOptions(ctx_size=ctx, parallel=1, n_seq_max=seqs, batch_size=batch, flash_attn=fa, cache_type=cache,
                           threads=1)


def context_mib(model: Any, options: Any) -> dict[str, float]:
    """llama.cpp's logged MiB of a context localspec would create for `options` (its parameters as
    Model._create_context sets them), on an already loaded llama_model."""
    import llama_cpp as lc

    from localspec.llama import backend
    from localspec.llama.memory import reported_mib
    from localspec.llama.model import CACHE_TYPES, FLASH_ATTN

    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = options.n_cells, options.batch_size, min(options.batch_size, 512)
    params.n_seq_max, params.kv_unified, params.n_threads = options.n_sequences, True, 1
    params.flash_attn_type = FLASH_ATTN[options.flash_attn]
    params.type_k = params.type_v = CACHE_TYPES[options.cache_type]
    with backend.capture_log() as lines:
        ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit(f"llama.cpp could not create a context for {options}")
    lc.llama_free(ctx)
    return reported_mib(lines)


def sweep_model(path: Path, grid: dict) -> dict:
    """Every configuration of the grid on the model at `path`: how many buffers agree to 0.01 MiB,
    and the worst ratio of the estimated to the reported total."""
    import llama_cpp as lc

    from localspec.llama import backend
    from localspec.llama.memory import estimate_model, read_facts, reported_mib

    facts = read_facts(path)
    params = lc.llama_model_default_params()
    params.load_mode = lc.LLAMA_LOAD_MODE_NONE
    with backend.capture_log() as lines:
        model = lc.llama_model_load_from_file(str(path).encode(), params)
    weights = reported_mib(lines)["weights"]
    agree = total = 0
    ratios = []
    for options in sweep_options(grid, facts.shape.head_dim_k):
        reported = {**context_mib(model, options), "weights": weights}
        estimate = estimate_model(path, options, facts)
        agree += sum(abs(getattr(estimate, t) / MiB - reported[t]) <= 0.006 for t in TERMS)
        total += len(TERMS)
        ratios.append(estimate.total / MiB / sum(reported.values()))
    lc.llama_model_free(model)
    return dict(configs=len(ratios), agree=agree, terms=total, low=min(ratios), high=max(ratios))


def sweep() -> list[str]:
    from localspec.llama import registry
    from localspec.llama.tiny_pairs import write_tiny_model

    reg = registry.load_registry()
    pair = reg.pairs[reg.default_pair]
    rows = ["| model | configurations | buffers within 0.01 MiB of llama.cpp's log | estimated / reported total |",
            "| --- | ---: | ---: | ---: |"]
    with tempfile.TemporaryDirectory() as tmp:
        models = [(name, write_tiny_model(Path(tmp) / f"m{i}.gguf", **shape), TINY_GRID)
                  for i, (name, shape) in enumerate(SWEEP_SHAPES.items())]
        models += [(name, registry.resolve(name), PAIR_GRID) for name in (pair.target, pair.draft)]
        for name, path, grid in models:
            progress(f"sweep: {name}")
            r = sweep_model(path, grid)
            rows.append(f"| {name} | {r['configs']} | {r['agree']} of {r['terms']} | {r['low']:.3f}-{r['high']:.3f} |")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/memory_estimate.py", description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS),
                   help=f"comma list of configurations (default all: {','.join(CONFIGS)})")
    p.add_argument("--sweep", action="store_true", help="check the estimate over a grid of contexts instead")
    args = p.parse_args(argv)
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.sweep:
        rows = sweep()
        print("\n".join(host_header() + rows))
        return 0
    results = {}
    for name in args.configs:
        progress(f"{name}: estimate, load, {PROMPT_TOKENS}-token prompt")
        results[name] = measure(CONFIGS[name])
    print("\n".join(host_header()))
    print("Default pair (Qwen2.5-Coder 1.5B target + 0.5B draft, Q4_K_M), both models; MiB.\n")
    print("| load options | estimate | llama.cpp reports | ratio | RSS after load | RSS after a 512-token prompt "
          "| estimate took |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, m in results.items():
        print(summary_row(name, m))
    print("\nEach buffer, estimate / llama.cpp's log (MiB):\n")
    print("| load options | model | weights | KV cache | compute | output |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, m in results.items():
        print("\n".join(terms_rows(name, m)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
