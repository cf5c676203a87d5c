"""CPU kernel configurations side by side: what a target pass of n tokens costs under each.

For each of localspec's ``--cpu-kernels`` configurations that this llama.cpp build can load
(llama: llama.cpp's own choice of weight buffer types; repack: CPU_REPACK only; plain: none),
in one process, alternated round by round: the weight buffer types the model got, its load time,
c(1) and the cost curve c(n)/c(1) of a verification pass (every row's logits). Then what the
check of a configuration costs on a machine's first run (a child process on tiny quantized
models). The header names the CPU and llama.cpp's feature line: the figures belong to that host.

    python benchmarks/cpu_kernels.py                     # the default pair's target
    python benchmarks/cpu_kernels.py -m model.gguf --configs repack,plain --rounds 7

Progress goes to stderr, the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.host import host_header
from benchmarks.common.target import time_decode

SIZES = (1, 2, 3, 4, 5, 7, 8, 13, 16, 25, 32, 64, 256)
PER_TOKEN = (1, 4, 8, 16, 32, 64, 256)  # the second table: ms per token (decode ... prefill)
CONFIGS = ("llama", "repack", "plain")


def progress(message: str) -> None:
    print(f"[cpu_kernels] {message}", file=sys.stderr, flush=True)


def measure(path: Path, configs: Sequence[str], rounds: int, threads: int | None,
            force: bool = False) -> dict[str, dict]:
    """Per configuration: load seconds, weight buffers and the median seconds of each pass size."""
    from localspec.errors import ModelError
    from localspec.llama import buffer_types
    from localspec.llama.model import Model
    from localspec.settings.models import ModelOptions

    crashing = buffer_types.crashing_buffer_types()
    models: dict[str, Model] = {}
    out: dict[str, dict[str, Any]] = {}  # per configuration: its measurements, or its error
    for config in configs:
        if config == "llama" and crashing and not force:
            out[config] = {"error": f"skipped: llama.cpp's own choice includes {', '.join(crashing)} "
                                    "(known to crash; --force runs it)"}
            continue
        progress(f"loading {path.name} with --cpu-kernels {config}")
        t0 = time.perf_counter()
        try:
            models[config] = Model(path, ModelOptions(ctx_size=1024, threads=threads, cpu_kernels=config))
        except ModelError as exc:
            out[config] = {"error": str(exc)}
            continue
        out[config] = {"load": time.perf_counter() - t0, "buffers": models[config].weight_buffers,
                       "times": {n: [] for n in SIZES}}
    for model in models.values():
        time_decode(model, 1, 1)  # warm-up
    for r in range(rounds):
        progress(f"round {r + 1}/{rounds}")
        for config, model in models.items():  # alternated: drift hits every configuration alike
            for n in SIZES:
                out[config]["times"][n].append(time_decode(model, n, 1))
    for model in models.values():
        model.close()
    return out


def curve_table(results: dict[str, dict]) -> list[str]:
    shown = [n for n in SIZES[1:] if n <= 32]
    lines = ["c(n)/c(1): one target pass of n tokens with every row's logits, median of the rounds.", "",
             "| --cpu-kernels | weight buffers (MiB) | load s | c(1) ms | "
             + " | ".join(f"n={n}" for n in shown) + " |",
             "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in shown) + " |"]
    per_token = ["", "Milliseconds per token of a pass of n tokens (n = 1: plain decoding; "
                 "large n: a prompt's prefill):", "", "| --cpu-kernels | " + " | ".join(f"n={n}" for n in PER_TOKEN) + " |",
                 "| --- | " + " | ".join("---:" for _ in PER_TOKEN) + " |"]
    for config, r in results.items():
        if "error" in r:
            lines.append(f"| {config} | {r['error']} |")
            continue
        med = {n: statistics.median(ts) for n, ts in r["times"].items()}
        buffers = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["buffers"].items()))
        lines.append(f"| {config} | {buffers} | {r['load']:.2f} | {med[1] * 1e3:.1f} | "
                     + " | ".join(f"{med[n] / med[1]:.2f}" for n in shown) + " |")
        per_token.append(f"| {config} | " + " | ".join(f"{med[n] / n * 1e3:.1f}" for n in PER_TOKEN) + " |")
    return lines + per_token


def check_cost(path: Path, configs: Sequence[str]) -> list[str]:
    """What auto's first-run check of each configuration costs (a child process, measured)."""
    from localspec.llama import buffer_types, kernel_verdicts

    types = buffer_types.checked_types(buffer_types.read_weights(path))
    lines = ["", f"First-run check of a configuration on {'/'.join(types)} weights (a child process; later runs "
             "read the verdict):", "", "| --cpu-kernels | verdict | seconds |", "| --- | --- | ---: |"]
    for config in configs:
        progress(f"checking {config} in a child process")
        v = kernel_verdicts.run_check(config, types)
        lines.append(f"| {config} | {v.detail} | {v.seconds:.2f} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="GGUF path or registry name (default: the default target)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated (default: llama,repack,plain)")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds per configuration (default 5)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--force", action="store_true",
                   help="also run llama.cpp's own choice where it holds a buffer type known to crash (AMX)")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    if not configs or not set(configs) <= set(CONFIGS):
        p.error(f"--configs takes {', '.join(CONFIGS)}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    from localspec.llama import registry

    reg = registry.load_registry()
    path = registry.resolve(args.model or reg.pairs[reg.default_pair].target)
    results = measure(Path(path), configs, args.rounds, args.threads, args.force)
    print("\n".join(host_header() + curve_table(results) + check_cost(Path(path), configs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
