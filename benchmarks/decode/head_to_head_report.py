"""The head-to-head benchmark's tables (benchmarks.decode.head_to_head measures them): its rows
(:class:`Row`, repeats merged), tok/s and speedups, the issue's targets as ratios, a what-if table
of cheaper drafts, the cost model, the n-gram ceiling on the input-grounded prompts and the
paired verifier comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from localspec.decoding.costs import CostTable

from benchmarks.common.prompts import GROUNDED
from benchmarks.decode.efficiency import paired_ratio
from benchmarks.replay.ceiling import NGRAM_HORIZON, ngram_runs, oracle_seconds

K = 4  # the draft length of the fixed configurations (llama.cpp's and localspec's)


@dataclass(frozen=True)
class Row:
    prompt: str
    temperature: float
    system: str  # "localspec" or "llama.cpp"
    drafter: str
    verifier: str
    plan: str
    tokens: int
    seconds: float
    block_efficiency: float | None
    acceptance: float | None
    verifier_share: float | None

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def merge_repeats(rows: Sequence[Row]) -> list[Row]:
    """One row per configuration: tokens and seconds summed over the repeats (so tok/s is their
    total rate), the other columns averaged; first-seen order."""
    groups: dict[tuple[str, float, str, str, str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.prompt, r.temperature, r.system, r.drafter, r.verifier, r.plan), []).append(r)
    return [Row(*key, sum(r.tokens for r in rs), sum(r.seconds for r in rs),
                _mean([r.block_efficiency for r in rs]), _mean([r.acceptance for r in rs]),
                _mean([r.verifier_share for r in rs])) for key, rs in groups.items()]


def expected_tokens(alpha: float, depth: int) -> float:
    """E[tokens per step] for a chain of `depth` drafts with per-level acceptance α."""
    if alpha >= 1.0:
        return depth + 1.0
    return (1.0 - alpha ** (depth + 1)) / (1.0 - alpha)


RATIO_TARGETS = [  # (numerator, denominator, issue target)
    ("block k8", "token k8", 1.05),
    ("gbv K=3 k8", "block k8", 1.15),
    ("traversal tree 3x2x1x1x1x1x1x1", "rrsw tree 3x2x1x1x1x1x1x1", 1.02),
]


def efficiency_report(scores: dict[str, np.ndarray], n_contexts: int, args: Any) -> list[str]:
    lines = ["| verifier | block efficiency (tokens per target pass) |", "| --- | ---: |"]
    lines += [f"| {label} | {v.mean():.3f} |" for label, v in scores.items()]
    lines += ["", "| ratio | measured | 95 % interval | target | status |", "| --- | ---: | ---: | ---: | --- |"]
    for num, den, goal in RATIO_TARGETS:
        r = paired_ratio(scores[num], scores[den], seed=args.seed)
        status = ("met" if r.low >= goal else "met at the estimate (interval reaches below)" if r.value >= goal
                  else "below at the estimate (interval reaches it)" if r.high >= goal else "missed")
        lines.append(f"| {num} / {den} | {r.value:.3f} | {r.low:.3f}–{r.high:.3f} | ≥ {goal} | {status} |")
    lines += ["", f"{n_contexts} contexts ({len(args.prompts)} prompts × {args.efficiency_seeds} target sample(s) × 1 in "
              f"{args.efficiency_stride} of {args.efficiency_tokens} tokens), one draft per context and shape "
              f"(token and block verify path 0 of the 3 i.i.d. paths GBV verifies), {args.efficiency_draws} "
              "verifier draws per draft; T = 1 without truncation, as in the papers."]
    return lines


def cost_curve_report(curve: dict[int, float]) -> list[str]:
    c1 = curve[1]
    lines = ["## What one target pass costs (the cost model)", "",
             "One decode of n tokens with every row's logits, as a verification pass makes; median of 5, "
             "measured after the runs above. The last column is the speedup of a drafter that is "
             "always right and free: the ceiling of any speculation with n - 1 drafts on this machine.", "",
             "| tokens per target pass n | c(n) | c(n) / c(1) | tok/s if every draft is accepted | vs target alone |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for n in sorted(curve):
        lines.append(f"| {n} | {curve[n] * 1e3:.1f} ms | {curve[n] / c1:.2f} | {n / curve[n]:.1f} | "
                     f"{n * c1 / curve[n]:.2f}× |")
    return lines


def ngram_ceiling_report(outputs: dict[tuple[str, float], tuple[list[int], list[int]]], curve: dict[int, float],
                         rows: Sequence[Row]) -> list[str]:
    """Per input-grounded prompt and temperature: the n-gram drafter's ceiling on the target-only
    run's output with the measured cost curve, beside the best measured n-gram/hybrid speedup."""
    cost = CostTable(dict(curve))  # the planner's interpolation between measured sizes

    def tps(prompt: str, t: float, drafter: str) -> list[float]:
        return [r.tps for r in rows if (r.prompt, r.temperature, r.system, r.drafter) == (prompt, t, "localspec", drafter)]

    lines = ["## N-gram ceiling on the input-grounded prompts", "",
             "On the target-only run's output: the share of positions where prompt lookup's first "
             "proposal is right, and the best speedup any planner could reach with this drafter "
             "(every step drafts only tokens the lookup gets right, all accepted, n-gram drafts free, "
             "costs from the curve above).", "",
             f"| prompt | T | output tokens | lookup's next token right | ceiling, k ≤ {K} | ceiling, k ≤ {NGRAM_HORIZON} | "
             "measured best (n-gram or hybrid) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (prompt, t), (ptoks, output) in sorted(outputs.items()):
        if prompt not in GROUNDED or not output:
            continue
        runs = ngram_runs(ptoks, output)
        plain = len(output) * cost(1)
        base = max(tps(prompt, t, "-"), default=None)
        measured = tps(prompt, t, "ngram") + tps(prompt, t, "hybrid")
        best = f"{max(measured) / base:.2f}×" if base and measured else "—"
        lines.append(f"| {prompt} | {t:g} | {len(output)} | {sum(r > 0 for r in runs) / len(runs):.0%} | "
                     f"{plain / oracle_seconds(runs, cost, K):.2f}× | "
                     f"{plain / oracle_seconds(runs, cost, NGRAM_HORIZON):.2f}× | {best} |")
    return lines


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def main_table(rows: Sequence[Row]) -> str:
    base = {(r.prompt, r.temperature): r.tps for r in rows if r.verifier == "target only"}
    lines = ["| prompt | T | system | drafter | verifier | plan | tok/s | speedup | block eff. | acceptance | verifier % |",
             "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        b = base.get((r.prompt, r.temperature), 0.0)
        lines.append(f"| {r.prompt} | {r.temperature:g} | {r.system} | {r.drafter} | {r.verifier} | {r.plan} | "
                     f"{r.tps:.1f} | {r.tps / b if b else 0:.2f}× | {_f(r.block_efficiency, '.2f')} | "
                     f"{_f(None if r.acceptance is None else 100 * r.acceptance, '.0f')}{'' if r.acceptance is None else ' %'} | "
                     f"{_f(None if r.verifier_share is None else 100 * r.verifier_share, '.2f')} |")
    return "\n".join(lines)


def ratios(rows: Sequence[Row]) -> str:
    """The issue's targets as measured ratios."""
    def tps(prompt: str, t: float, system: str, drafter: str, verifier: str, plan: str) -> float | None:
        for r in rows:
            if (r.prompt, r.temperature, r.system, r.drafter, r.verifier, r.plan) == (prompt, t, system, drafter,
                                                                                      verifier, plan):
                return r.tps
        return None

    lines = ["| check | prompt | T | ratio |", "| --- | --- | --- | ---: |"]
    temps = sorted({r.temperature for r in rows})
    for p in dict.fromkeys(r.prompt for r in rows):
        for t in temps:
            base = tps(p, t, "localspec", "-", "target only", "-")
            auto = tps(p, t, "localspec", "model", "block", "auto")
            if base and auto:
                lines.append(f"| default (auto) / target only (≥ 0.97) | {p} | {t:g} | {auto / base:.2f}× |")
            lc = tps(p, t, "llama.cpp", "model", "match", "fixed")
            for verifier in ("match", "block"):
                ours = tps(p, t, "localspec", "model", verifier, "fixed")
                if lc and ours:
                    goal = "1.1" if t == 0 else "1.3"
                    lines.append(f"| localspec {verifier} k{K} / llama.cpp draft k{K} (≥ {goal}) | {p} | {t:g} | "
                                 f"{ours / lc:.2f}× |")
            if p in GROUNDED and base:
                for drafter in ("ngram", "hybrid"):
                    best = max((r.tps for r in rows if (r.prompt, r.temperature, r.system, r.drafter, r.verifier)
                                == (p, t, "localspec", drafter, "block")), default=None)
                    if best:
                        lines.append(f"| {drafter} / target only (≥ 1.5) | {p} | {t:g} | {best / base:.2f}× |")
                lcn = tps(p, t, "llama.cpp", "ngram", "match", "fixed")
                if lcn:
                    lines.append(f"| llama.cpp ngram-mod / target only | {p} | {t:g} | {lcn / base:.2f}× |")
    return "\n".join(lines)


def what_if(rows: Sequence[Row]) -> str:
    """Predicted speedup for draft/target cost ratios c when verifying γ+1 tokens costs one target
    step (the memory-bound regime of 7B–70B targets on GPUs): max over γ of E[tokens]/(γ·c + 1),
    with α the measured acceptance of the model drafter (block, k=4, plan fixed)."""
    alphas = {}
    for r in rows:
        if (r.system, r.drafter, r.verifier, r.plan) == ("localspec", "model", "block", "fixed") and r.acceptance:
            alphas[(r.prompt, r.temperature)] = r.acceptance
    keys = sorted(alphas)
    head = "| c = draft/target cost | " + " | ".join(f"{p} T={t:g} (α={alphas[(p, t)]:.2f})" for p, t in keys) + " |"
    lines = [head, "| --- |" + " ---: |" * len(keys)]
    for c in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6):
        cells = []
        for key in keys:
            best = max((expected_tokens(alphas[key], g) / (g * c + 1), g) for g in range(1, 17))
            cells.append(f"{best[0]:.2f}× (γ={best[1]})")
        lines.append(f"| {c:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def throughput_report(rows: Sequence[Row]) -> list[str]:
    return ["## Throughput", "", main_table(rows), "", "## Targets as ratios", "", ratios(rows), "",
            "## What if the draft were cheaper", "",
            "Predicted speedup = max over γ of E[tokens per step] / (γ·c + 1): verifying γ+1 tokens costs one "
            "target step (memory-bound GPUs), α = the acceptance measured above (model drafter, block, k=4).",
            "", what_if(rows)]

