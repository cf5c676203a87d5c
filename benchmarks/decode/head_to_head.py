#!/usr/bin/env python3
"""Head to head: localspec against llama.cpp's own speculative decoding, on the default pair.

    python benchmarks/head_to_head.py                       # builds llama.cpp tools once (~5 min)
    python benchmarks/head_to_head.py --repeat 2 --out docs/head-to-head.md   # the committed report
    python benchmarks/head_to_head.py --skip-throughput --skip-memory        # verifier comparison only
    python benchmarks/head_to_head.py --llama-bin ~/llama.cpp/build/bin

One run measures, on the same prompts (chat-templated code, prose, code-edit, summarise) with
the same sampling settings and threads: the target alone (localspec, draft=None: the baseline),
llama.cpp's ``llama-speculative-simple`` with the draft model and with ngram-mod, built from the
llama.cpp source that the installed llama-cpp-python vendors, and localspec with each verifier
and drafter. It prints markdown tables (tok/s, speedup against the target alone, block
efficiency, acceptance, verifier share of step time), a what-if table of predicted speedups for
cheaper drafts, a paired verifier comparison at T = 1, γ = 8 (every verifier on the same drafts
at the same contexts, with bootstrap intervals: benchmarks/decode/efficiency.py), and peak memory at an 8k
context per load mode and KV cache type.
Progress goes to stderr, tables to stdout (and to --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from localspec.api import load_model, stream_generate
from localspec.llama import registry
from localspec.prompt import check_messages, render_messages, template_of

from benchmarks.common.host import llama_cpp_version, machine_line
from benchmarks.common.llama_tools import build_llama_tools, speculative_simple
from benchmarks.common.options import add_prompts_option, check_prompts
from benchmarks.common.prompts import GROUNDED, PROMPTS
from benchmarks.common.target import chat_tokens, cost_curve
from benchmarks.decode.efficiency import default_groups, paired_scores, target_contexts
from benchmarks.decode.head_to_head_report import (
    K,
    Row,
    cost_curve_report,
    efficiency_report,
    merge_repeats,
    ngram_ceiling_report,
    throughput_report,
)
from benchmarks.decode.memory import memory_report

log = logging.getLogger("head_to_head")


class Sampling(TypedDict):
    """Sampling settings as keyword arguments (of stream_generate; llama.cpp's flags on the other side)."""

    top_k: int
    top_p: float
    min_p: float


SAMPLING: Sampling = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama.cpp's defaults, used on both sides


# ---------------------------------------------------------------- llama.cpp's runs


def run_llama_speculative(bindir: Path, target: Path, draft: Path, prompt_text: str, spec_type: str,
                          temperature: float, tokens: int, threads: int, seed: int) -> dict:
    """One llama-speculative-simple run (benchmarks.common.llama_tools); its decode speed and draft statistics."""
    args = ["-m", str(target), "-p", prompt_text, "-n", str(tokens),
            "-c", "4096", "-t", str(threads), "--temp", str(temperature), "--top-k", str(SAMPLING["top_k"]),
            "--top-p", str(SAMPLING["top_p"]), "--min-p", str(SAMPLING["min_p"]), "--seed", str(seed),
            "--spec-type", spec_type, "--spec-draft-n-max", str(K)]
    if spec_type.startswith("draft"):
        args += ["-md", str(draft), "-td", str(threads)]
    run = speculative_simple(bindir, args)
    if "drafted" not in run.data or "accepted" not in run.data:
        raise RuntimeError(f"llama-speculative-simple printed no draft statistics:\n{(run.stdout + run.stderr)[-2000:]}")
    return dict(tokens=run.tokens, seconds=run.data["seconds"], drafted=run.data["drafted"],
                accepted=run.data["accepted"])


# ---------------------------------------------------------------- localspec runs


def run_localspec(target: Any, draft: Any, prompt_tokens: list[int], temperature: float, tokens: int, seed: int,
                  **spec: Any) -> dict:
    """One generation in this process: its statistics and output tokens."""
    last, output = None, []
    for last in stream_generate(target, draft, prompt_tokens, max_tokens=tokens, temperature=temperature,
                                seed=seed, **SAMPLING, **spec):
        if last.token is not None:
            output.append(last.token)
    assert last is not None  # a generation's last response carries its finish reason: there is one
    s = last.stats
    return dict(tokens=s.generated_tokens, seconds=s.elapsed_seconds, passes=s.target_passes,
                drafted=s.drafted_tokens, accepted=s.accepted_tokens, verify_share=s.verifier_share,
                output=output)


LOCALSPEC_CONFIGS = [  # (drafter, verifier, plan, uses the draft model)
    ("model", "match", "fixed"),
    ("model", "token", "fixed"),
    ("model", "block", "fixed"),
    ("model", "block", "auto"),
    ("ngram", "block", "fixed"),
    ("ngram", "block", "auto"),
    ("hybrid", "block", "fixed"),
    ("hybrid", "block", "auto"),
]


def localspec_configs(prompt: str, ngram_k: int) -> list[tuple[str, str, str, int]]:
    """(drafter, verifier, plan label, draft length) of localspec's runs on one prompt: the fixed set at
    k = K, plus n-gram and hybrid drafts planned up to ngram_k tokens on the input-grounded prompts."""
    configs = [(drafter, verifier, plan, K) for drafter, verifier, plan in LOCALSPEC_CONFIGS]
    if ngram_k and prompt in GROUNDED:
        configs += [(drafter, "block", f"auto k{ngram_k}", ngram_k) for drafter in ("ngram", "hybrid")]
    return configs


def measure_all(args: argparse.Namespace, target: Any, draft: Any, target_path: Path, draft_path: Path,
                bindir: Path | None) -> tuple[list[Row], dict[tuple[str, float], tuple[list[int], list[int]]]]:
    """Every throughput row (repeats merged), and per (prompt, T) the prompt tokens and the target-only
    run's output tokens."""
    rows: list[Row] = []
    outputs: dict[tuple[str, float], tuple[list[int], list[int]]] = {}
    prompts = {name: PROMPTS[name] for name in args.prompts}
    total = sum(len(args.temperatures) * args.repeat * (1 + len(localspec_configs(name, args.ngram_k))
                                                        + (2 if bindir else 0)) for name in prompts)
    done = 0

    def progress(run: str, what: str) -> None:
        nonlocal done
        done += 1
        print(f"\r[{done}/{total}] {run} {what:<40}", end="", file=sys.stderr, flush=True)

    for name, prompt in prompts.items():
        text = render_messages(target, template_of(target), check_messages([{"role": "user", "content": prompt}]),
                               True, None)
        ptoks = chat_tokens(target, prompt)
        for t, rep in ((t, rep) for t in args.temperatures for rep in range(args.repeat)):
            run = f"{name} T={t:g} #{rep + 1}"
            progress(run, "target only")
            r = run_localspec(target, None, ptoks, t, args.tokens, args.seed, num_draft_tokens=0)
            rows.append(Row(name, t, "localspec", "-", "target only", "-", r["tokens"], r["seconds"], 1.0,
                            None, r["verify_share"]))
            outputs.setdefault((name, t), (ptoks, r["output"]))
            for drafter, verifier, plan, k in localspec_configs(name, args.ngram_k):
                progress(run, f"localspec {drafter} {verifier} {plan}")
                r = run_localspec(target, None if drafter == "ngram" else draft, ptoks, t, args.tokens, args.seed,
                                  verifier=verifier, num_draft_tokens=k, drafter=drafter, plan=plan.split()[0])
                rows.append(Row(name, t, "localspec", drafter, verifier, plan, r["tokens"], r["seconds"],
                                r["tokens"] / r["passes"], r["accepted"] / r["drafted"] if r["drafted"] else None,
                                r["verify_share"]))
            if bindir is None:
                continue
            for spec_type, drafter in (("draft-simple", "model"), ("ngram-mod", "ngram")):
                progress(run, f"llama.cpp {spec_type}")
                r = run_llama_speculative(bindir, target_path, draft_path, text, spec_type, t, args.tokens,
                                          args.threads, args.seed)
                steps = r["tokens"] - r["accepted"]  # each step commits its accepted tokens + one
                rows.append(Row(name, t, "llama.cpp", drafter, "match", "fixed", r["tokens"], r["seconds"],
                                r["tokens"] / steps if steps > 0 else None,
                                r["accepted"] / r["drafted"] if r["drafted"] else None, None))
    print("", file=sys.stderr)
    return merge_repeats(rows), outputs


def verifier_efficiency(args: argparse.Namespace, target: Any, draft: Any) -> tuple[dict[str, np.ndarray], int]:
    """Paired block efficiencies at T = 1, γ = 8 (efficiency.py): every verifier on the same
    drafts at the same contexts (prefixes of text the target sampled alone from each prompt)."""
    prompts = [chat_tokens(target, PROMPTS[name]) for name in args.prompts]
    log.info("sampling efficiency contexts")
    contexts = target_contexts(target, prompts, args.efficiency_tokens, range(args.efficiency_seeds),
                               args.efficiency_stride)
    groups = default_groups(gamma=8, paths=3, trees=((3, 2, 1, 1, 1, 1, 1, 1),))
    return paired_scores(target, draft, contexts, groups, draws=args.efficiency_draws, seed=args.seed,
                         progress=True), len(contexts)


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per run (default 128)")
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.8],
                   help="comma list (default 0,0.8)")
    p.add_argument("--repeat", type=int, default=1,
                   help="time every run this many times, interleaved, and report the totals (default 1)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both tools")
    p.add_argument("--seed", type=int, default=1)
    add_prompts_option(p, PROMPTS)
    p.add_argument("--ngram-k", type=int, default=0,
                   help="also run n-gram and hybrid drafts planned (auto) up to this many tokens on the "
                        "input-grounded prompts (default 0: only k = 4)")
    p.add_argument("--llama-bin", type=Path, default=None,
                   help="directory with llama-speculative-simple (default: build it from the vendored source)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's runs")
    p.add_argument("--efficiency-tokens", type=int, default=96,
                   help="tokens the target samples per prompt for the T=1, γ=8 comparison's contexts")
    p.add_argument("--efficiency-stride", type=int, default=2, help="every Nth of those tokens is a context")
    p.add_argument("--efficiency-seeds", type=int, default=1, help="target samples per prompt")
    p.add_argument("--efficiency-draws", type=int, default=64, help="verifier draws per draft")
    p.add_argument("--skip-throughput", action="store_true", help="skip the tok/s tables (and llama.cpp)")
    p.add_argument("--skip-efficiency", action="store_true", help="skip the T=1, γ=8 verifier comparison")
    p.add_argument("--skip-memory", action="store_true", help="skip the RSS measurements")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    p.add_argument("--json", type=Path, default=None, help="write the raw rows as JSON here")
    args = p.parse_args(argv)
    check_prompts(p, args.prompts, PROMPTS)
    if args.ngram_k < 0:
        p.error(f"--ngram-k must be 0 (off) or a draft length, got {args.ngram_k}")
    for name in ("tokens", "repeat", "threads", "efficiency_tokens", "efficiency_stride", "efficiency_seeds",
                 "efficiency_draws"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    reg = registry.load_registry()
    pair = reg.pairs[reg.default_pair]
    target_path, draft_path = registry.resolve(pair.target), registry.resolve(pair.draft)
    bindir = None
    if not (args.no_llama_cpp or args.skip_throughput):
        bindir = args.llama_bin or build_llama_tools(registry.cache_dir().parent, llama_cpp_version(),
                                                     args.threads)
    started = time.time()
    report = [f"Machine: {machine_line()}.",
              f"Pair: {pair.target} (target) + {pair.draft} (draft); {args.tokens} tokens per run, "
              f"seed {args.seed}, threads {args.threads}, top-k {SAMPLING['top_k']}, top-p {SAMPLING['top_p']}, "
              f"min-p {SAMPLING['min_p']}, draft length {K}.", ""]
    rows: list[Row] = []
    if not (args.skip_throughput and args.skip_efficiency):
        target = load_model(target_path, threads=args.threads)
        draft = load_model(draft_path, threads=args.threads)
        try:
            if not args.skip_throughput:
                rows, outputs = measure_all(args, target, draft, target_path, draft_path, bindir)
                print("target cost curve ...", file=sys.stderr, flush=True)
                curve = cost_curve(target)
                report += throughput_report(rows)
                report += [""] + cost_curve_report(curve) + [""] + ngram_ceiling_report(outputs, curve, rows)
            if not args.skip_efficiency:
                scores, n_contexts = verifier_efficiency(args, target, draft)
                report += ["", "## Block efficiency at T = 1, γ = 8 (paired: same contexts, same drafts)", ""]
                report += efficiency_report(scores, n_contexts, args)
        finally:
            target.close()
            draft.close()
    if not args.skip_memory:
        report += ["", "## Memory at an 8k context", ""] + memory_report(target_path, draft_path, args.threads)
    report += ["", f"_Measured in {time.time() - started:.0f} s with `python benchmarks/head_to_head.py"
               f"{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`._"]
    text = "\n".join(report)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
