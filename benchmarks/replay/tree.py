"""Does drafting several continuations at once pay? The lookup's alternatives as a tree, replayed.

Where the context holds the current suffix more than once and its occurrences continue
differently, the suffix automaton offers each continuation (replay.ceiling.first_token_alternatives);
a step could draft the proposal and up to W - 1 alternatives as a tree of W branches, verified in
one target pass of all their tokens. At T = 0 the target accepts the branch it agrees with, as far
as it agrees. This replay prices that on recorded answers (planner_replay.py --answers) and a
cost curve, with no model and no timing noise, comparing for each answer the best fixed policy
found in hindsight (coordinate descent over the kinds of proposal, as planner_replay's
hindsight column) of

* a chain: one draft depth per kind (W = 1), and
* a tree: a depth and a width W <= --width per kind, every branch that deep,

the tree's search starting from the chain's policy (so its column is never below the chain's):
what a planner that knew in advance how each kind fares on this answer would gain from trees.

    python benchmarks/planner_replay.py --answers answers.json   # records the answers once
    python benchmarks/tree_replay.py --answers answers.json --curve 2:1.65,4:2.56,8:6.24,16:6.84
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from localspec.decoding.costs import CostTable
from localspec.decoding.drafters import ngram_kind

from benchmarks.common.prompts import HELD_BACK, REPLAY_GROUNDED, REPLAY_PROMPTS
from benchmarks.replay.answers import NOMINAL_C1, parse_curve, recorded
from benchmarks.replay.ceiling import first_token_alternatives, matched_run
from benchmarks.replay.policies import SEARCH_DEPTHS, coordinate_descent
from benchmarks.replay.steps import DEPTH, answer_lookup

TreePolicy = Mapping[str, tuple[int, int]]  # kind of proposal: (depth, branches)


def replay_tree(policy: TreePolicy, prompt: Sequence[int], output: Sequence[int], cost: Callable[[int], float],
                max_tokens: int, kinds: set[str] | None = None) -> float:
    """Target seconds to decode `output` again when every proposal of a kind is drafted `depth`
    deep with `branches` - 1 of the lookup's alternatives beside it (0 deep if the kind is absent);
    a step costs c(its tokens + 1) and yields the longest branch the output agrees with, + 1."""
    lookup, i, seconds = answer_lookup(output, max_tokens), 0, 0.0
    while i < len(output):
        available = min(DEPTH, max_tokens - i - 1)
        proposal = lookup.propose([*prompt, *output[:i]], available) if available > 0 else None
        nodes = accepted = 0
        if proposal is not None:
            kind = ngram_kind(proposal)
            if kinds is not None:
                kinds.add(kind)
            depth, branches = policy.get(kind, (0, 1))
            depth = min(depth, len(proposal.tokens))
            if depth:
                drafted = [proposal.tokens[:depth]]
                drafted += [alt[:depth] for alt in first_token_alternatives(lookup, proposal.tokens[0], branches - 1,
                                                                             depth)]
                nodes = sum(len(b) for b in drafted)
                accepted = max(matched_run(b, output[i:]) for b in drafted)
        seconds += cost(nodes + 1)
        i += accepted + 1
    return seconds


def hindsight(prompt: Sequence[int], output: Sequence[int], cost: Callable[[int], float], max_tokens: int,
              widths: Sequence[int], start: TreePolicy | None = None) -> tuple[float, dict[str, tuple[int, int]]]:
    """The decode speedup of the best (depth, width in `widths`) per kind that coordinate descent
    finds on this answer, starting from `start` (so never worse than it), and that policy."""
    choices = [(depth, width) for depth in SEARCH_DEPTHS for width in widths]
    best, policy = coordinate_descent(
        lambda trial, kinds: replay_tree(trial, prompt, output, cost, max_tokens, kinds), choices, start)
    return len(output) * cost(1) / best, policy


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def table(answers: Mapping[str, tuple[list[int], list[int]]], cost: Callable[[int], float], max_tokens: int,
          width: int) -> list[str]:
    lines = [f"| prompt | output tokens | chain, best depth per kind | tree of ≤ {width} branches, best per kind | "
             "widths used |", "| --- | ---: | ---: | ---: | --- |"]
    chains, trees = {}, {}
    for name, (prompt, output) in answers.items():
        print(f"replaying {name}", file=sys.stderr, flush=True)
        chains[name], chain = hindsight(prompt, output, cost, max_tokens, (1,))
        trees[name], policy = hindsight(prompt, output, cost, max_tokens, tuple(range(1, width + 1)), chain)
        used = [str(w) for w in sorted({w for d, w in policy.values() if d})] or ["-"]
        label = f"{name} (grounded)" if name in REPLAY_GROUNDED else name
        lines.append(f"| {label} | {len(output)} | {chains[name]:.3f}× | {trees[name]:.3f}× | "
                     f"{', '.join(used)} |")
    for label, names in (("grounded", REPLAY_GROUNDED), ("held back", HELD_BACK), ("every prompt", answers)):
        chosen = [n for n in answers if n in names]
        if chosen:
            lines.append(f"| {label}, geometric mean | | {geometric_mean([chains[n] for n in chosen]):.3f}× | "
                         f"{geometric_mean([trees[n] for n in chosen]):.3f}× | |")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--answers", type=Path, required=True,
                   help="answers recorded by planner_replay.py --answers FILE (this replay loads no model)")
    p.add_argument("--curve", type=parse_curve, required=True, metavar="N:RATIO,...",
                   help="the cost curve c(n)/c(1), as planner_replay.py takes it")
    p.add_argument("--prefill-rate", type=float, default=0.3, metavar="RATIO",
                   help="a long prefill's cost per token in c(1), which prices passes beyond the curve "
                        "(default 0.3, the reference CPU's)")
    p.add_argument("--width", type=int, default=3, help="most branches of a tree (default 3)")
    p.add_argument("--tokens", type=int, default=128, help="max tokens the answers were recorded with")
    args = p.parse_args(argv)
    if not 2 <= args.width <= 8:
        p.error("--width must be 2 to 8")
    if not 0 < args.prefill_rate < 1:
        p.error("--prefill-rate must be between 0 and 1 (a prefill token is cheaper than a step)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    answers = recorded(args.answers, dict(REPLAY_PROMPTS), args.tokens)
    if answers is None:
        print(f"{args.answers} does not hold an answer to every prompt of planner_replay.py ({args.tokens} tokens); "
              "record them with: python benchmarks/planner_replay.py --answers FILE", file=sys.stderr)
        return 2
    cost = CostTable({n: NOMINAL_C1 * ratio for n, ratio in args.curve.items()}, lambda: NOMINAL_C1 * args.prefill_rate)
    print("\n".join(table(answers, cost, args.tokens, args.width)))
    print("\nn-gram decode speedup over the target alone in hindsight; cost curve c(n)/c(1): "
          + ", ".join(f"{n}: {r:.2f}" for n, r in sorted(args.curve.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
