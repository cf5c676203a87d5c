"""Several calls generated at once on one pair, replayed: does the planner price the batch?

    python benchmarks/planner_replay.py --answers answers.json          # records the answers once
    python benchmarks/batch_replay.py --answers answers.json            # the AMD and Intel curves, K = 1, 2, 4
    python benchmarks/batch_replay.py --answers answers.json --curve 2:1.65,4:2.56,8:6.24,16:6.84 --clients 1,2,4,8

K clients each ask for answers from the recorded set (the planner replay's: benchmarks.replay.answers),
the set dealt to them round-robin, each client's next call starting as soon as its last one ends
(a set smaller than K is repeated until every client has one). They run in lockstep rounds, as the
pair's scheduler forms them (localspec.decoding.scheduler): each round every unfinished answer
takes one step, all of them in ONE target pass. The slots decide in admission order, each told
what the others put in the pass as ``Scheduler._advance_turns`` tells it (:func:`turn_batch`: the
tokens the slots before it planned, plus one root for each slot after it); the policy is asked
through its real interface (``pick(..., batch=)``, ``observe_step(..., pass_tokens=)``: the same
step as the single-answer replay, benchmarks.replay.steps.AnswerDecode), the round costs c(all
its tokens) on the cost curve, and each answer's accepted tokens come from its recorded answer.
Prompts' prefill is not replayed (the single-answer replay does not replay it either).

Each table compares, per set of answers and K, the aggregate speed (all answers' tokens over the
target time of all rounds, in units of one call of the target alone: tokens/s × c(1)):

* the target alone, batched (nothing drafted: K calls share each pass);
* the best fixed rule in hindsight: one draft depth per kind of proposal (or none) for every slot,
  found by coordinate descent on that very set and K (benchmarks.replay.policies);
* the planner, cold and warm (as the planner replay has them: benchmarks.replay.planners);
* the planner told it is alone in every pass (warm): what pricing the batch is worth;
* no batching: the same answers one call after another, the warm planner.

At K = 1 the rows are the single-answer replay's (the same steps, tests/test_batch_replay.py).
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from localspec.decoding.batch_plan import Offer, allocate
from localspec.decoding.costs import CostTable
from localspec.decoding.policy import Policy  # noqa: F401  (named in MakePolicy's string annotation)
from localspec.decoding.profiles import Profile
from localspec.decoding.state import Draft

from benchmarks.common.options import add_prompts_option, check_prompts
from benchmarks.common.prompts import REPLAY_GROUNDED, REPLAY_PROMPTS
from benchmarks.replay.answers import NOMINAL_C1, parse_curve, recorded
from benchmarks.replay.planners import fresh_profile, planner_for, warm_profile
from benchmarks.replay.policies import SEARCH_DEPTHS, coordinate_descent
from benchmarks.replay.steps import AnswerDecode, Replay

Answer = tuple[list[int], list[int]]  # prompt tokens, the recorded output
MakePolicy = Callable[[], "Policy | Mapping[str, int]"]  # a new policy for each call (a mapping: fixed depths)

CURVES = {  # c(n)/c(1) of the two hosts docs/whole-process.md's replay tables use
    "amd": ("AMD EPYC (Zen 4), measured", {1: 1.0, 2: 1.65, 4: 2.56, 8: 6.24, 16: 6.84}),
    "intel": ("Intel Xeon (AMX), reported", {1: 1.0, 2: 1.48, 4: 2.17, 7: 3.08, 13: 3.40, 16: 3.69, 25: 5.28}),
}
PREFILL_RATE = 0.3  # c(1) per token of a long prefill, on both hosts: prices passes beyond the curve
N_BATCH = 512  # the default batch_size: the most tokens one pass takes
MAX_CLIENTS = 8  # so that every slot's deepest draft fits one pass of the default n_batch (8 x 33 <= 512)


@dataclass(frozen=True)
class BatchReplay:
    seconds: float  # target time of every round
    rounds: int
    tokens: int  # every answer's output tokens
    answers: tuple[Replay, ...]  # each answer's own steps (its seconds: the rounds it took part in), in order

    @property
    def drafted(self) -> int:
        return sum(a.drafted for a in self.answers)

    @property
    def steps(self) -> int:
        return sum(a.steps for a in self.answers)


def turn_batch(planned: int, later: int) -> int:
    """What a slot is told the other calls put in the round's target pass when its turn comes
    (``Scheduler._advance_turns``): the tokens the slots before it (in admission order) planned,
    and at least a root for each of the `later` slots after it."""
    return planned + later


def calls(n_answers: int, clients: int) -> list[int]:
    """The answers' indices in the order they are asked for: the set, repeated until every one of
    `clients` has a call."""
    return list(range(n_answers)) * -(-clients // n_answers) if n_answers else []


def deal(n_answers: int, clients: int) -> list[list[int]]:
    """:func:`calls` dealt round-robin to `clients`: each client's calls, in order."""
    order = calls(n_answers, clients)
    return [order[c::clients] for c in range(clients)]


def replay_batch(make: MakePolicy, answers: Sequence[Answer], clients: int, cost: Callable[[int], float],
                 max_tokens: int, kinds: set[str] | None = None) -> BatchReplay:
    """Decode `answers` again with `clients` calls at once on one pair (see the module docstring),
    each call's policy made by `make` when it starts. `kinds` collects the kinds of proposal seen."""
    waiting = [collections.deque(q) for q in deal(len(answers), clients)]
    running: list[tuple[int, int, AnswerDecode]] = []  # client, answer, its decode: in admission order
    done: dict[int, Replay] = {}
    seconds, rounds, order = 0.0, 0, []
    while True:
        busy = {client for client, _, _ in running}
        for client, queue in enumerate(waiting):
            if queue and client not in busy:  # a client's next call starts as its last one ended
                index = queue.popleft()
                order.append(index)
                running.append((client, len(order) - 1, AnswerDecode(make(), *answers[index], max_tokens,
                                                                     kinds=kinds)))
        if not running:
            break
        drafts = round_drafts([answer for _, _, answer in running])
        planned = sum(d.n + 1 for d in drafts)
        secs = cost(planned)  # ONE target pass holds every slot's tokens
        for (_, _, answer), draft in zip(running, drafts, strict=True):
            answer.commit(draft, secs, planned)
        seconds, rounds = seconds + secs, rounds + 1
        for _, call, answer in running:
            if answer.done:
                done[call] = answer.finish()
        running = [entry for entry in running if not entry[2].done]
    tokens = sum(len(answers[i][1]) for i in order)
    return BatchReplay(seconds, rounds, tokens, tuple(done[call] for call in range(len(order))))


def round_drafts(running: Sequence[AnswerDecode]) -> list[Draft]:
    """Each slot's draft this round, as the scheduler forms them (``Scheduler._advance_turns`` and
    ``_plan_round``): with several slots, those whose policy offers options wait for the round's
    plan (localspec.decoding.batch_plan.allocate) and the others pick, each told the tokens the
    slots before it planned and a root for each slot after it; alone, the policy picks."""
    drafts: list[Draft | None] = [None] * len(running)
    offers: list[tuple[int, Offer]] = []
    planned = 0
    for k, answer in enumerate(running):
        offer = answer.offer() if len(running) > 1 else None
        if offer is not None:
            offers.append((k, offer))
            planned += offer.tokens[0]
            continue
        drafts[k] = answer.draft(turn_batch(planned, len(running) - k - 1))
        planned += drafts[k].n + 1  # type: ignore[union-attr]  # its root and draft nodes
    if offers:
        fixed = [d for d in drafts if d is not None]
        depths = allocate([o for _, o in offers], sum(d.n + 1 for d in fixed), float(len(fixed)), N_BATCH)
        for (k, _), depth in zip(offers, depths, strict=True):
            drafts[k] = running[k].draft_at(depth)
    return [d for d in drafts if d is not None]


def best_fixed(answers: Sequence[Answer], clients: int, cost: Callable[[int], float],
               max_tokens: int) -> tuple[BatchReplay, dict[str, int]]:
    """The best fixed rule in hindsight for this set and K: the depth per kind of proposal (none:
    not drafted) that coordinate descent over SEARCH_DEPTHS finds for the least target time of all
    rounds, every slot drafting by it; its replay and the rule."""
    def seconds(policy: dict[str, int], kinds: set[str]) -> float:
        return replay_batch(lambda: policy, answers, clients, cost, max_tokens, kinds).seconds
    _, policy = coordinate_descent(seconds, SEARCH_DEPTHS)
    return replay_batch(lambda: policy, answers, clients, cost, max_tokens), policy


@dataclass(frozen=True)
class Curve:
    label: str
    ratios: dict[int, float]  # c(n)/c(1)
    prefill: float  # a long prefill's cost per token, in c(1)

    def seconds(self) -> dict[int, float]:
        return {n: NOMINAL_C1 * r for n, r in self.ratios.items()}

    def cost(self) -> CostTable:
        """The replay's prices: the curve, and beyond its largest size the prefill rate per further token."""
        return CostTable(self.seconds(), lambda: NOMINAL_C1 * self.prefill)

    def describe(self) -> str:
        return f"{self.label} (c(n)/c(1): " + ", ".join(f"{n}: {r:g}" for n, r in sorted(self.ratios.items())
                                                      if n > 1) + f"; prefill {self.prefill:g} c(1)/token)"


COLUMNS = ("target alone, batched", "best fixed rule, in hindsight", "planner cold", "planner warm",
           "planner warm, priced as if alone", "no batching (planner warm)")


def table(answers: Mapping[str, Answer], curve: Curve, clients: Sequence[int], max_tokens: int,
          rounds: int) -> list[str]:
    """One curve's markdown table: per set of answers (every prompt, grounded, free) and K, the
    aggregate speed of each column, the warm planner's over the best fixed rule's, and the tokens
    the warm planner and the fixed rule drafted per step."""
    cost, prices = curve.cost(), curve.seconds()
    prefill = NOMINAL_C1 * curve.prefill
    warm = warm_profile(answers, prices, prefill, cost, max_tokens, rounds, shadow=False)

    def cold() -> Profile:
        return fresh_profile(prices, prefill, warm_costs=False)

    def warm_snapshot() -> Profile:  # every call starts from the same warm profile
        return Profile.from_json(warm.to_json())

    def planner(profile: Callable[[], Profile], blind: bool = False) -> MakePolicy:
        return lambda: planner_for(profile(), batch_blind=blind)
    lines = ["| set | K | " + " | ".join(COLUMNS) + " | warm / best fixed | drafted per step: fixed, warm | "
             "fixed rule (kind: depth) |", "| --- | ---: |" + " ---: |" * (len(COLUMNS) + 2) + " --- |"]
    for label, names in sets(answers):
        chosen = [answers[n] for n in names]
        for k in clients:
            print(f"replaying {label}, K = {k}", file=sys.stderr, flush=True)
            fixed, rule = best_fixed(chosen, k, cost, max_tokens)
            runs = [replay_batch(lambda: {}, chosen, k, cost, max_tokens), fixed,
                    replay_batch(planner(cold), chosen, k, cost, max_tokens),
                    replay_batch(planner(warm_snapshot), chosen, k, cost, max_tokens),
                    replay_batch(planner(warm_snapshot, blind=True), chosen, k, cost, max_tokens),
                    replay_batch(planner(warm_snapshot), [chosen[i] for i in calls(len(chosen), k)], 1, cost,
                                 max_tokens)]
            speeds = [speed(run, cost) for run in runs]
            lines.append(f"| {label} ({len(chosen)}) | {k} | " + " | ".join(f"{s:.2f}" for s in speeds)
                         + f" | **{speeds[3] / speeds[1]:.2f}×** | {per_step(fixed)}, {per_step(runs[3])} | "
                         + describe_rule(rule) + " |")
    return lines


def sets(answers: Mapping[str, Answer]) -> list[tuple[str, list[str]]]:
    """The sets of answers a table has rows for: every prompt, the grounded ones, the free ones
    (those of them that are there)."""
    grounded = [n for n in answers if n in REPLAY_GROUNDED]
    free = [n for n in answers if n not in REPLAY_GROUNDED]
    out = [("every prompt", list(answers))]
    return out + [(label, names) for label, names in (("grounded", grounded), ("free", free))
                  if names and len(names) < len(answers)]


def speed(run: BatchReplay, cost: Callable[[int], float]) -> float:
    """Aggregate tokens per second in units of one call of the target alone (tokens/s × c(1))."""
    return run.tokens * cost(1) / run.seconds


def per_step(run: BatchReplay) -> str:
    return f"{run.drafted / run.steps:.2f}"


def describe_rule(rule: Mapping[str, int]) -> str:
    drafted = {kind: depth for kind, depth in sorted(rule.items()) if depth}
    return ", ".join(f"{kind}: {depth}" for kind, depth in drafted.items()) or "none"


def curve_option(text: str) -> Curve:
    """--curve: a named host's curve (amd, intel) or c(n)/c(1) as N:RATIO,... (its prefill rate:
    --prefill-rate, set on the curves after parsing)."""
    named = CURVES.get(text.strip().lower())
    if named is not None:
        return Curve(named[0], dict(named[1]), PREFILL_RATE)
    return Curve("given", parse_curve(text), PREFILL_RATE)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_prompts_option(p, REPLAY_PROMPTS)
    p.add_argument("--answers", type=Path, required=True, metavar="FILE",
                   help="answers recorded by planner_replay.py --answers FILE (this replay loads no model)")
    p.add_argument("--curve", type=curve_option, action="append", default=None, metavar="amd|intel|N:RATIO,...",
                   help="a cost curve, one table each (repeat it): a named host's (amd, intel) or c(n)/c(1) by pass "
                        "size as planner_replay.py takes it (default: amd and intel)")
    p.add_argument("--prefill-rate", type=float, default=None, metavar="RATIO",
                   help=f"a long prefill's cost per token in c(1), which prices passes beyond a curve's largest size "
                        f"(default {PREFILL_RATE:g}, both hosts')")
    p.add_argument("--clients", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1, 2, 4), metavar="K,...",
                   help="calls at once, one table row each (default 1,2,4)")
    p.add_argument("--tokens", type=int, default=128, help="max tokens the answers were recorded with (default 128)")
    p.add_argument("--warm-rounds", type=int, default=2, help="replays of every answer that build the warm profile")
    args = p.parse_args(argv)
    check_prompts(p, args.prompts, REPLAY_PROMPTS)
    if any(not 1 <= k <= MAX_CLIENTS for k in args.clients):
        p.error(f"--clients: each between 1 and {MAX_CLIENTS} (calls at once on one pair)")
    if args.prefill_rate is not None and not 0 < args.prefill_rate < 1:
        p.error("--prefill-rate must be between 0 and 1 (a prefill token is cheaper than a step)")
    if args.tokens < 2 or args.warm_rounds < 0:
        p.error("--tokens must be >= 2 and --warm-rounds >= 0")
    rate = PREFILL_RATE if args.prefill_rate is None else args.prefill_rate
    given = args.curve or [curve_option(name) for name in CURVES]
    args.curve = [Curve(c.label, c.ratios, rate) for c in given]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    answers = recorded(args.answers, {n: REPLAY_PROMPTS[n] for n in args.prompts}, args.tokens)
    if answers is None:
        print(f"{args.answers} does not hold an answer to every prompt asked for ({args.tokens} tokens); "
              "record them with: python benchmarks/planner_replay.py --answers FILE", file=sys.stderr)
        return 2
    for curve in args.curve:
        print(f"\nCost curve: {curve.describe()}. Aggregate tokens/s × c(1) (1.00: one call of the target alone).\n")
        print("\n".join(table(answers, curve, args.clients, args.tokens, args.warm_rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
