"""The best fixed policies on recorded answers, found in hindsight: one draft depth per kind of
proposal, searched for by coordinate descent on an answer itself (what knowing each kind's
outcomes on this answer in advance would take a planner that decides by kind), or on a set of
answers (what it reaches knowing how each kind fares over the set, not on the prompt at hand),
or on the other answers of the set (leave one out: a planner's best case on a prompt it has not
seen, from perfect knowledge of those it has). No planner has that knowledge; the gap between
these and the planner is what it is worth.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from benchmarks.replay.answers import Answers
from benchmarks.replay.steps import replay

SEARCH_DEPTHS = (0, 1, 2, 3, 4, 5, 7, 9, 11, 15, 19, 23, 27, 31)  # depths hindsight() tries per kind


def hindsight(prompt: Sequence[int], output: Sequence[int], cost: Callable[[int], float], max_tokens: int) -> float:
    """The decode speedup of the best fixed depth per kind of proposal for this very answer that
    coordinate descent over SEARCH_DEPTHS finds (a local optimum: the best such policy is at least
    this fast): what a planner that decides by kind could reach if it knew each kind's outcomes on
    this answer in advance. A planner that learns adapts within a kind, so this bounds it only
    roughly; the ceiling bounds it exactly."""
    best, _ = coordinate_descent(lambda policy, kinds: replay(policy, prompt, output, cost, max_tokens,
                                                              kinds=kinds).seconds, SEARCH_DEPTHS)
    return len(output) * cost(1) / best


Choice = TypeVar("Choice")


def population_policy(answers: Answers, cost: Callable[[int], float], max_tokens: int) -> dict[str, int]:
    """One depth per kind of proposal for every answer of the set: the policy, among those
    coordinate descent over SEARCH_DEPTHS finds, with the best geometric mean speedup over the set.
    Fitted on the answers it is then judged on, it is what a planner that decides by kind could
    reach if it knew how each kind fares over this set of prompts (not on the prompt at hand)."""
    def seconds(policy: dict[str, int], kinds: set[str]) -> float:  # the set's geometric mean of seconds / alone's
        logs = [math.log(replay(policy, prompt, output, cost, max_tokens, kinds=kinds).seconds / (len(output) * cost(1)))
                for prompt, output in answers.values()]
        return math.exp(sum(logs) / len(logs))
    return coordinate_descent(seconds, SEARCH_DEPTHS)[1]


def population_speedups(answers: Answers, cost: Callable[[int], float], max_tokens: int,
                        leave_one_out: bool) -> dict[str, float]:
    """Each answer's speedup under population_policy fitted on the whole set, or (`leave_one_out`)
    on every other answer: a planner's best case with perfect knowledge of the prompts it has seen."""
    def speed(policy: dict[str, int], prompt: Sequence[int], output: Sequence[int]) -> float:
        return len(output) * cost(1) / replay(policy, prompt, output, cost, max_tokens).seconds
    if not leave_one_out:
        policy = population_policy(answers, cost, max_tokens)
        return {name: speed(policy, *answer) for name, answer in answers.items()}
    out = {}
    for name, answer in answers.items():
        print(f"fitting a policy without {name}", file=sys.stderr, flush=True)
        others = {other: a for other, a in answers.items() if other != name}
        out[name] = speed(population_policy(others, cost, max_tokens), *answer)
    return out


def coordinate_descent(seconds: Callable[[dict[str, Choice], set[str]], float], choices: Sequence[Choice],
                       start: Mapping[str, Choice] | None = None) -> tuple[float, dict[str, Choice]]:
    """The fastest fixed policy (a choice per kind of proposal) that coordinate descent finds from
    `start`, trying each of `choices` for each kind in turn until none helps, and its seconds.
    `seconds(policy, kinds)` replays the answer under a policy, adding the kinds it meets."""
    kinds: set[str] = set()
    policy: dict[str, Choice] = dict(start or {})
    best = seconds(policy, kinds)
    improved = True
    while improved:
        improved = False
        for kind in sorted(kinds):
            for choice in choices:
                trial = {**policy, kind: choice}
                secs = seconds(trial, kinds)
                if secs < best * (1 - 1e-9):
                    best, policy, improved = secs, trial, True
    return best, policy
