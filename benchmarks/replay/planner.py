"""Replay the planner on recorded outputs: its n-gram decode speedup without timing noise, beside the ceiling.

    python benchmarks/planner_replay.py                  # every prompt, baseline planner
    python benchmarks/planner_replay.py --shadow         # plus the variant that learns from every proposal
    python benchmarks/planner_replay.py --curve 2:1.76,4:3.02,8:7.2,16:8.43,32:14.02   # an earlier run's curve
    python benchmarks/planner_replay.py --population     # plus the best fixed policies for the whole set
    python benchmarks/planner_replay.py --margins 1,1.05 # plus the planner with other margins (it drafts at 1.1)

The target alone writes each prompt's greedy answer once (the output any lossless speculation at
T = 0 reproduces); the cost curve is measured in the same process. The real planner then
decides every step through the engine's own interface to it (Policy.pick, observe_step, finish;
benchmarks.replay.steps) with the engine's n-gram drafter (`--drafter auto` without a draft
model), but a step's cost is read from the curve and its accepted tokens from the recorded
answer, so a replay takes milliseconds and two planners can be compared on the same answers with
no timing noise. A pass larger than the curve's largest size costs that
size's cost plus the prefill rate per further token. "cold" starts from an empty profile (c(1),
c(16) and the prefill rate known, as after a first run's prefill and first step); "warm" from the profile
that replaying every prompt `--warm-rounds` times in order leaves (acceptance counts capped
between generations as the profile store caps them). The ceiling is the n-gram oracle
(benchmarks.replay.ceiling): every step drafts exactly the tokens the lookup gets right.

Two more columns say where the gap between the planner and the ceiling comes from. "best depth
per kind, in hindsight": the fastest fixed policy of one draft depth per kind of proposal (what
the planner's acceptance is learned by), searched for on the answer itself: how far knowing each
kind's outcomes on this answer in advance would take a planner that decides by kind. "uncapped,
taught on this answer": the planner without its exploration cap, after learning from this
answer alone: how close it comes when its profile knows nothing but this kind of prompt.
With `--population`, two more: "one depth per kind for every prompt", the best fixed policy for
the whole set (fitted on the set: what a planner that decides by kind reaches if it knows how
each kind fares over these prompts, but not on the prompt at hand), and "the same, fitted on
the other prompts" (leave one out: a planner's best case on a prompt it has not seen, from
perfect knowledge of those it has). The hindsight column is an answer's own best policy; the
gap between it and these is what knowing the answer is worth, which no planner has.

Prompts (benchmarks.common.prompts): whole_process's; HELD_OUT, six grounded prompts that no
planner setting was tuned on; MORE, twelve grounded prompts added later (other code, another
language, other prose work), on which, with HELD_OUT, candidate rules are compared (the savings
rule in docs/whole-process.md); HELD_BACK, the held-back set.

`--shadow` replays a variant planner that, besides the drafts it makes, learns from every
proposal it did not draft (or drafted only in part), comparing it with the tokens that
followed: acceptance evidence at no cost for every kind and depth, which the baseline only
gets by drafting (at T = 0 a one-hot draft is accepted exactly where it equals the output).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from localspec.decoding.costs import CostTable
from localspec.decoding.profiles import Profile

from benchmarks.common.options import add_prompts_option, check_prompts
from benchmarks.common.prompts import HELD_BACK, REPLAY_GROUNDED, REPLAY_PROMPTS
from benchmarks.common.target import cost_curve, prefill_rate
from benchmarks.replay.answers import NOMINAL_C1, Answers, parse_curve, record, recorded
from benchmarks.replay.ceiling import ngram_ceiling
from benchmarks.replay.planners import fresh_profile, self_taught, speedup, warm_profile
from benchmarks.replay.policies import hindsight, population_speedups


def table(answers: Answers, curve: dict[int, float], prefill: float, max_tokens: int, rounds: int,
          variants: Sequence[bool], population: bool = False, margins: Sequence[float] = ()) -> list[str]:
    """The replay's markdown table: per answer, the ceiling, the hindsight and self-taught columns,
    (with `population`) the fitted policies, and each variant (False: the planner, True: the
    shadow planner) from a cold and a warm profile, then the planner with each of `margins`;
    then geometric means and worst cases."""
    cost = CostTable(dict(curve), lambda: prefill)  # passes beyond the curve: a prefill's cost per further token
    names = {False: "baseline", True: "shadow"}
    header = ("| prompt | output tokens | ceiling | best depth per kind, in hindsight | uncapped, taught on this answer |"
              + (" one depth per kind for every prompt | the same, fitted on the other prompts |" if population else "")
              + "".join(f" {names[v]} cold | {names[v]} warm |" for v in variants)
              + "".join(f" margin {m:g} cold | margin {m:g} warm |" for m in margins))
    lines = [header, "|" + " --- |" + " ---: |" * (4 + 2 * population + 2 * len(variants) + 2 * len(margins))]
    warm = {v: warm_profile(answers, curve, prefill, cost, max_tokens, rounds, v) for v in variants}
    warm_margin = {m: warm_profile(answers, curve, prefill, cost, max_tokens, rounds, False, margin=m) for m in margins}
    fitted = [population_speedups(answers, cost, max_tokens, loo) for loo in (False, True)] if population else []
    rows: dict[str, list[float]] = {}
    for name, (prompt, output) in answers.items():
        print(f"replaying {name}", file=sys.stderr, flush=True)
        cells = [ngram_ceiling(prompt, output, cost), hindsight(prompt, output, cost, max_tokens),
                 self_taught(prompt, output, curve, prefill, cost, max_tokens, max(rounds, 1)),
                 *(speeds[name] for speeds in fitted)]
        for v in variants:
            cells.append(speedup(fresh_profile(curve, prefill, False), prompt, output, cost, max_tokens, v))
            snapshot = Profile.from_json(warm[v].to_json())  # each prompt replayed from the same warm profile
            cells.append(speedup(snapshot, prompt, output, cost, max_tokens, v))
        for m in margins:
            cells.append(speedup(fresh_profile(curve, prefill, False), prompt, output, cost, max_tokens, False, margin=m))
            snapshot = Profile.from_json(warm_margin[m].to_json())
            cells.append(speedup(snapshot, prompt, output, cost, max_tokens, False, margin=m))
        rows[name] = cells
        label = f"{name} (grounded)" if name in REPLAY_GROUNDED else name
        lines.append(f"| {label} | {len(output)} | " + " | ".join(f"{x:.2f}×" for x in cells) + " |")
    for label, group in (("grounded", REPLAY_GROUNDED), ("held back", HELD_BACK), ("every prompt", rows)):
        lines += summary(label, [cells for name, cells in rows.items() if name in group])
    return lines


def summary(label: str, cells: list[list[float]]) -> list[str]:
    """Geometric mean and worst of each column over a set of prompts (none: no lines)."""
    if not cells:
        return []
    means = [math.exp(sum(math.log(x) for x in column) / len(column)) for column in zip(*cells, strict=True)]
    return [f"| {label}, geometric mean | | " + " | ".join(f"{x:.2f}×" for x in means) + " |",
            f"| {label}, worst | | " + " | ".join(f"{min(column):.2f}×" for column in zip(*cells, strict=True)) + " |"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_prompts_option(p, REPLAY_PROMPTS)
    p.add_argument("--tokens", type=int, default=128, help="max tokens per answer (default 128)")
    p.add_argument("--warm-rounds", type=int, default=2, help="replays of every answer that build the warm profile")
    p.add_argument("--shadow", action="store_true", help="also replay the planner that learns from every proposal")
    p.add_argument("--population", action="store_true",
                   help="also the best fixed depth per kind for the whole set of prompts, fitted on the set and on "
                        "the other prompts (leave one out: one fit per prompt, minutes)")
    p.add_argument("--margins", type=lambda s: tuple(float(x) for x in s.split(",")), default=(), metavar="M,...",
                   help="also the planner with each of these margins (the predicted speedup a draft must reach; "
                        "the planner's own: 1.1), cold and warm")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--curve", type=parse_curve, default=None, metavar="N:RATIO,...",
                   help="replay with this cost curve, c(n)/c(1) by pass size (as printed at the end of a run, "
                        "e.g. 2:1.76,4:3.02,16:8.43,32:14.02), instead of the one measured now")
    p.add_argument("--answers", type=Path, default=None, metavar="FILE",
                   help="keep the recorded answers in FILE (JSON) and reuse those of the same model, prompt and "
                        "--tokens: a replay with --curve and --prefill-rate then decodes nothing")
    p.add_argument("--prefill-rate", type=float, default=None, metavar="RATIO",
                   help="with --curve: a long prefill's cost per token in c(1) (default: measured now)")
    args = p.parse_args(argv)
    check_prompts(p, args.prompts, REPLAY_PROMPTS)
    if args.tokens < 2 or args.warm_rounds < 0:
        p.error("--tokens must be >= 2 and --warm-rounds >= 0")
    if any(not 0.5 <= m <= 2 for m in args.margins):
        p.error("--margins: each between 0.5 and 2 (a predicted speedup over the target alone)")
    if args.prefill_rate is not None and (args.curve is None or not 0 < args.prefill_rate < 1):
        p.error("--prefill-rate needs --curve and must be between 0 and 1 (a prefill token is cheaper than a step)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = {n: REPLAY_PROMPTS[n] for n in args.prompts}
    saved = recorded(args.answers, prompts, args.tokens)
    if saved is not None and args.curve is not None and args.prefill_rate is not None:
        print(f"replaying the answers in {args.answers} (no model loaded)", file=sys.stderr, flush=True)
        curve = {n: NOMINAL_C1 * ratio for n, ratio in args.curve.items()}
        answers, prefill = saved, NOMINAL_C1 * args.prefill_rate
    else:
        answers, curve, prefill = measure(args, prompts)
    variants = [False, True] if args.shadow else [False]
    print("\n".join(table(answers, curve, prefill, args.tokens, args.warm_rounds, variants, args.population,
                           args.margins)))
    c1 = curve[1]
    print("\nn-gram decode speedup over the target alone; cost curve c(n)/c(1): "
          + ", ".join(f"{n}: {curve[n] / c1:.2f}" for n in sorted(curve)) + f"; prefill {prefill / c1:.2f} c(1)/token")
    return 0


def measure(args: argparse.Namespace, prompts: dict[str, str]) -> tuple[Answers, dict[int, float], float]:
    """The default pair's target: its cost curve (or c(1) under the given ratios), prefill rate and answers."""
    from localspec.api import load_model
    from localspec.llama import registry

    reg = registry.load_registry()
    options = {"threads": args.threads} if args.threads else {}
    with load_model(reg.pairs[reg.default_pair].target, **options) as target:
        print("measuring the cost curve", file=sys.stderr, flush=True)
        if args.curve is None:
            curve, prefill = cost_curve(target), prefill_rate(target)
        else:  # the given ratios, on this machine's c(1)
            c1 = cost_curve(target, sizes=(1,))[1]
            curve = {n: c1 * ratio for n, ratio in args.curve.items()}
            prefill = c1 * args.prefill_rate if args.prefill_rate is not None else prefill_rate(target)
        answers = record(target, prompts, args.tokens, args.answers)
    return answers, curve, prefill


if __name__ == "__main__":
    raise SystemExit(main())
