"""The whole-process benchmark's further tables (benchmarks.process.whole_process prints them): the
n-gram drafter's ceiling per prompt, llama.cpp's n-gram modes and its own llama-completion beside
localspec's default, calls served by a resident service against calls in their own process, and
the target alone under each CPU kernel configuration.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from benchmarks.common.host import llama_cpp_version
from benchmarks.common.llama_tools import (
    BENCH_CACHE,
    LLAMA_NGRAM_TYPES,
    build_llama_tools,
    completion_flags,
    llama_completion,
    native_llama_tools,
    speculative_simple,
)
from benchmarks.common.options import progress
from benchmarks.common.prompts import GROUNDED_PROMPTS, WHOLE_PROCESS as PROMPTS
from benchmarks.common.runs import TARGET_ALONE, Run, localspec
from benchmarks.common.target import chat_text, cost_curve, default_target, greedy_answer
from benchmarks.replay.ceiling import ngram_ceiling

TREE_ALTERNATIVES = 3  # first-token alternatives of the ceiling's tree of candidates


def ceiling_table(args: argparse.Namespace, alone_runs: dict[str, list[Run]]) -> list[str]:
    """Per prompt at T = 0: the n-gram drafter's ceiling on the target alone's output (the replays'
    oracle: every step drafts exactly the tokens the context lookup gets right, all accepted, costs
    from a cost curve measured now), and the whole-process ratio that decode ceiling would give
    (the target alone's other components unchanged); beside it, the same oracle for a tree of the
    proposal and first-token alternatives (an upper bound: it drafts only the branch that is right)."""
    from localspec.api import load_model
    from localspec.decoding.costs import CostTable
    from localspec.llama import registry

    progress("n-gram ceiling: cost curve and target-alone outputs")
    reg = registry.load_registry()
    lines = ["| prompt | output tokens | decode ceiling, n-gram lookup (k ≤ 31) | whole process at that ceiling "
             f"| decode ceiling, a tree of the proposal + {TREE_ALTERNATIVES} alternatives |",
             "| --- | ---: | ---: | ---: | ---: |"]
    options = {"threads": args.threads} if args.threads else {}
    with load_model(reg.pairs[reg.default_pair].target, **options) as target:
        cost = CostTable(cost_curve(target))
        for name in args.prompts:
            prompt, output = greedy_answer(target, PROMPTS[name], args.tokens)
            chain = ngram_ceiling(prompt, output, cost)
            tree = ngram_ceiling(prompt, output, cost, alternatives=TREE_ALTERNATIVES)
            wall = statistics.median(r.wall for r in alone_runs[name])
            decode = statistics.median(r.timings["decode"] for r in alone_runs[name])
            lines.append(f"| {name} | {len(output)} | {chain:.2f}× | {wall / (wall - decode + decode / chain):.2f}× "
                         f"| {tree:.2f}× |")
    return lines


def llama_ngram(bindir: Path, prompt: str, spec_type: str, tokens: int, threads: int | None) -> Run:
    """One llama-speculative-simple run at T = 0 with one of llama.cpp's n-gram modes (up to 32
    drafts; no draft model is loaded): its wall time and decode tokens/s."""
    return speculative_simple(bindir, ["-m", str(default_target()), "-p", prompt, "-n", str(tokens), "-c", "4096",
                                       "--temp", "0", "--seed", "1", "--spec-type", spec_type, "--spec-draft-n-max",
                                       "32", *(["-t", str(threads)] if threads else [])])


def llama_table(args: argparse.Namespace, root: Path, warm: dict[str, list[Run]]) -> list[str]:
    """localspec's default against llama.cpp's n-gram modes on the grounded prompts (T = 0).
    llama.cpp's tools take the prompt as plain text (no chat template), localspec its chat
    template: the decode rates compare the drafters, the wall times what each tool costs."""
    bindir = build_llama_tools(BENCH_CACHE, llama_cpp_version(), os.cpu_count() or 1)
    lines = ["| prompt | system | decode tok/s | whole process s |", "| --- | --- | ---: | ---: |"]
    for name in [n for n in args.prompts if n in GROUNDED_PROMPTS and n in warm]:
        runs = warm[name]
        lines.append(f"| {name} | localspec default (warm) | {statistics.median(r.decode_tps for r in runs):.1f} | "
                     f"{statistics.median(r.wall for r in runs):.2f} |")
        for spec_type in LLAMA_NGRAM_TYPES:
            progress(f"llama.cpp {spec_type} on {name}")
            try:
                got = [llama_ngram(bindir, PROMPTS[name], spec_type, args.tokens, args.threads)
                       for _ in range(args.repeat)]
            except RuntimeError as exc:
                lines.append(f"| {name} | llama.cpp {spec_type} | failed: {str(exc).splitlines()[0]} | |")
                continue
            lines.append(f"| {name} | llama.cpp {spec_type} | {statistics.median(g.decode_tps for g in got):.1f} | "
                         f"{statistics.median(g.wall for g in got):.2f} |")
    return lines


def completion_table(args: argparse.Namespace, root: Path) -> list[str]:
    """Whole process against llama.cpp's own llama-completion (native build, the same vendored
    commit), alternated with localspec's default (warm profile) and the target alone, T = 0."""
    bindir = native_llama_tools()
    common = ["-n", str(args.tokens), "-t", "0", "--seed", "1"]
    lines = [f"llama-completion flags: `{' '.join(completion_flags())}`, on the rendered chat prompt; "
             "the ratio is of wall time per generated token.", "",
             "| prompt | llama-completion s | tokens | target alone s | default warm s | tokens | "
             "alone vs llama-completion | default vs llama-completion |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    med = statistics.median
    warm_up = not (root / "warm-0").exists()  # --only-extra: no main table left a warm profile
    for name in args.prompts:
        text = chat_text(PROMPTS[name])
        if warm_up:  # the profile one earlier run of the prompt leaves
            localspec(common, PROMPTS[name], root / "warm-0", args.threads)
        llama, default, alone = [], [], []
        for r in range(args.repeat):
            progress(f"llama-completion vs localspec: {name} {r + 1}/{args.repeat}")
            llama.append(llama_completion(bindir, text, args.tokens, args.threads))
            default.append(localspec(common, PROMPTS[name], root / "warm-0", args.threads))
            alone.append(localspec([*common, *TARGET_ALONE], PROMPTS[name], root / "alone", args.threads))
        per_llama = med(x.wall / x.tokens for x in llama)
        lines.append(f"| {name} | {med(x.wall for x in llama):.2f} | {med(x.tokens for x in llama):.0f} | "
                     f"{med(r.wall for r in alone):.2f} | {med(r.wall for r in default):.2f} | "
                     f"{med(r.tokens for r in default):.0f} | "
                     f"{per_llama / med(r.wall / max(r.tokens, 1) for r in alone):.2f}× | "
                     f"**{per_llama / med(r.wall / max(r.tokens, 1) for r in default):.2f}×** |")
    return lines


def resident_table(args: argparse.Namespace, root: Path) -> list[str]:
    """Calls served by a resident service (the default: `--keep-alive 5m`, later calls) against
    calls in their own process (`--keep-alive 0`), the default settings and the target alone,
    T = 0, alternated: what keeping the models loaded is worth to a script making many calls
    (benchmarks/process/resident.py compares with llama.cpp's tools)."""
    from benchmarks.process.resident import Localspec, Prompt

    (root / "resident").mkdir()
    ls = Localspec(root / "resident", args.tokens, args.threads)
    med = statistics.median
    lines = ["| prompt | default, own process s | target alone, own process s | default, resident s | "
             "target alone, resident s | resident default vs own-process target alone |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    try:
        for name in args.prompts:
            prompt = Prompt(PROMPTS[name])
            own, own_alone, res, res_alone = [], [], [], []
            # each call asks a question of its own (its tag): no saved prompt of an earlier call is restored
            ls.call(prompt, f"{name}.warm")  # the services (the pair's, the target's alone), and the profile
            ls.call(prompt, f"{name}.warm-alone", extra=TARGET_ALONE)  # an earlier run leaves
            for r in range(args.repeat):
                progress(f"resident: {name} {r + 1}/{args.repeat}")
                own.append(ls.call(prompt, f"{name}.{r}.own", keep_alive="0"))
                own_alone.append(ls.call(prompt, f"{name}.{r}.own-alone", keep_alive="0", extra=TARGET_ALONE))
                res.append(ls.call(prompt, f"{name}.{r}.resident"))
                res_alone.append(ls.call(prompt, f"{name}.{r}.resident-alone", extra=TARGET_ALONE))
            walls = [med(s.wall for s in x) for x in (own, own_alone, res, res_alone)]
            lines.append(f"| {name} | {walls[0]:.2f} | {walls[1]:.2f} | {walls[2]:.2f} | {walls[3]:.2f} | "
                         f"**{med(s.per_token for s in own_alone) / med(s.per_token for s in res):.2f}×** |")
    finally:
        ls.close()
    return lines


def kernels_table(args: argparse.Namespace, root: Path) -> list[str]:
    """The target alone, whole process, under each CPU kernel configuration this build can load
    (alternated, T = 0): what the configuration auto picks is worth to a user, start-up included."""
    from localspec.llama import buffer_types

    configs = [c for c in ("llama", "repack", "plain")
               if c != "repack" or buffer_types.REPACK_BUFFER in buffer_types.extra_buffer_types()]
    if buffer_types.crashing_buffer_types():
        configs.remove("llama")  # it would crash the run
    common = ["-n", str(args.tokens), "-t", "0", "--seed", "1", *TARGET_ALONE]
    lines = ["| prompt | " + " | ".join(f"--cpu-kernels {c} s (decode tok/s)" for c in configs)
             + " | " + " | ".join(f"{c} vs plain" for c in configs if c != "plain") + " |",
             "| --- | " + " | ".join("---:" for _ in configs) + " | "
             + " | ".join("---:" for c in configs if c != "plain") + " |"]
    med = statistics.median
    for name in args.prompts:
        runs: dict[str, list[Run]] = {c: [] for c in configs}
        for r in range(args.repeat):
            for c in configs:
                progress(f"--cpu-kernels {c}: {name} {r + 1}/{args.repeat}")
                runs[c].append(localspec([*common, "--cpu-kernels", c], PROMPTS[name], root / "alone", args.threads))
        walls = {c: med(x.wall for x in runs[c]) for c in configs}
        lines.append(f"| {name} | " + " | ".join(f"{walls[c]:.2f} ({med(x.decode_tps for x in runs[c]):.1f})"
                                                  for c in configs)
                     + " | " + " | ".join(f"{walls['plain'] / walls[c]:.2f}×" for c in configs if c != "plain") + " |")
    return lines

