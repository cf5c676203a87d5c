"""Whole-process benchmark: localspec as users run it, against the target alone run the same way.

Every run is a fresh ``localspec`` process (start-up, model loads, profile, prefill and decode
included), alternated with the target alone (``-d none -k 0``); the table gives medians over
`--repeat` pairs. Default settings run cold (an empty cost profile: the first run on a machine)
and warm (the profile earlier runs left). At T = 0 both sides produce the same text, so the ratio
is of wall times; at T > 0 texts differ in length, so the ratio is of wall time per generated
token (and the decode's tokens per second is shown beside it). A second table splits a warm
default run's time into its components, a third gives the n-gram drafter's ceiling per prompt
(what perfect planning with the context lookup could reach), a fourth times a 5-turn chat.

    python benchmarks/whole_process.py                          # every prompt, T = 0 and 0.8
    python benchmarks/whole_process.py --prompts code-edit --repeat 5 --temperatures 0
    python benchmarks/whole_process.py --skip-chat --tokens 64
    python benchmarks/whole_process.py --temperatures 0 --llama-completion   # and llama.cpp's own tool

Progress goes to stderr, the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.host import host_header
from benchmarks.common.options import add_prompts_option, check_prompts, progress
from benchmarks.common.prompts import CHAT_TURNS, GROUNDED_PROMPTS, WHOLE_PROCESS as PROMPTS
from benchmarks.common.runs import IN_PROCESS, TARGET_ALONE, Run, chat, localspec, profile_env
from benchmarks.process.whole_tables import ceiling_table, completion_table, kernels_table, llama_table, resident_table


def ratio(default: Sequence[Run], alone: Sequence[Run], temperature: float) -> float:
    """Speed of the default against the target alone: wall time (T = 0), or wall time per
    generated token (T > 0), medians."""
    if temperature == 0:
        return statistics.median(r.wall for r in alone) / statistics.median(r.wall for r in default)
    return (statistics.median(r.wall / max(r.tokens, 1) for r in alone)
            / statistics.median(r.wall / max(r.tokens, 1) for r in default))


def measure(args: argparse.Namespace, root: Path) -> tuple[list[str], dict[str, list[Run]], dict[str, list[Run]]]:
    """The main table, and the warm default's and the target alone's runs per prompt at the first
    temperature."""
    rows: list[str] = []
    warm_runs: dict[str, list[Run]] = {}
    alone_runs: dict[str, list[Run]] = {}
    alone_dir = root / "alone"
    for temperature in args.temperatures:
        warm_dir = root / f"warm-{temperature:g}"
        common = ["-n", str(args.tokens), "-t", f"{temperature:g}", "--seed", "1"]
        for name in args.prompts:  # the warm profile: what earlier runs of these prompts left
            progress(f"warm-up T={temperature:g} {name}")
            localspec(common, PROMPTS[name], warm_dir, args.threads)
        for name in args.prompts:
            cold, warm, alone = [], [], []
            for r in range(args.repeat):
                progress(f"T={temperature:g} {name} pair {r + 1}/{args.repeat}")
                cold.append(localspec(common, PROMPTS[name], root / f"cold-{temperature:g}-{name}-{r}", args.threads))
                alone.append(localspec([*common, *TARGET_ALONE], PROMPTS[name], alone_dir, args.threads))
                warm.append(localspec(common, PROMPTS[name], warm_dir, args.threads))
                alone.append(localspec([*common, *TARGET_ALONE], PROMPTS[name], alone_dir, args.threads))
            if temperature == args.temperatures[0]:  # the components table: the first temperature's runs
                warm_runs[name], alone_runs[name] = warm, alone
            med = statistics.median
            rows.append(
                f"| {name}{' (grounded)' if name in GROUNDED_PROMPTS else ''} | {temperature:g} | "
                f"{med(r.wall for r in alone):.2f} | {med(r.wall for r in cold):.2f} | {med(r.wall for r in warm):.2f} | "
                f"**{ratio(cold, alone, temperature):.2f}×** | **{ratio(warm, alone, temperature):.2f}×** | "
                f"{med(r.tokens for r in warm):.0f} | {med(r.decode_tps for r in alone):.1f} / "
                f"{med(r.decode_tps for r in warm):.1f} |")
    header = ["| prompt | T | target alone s | default cold s | default warm s | cold vs alone | warm vs alone | "
              "tokens | decode tok/s alone / warm |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    return header + rows, warm_runs, alone_runs


def components(runs: Sequence[Run]) -> list[str]:
    keys = [("import", "import_"), ("target load", "target_load"), ("draft load", "draft_load"),
            ("profile read/write", "profile_io"), ("prefill", "prefill"), ("decode", "decode")]
    lines = ["| component (warm default runs, median) | ms |", "| --- | ---: |"]
    for label, key in keys:
        values = [r.timings.get(key) or 0.0 for r in runs]
        lines.append(f"| {label} | {statistics.median(values) * 1e3:.0f} |")
    rest = [r.wall - sum((r.timings.get(k) or 0.0) for _, k in keys) for r in runs]
    lines.append(f"| everything else (exit, detokenizing, output) | {statistics.median(rest) * 1e3:.0f} |")
    lines.append(f"| whole process | {statistics.median(r.wall for r in runs) * 1e3:.0f} |")
    return lines


def chat_seconds(extra: Sequence[str], profile_dir: Path, threads: int | None, tokens: int) -> float:
    """Wall seconds of a fresh `localspec chat` answering CHAT_TURNS, piped."""
    args = [*IN_PROCESS, "-t", "0", "-n", str(tokens), *(["--threads", str(threads)] if threads else []), *extra]
    return chat(args, CHAT_TURNS, profile_env(profile_dir))


def chat_table(args: argparse.Namespace, root: Path) -> list[str]:
    default, alone = [], []
    for r in range(args.repeat):
        progress(f"5-turn chat, pair {r + 1}/{args.repeat}")
        default.append(chat_seconds([], root / "warm-0", args.threads, args.tokens))
        alone.append(chat_seconds(list(TARGET_ALONE), root / "alone", args.threads, args.tokens))
    d, a = statistics.median(default), statistics.median(alone)
    return ["| 5-turn chat, T = 0 | target alone s | default s | default vs alone |", "| --- | ---: | ---: | ---: |",
            f"| {len(CHAT_TURNS)} turns, up to {args.tokens} tokens each | {a:.2f} | {d:.2f} | **{a / d:.2f}×** |"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_prompts_option(p, PROMPTS)
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.8])
    p.add_argument("--repeat", type=int, default=3, help="alternated pairs per cell (default 3)")
    p.add_argument("--tokens", type=int, default=128, help="max tokens per run (default 128)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--skip-chat", action="store_true", help="no 5-turn chat table")
    p.add_argument("--skip-ceiling", action="store_true",
                   help="no n-gram ceiling table (computed when the first temperature is 0)")
    p.add_argument("--cpu-kernels-table", action="store_true",
                   help="also time the target alone under each --cpu-kernels configuration")
    p.add_argument("--only-extra", action="store_true",
                   help="skip the main tables: only the --cpu-kernels / --llama-completion / --resident ones")
    p.add_argument("--resident", action="store_true",
                   help="also: calls served by a resident service against calls in their own process")
    p.add_argument("--llama-completion", action="store_true",
                   help="also time llama.cpp's own llama-completion on the same prompts, whole process "
                        "(builds it natively once, a few minutes)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also run llama.cpp's n-gram modes (builds llama-speculative-simple once, a few minutes)")
    args = p.parse_args(argv)
    check_prompts(p, args.prompts, PROMPTS)
    if args.repeat < 1 or args.tokens < 1:
        p.error("--repeat and --tokens must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="localspec-whole-") as tmp:
        root = Path(tmp)
        print("\n".join(host_header()))
        if args.cpu_kernels_table:
            print("\n".join(kernels_table(args, root)))
            print()
        if args.only_extra:
            if args.llama_completion and 0.0 in args.temperatures:
                print("\n".join(completion_table(args, root)))
            if args.resident:
                print("\n".join(resident_table(args, root)))
            return 0
        table, warm_runs, alone_runs = measure(args, root)
        print("\n".join(table))
        print()
        print("\n".join(components([r for runs in warm_runs.values() for r in runs])))
        if not args.skip_ceiling and args.temperatures[0] == 0:
            print()
            print("\n".join(ceiling_table(args, alone_runs)))
        if not args.skip_chat:
            print()
            print("\n".join(chat_table(args, root)))
        if args.llama_cpp:
            print()
            print("\n".join(llama_table(args, root, warm_runs)))
        if args.llama_completion and 0.0 in args.temperatures:
            print()
            print("\n".join(completion_table(args, root)))
        if args.resident:
            print()
            print("\n".join(resident_table(args, root)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
