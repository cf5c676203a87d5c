"""Replay the planner on recorded outputs: its n-gram decode speedup without timing noise, beside the ceiling.

    python benchmarks/planner_replay.py                  # every prompt, baseline planner
    python benchmarks/planner_replay.py --shadow         # plus the variant that learns from every proposal
    python benchmarks/planner_replay.py --curve 2:1.76,4:3.02,8:7.2,16:8.43,32:14.02   # an earlier run's curve
    python benchmarks/planner_replay.py --population     # plus the best fixed policies for the whole set

The target alone writes each prompt's greedy answer once (the output any lossless speculation at
T = 0 reproduces); the cost curve is measured in the same process. The real planner and context
lookup then decide every step as the engine does with the n-gram drafter (`--drafter auto`
without a draft model), but a step's cost is read from the curve and its accepted tokens from
the recorded answer, so a replay takes milliseconds and two planners can be compared on the
same answers with no timing noise. A pass larger than the curve's largest size costs that
size's cost plus the prefill rate per further token. "cold" starts from an empty profile (c(1),
c(16) and the prefill rate known, as after a first run's prefill and first step); "warm" from the profile
that replaying every prompt `--warm-rounds` times in order leaves (acceptance counts capped
between generations as the profile store caps them). The ceiling is head_to_head's oracle:
every step drafts exactly the tokens the lookup gets right.

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

Prompts: whole_process's; HELD_OUT, six grounded prompts that no planner setting was tuned on;
MORE, twelve grounded prompts added later (other code, another language, other prose work), on
which, with HELD_OUT, candidate rules are compared (the savings rule in docs/whole-process.md).

`--shadow` replays a variant planner that, besides the drafts it makes, learns from every
proposal it did not draft (or drafted only in part), comparing it with the tokens that
followed: acceptance evidence at no cost for every kind and depth, which the baseline only
gets by drafting (at T = 0 a one-hot draft is accepted exactly where it equals the output).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from head_to_head import (_run, add_prompts_option, check_prompts, cost_curve, greedy_answer,  # noqa: E402
                          ngram_ceiling)
from whole_process import GROUNDED_PROMPTS, PROMPTS  # noqa: E402

from localspec.config import GenerationConfig  # noqa: E402
from localspec.decoding.drafters import NGramDrafter, ngram_kind  # noqa: E402
from localspec.decoding.lookup import ContextLookup  # noqa: E402
from localspec.decoding.acceptance import NO_LIMIT, Acceptance  # noqa: E402
from localspec.decoding.costs import CostTable  # noqa: E402
from localspec.decoding.planner import Planner  # noqa: E402
from localspec.decoding.profiles import Profile, Profiles  # noqa: E402

_CODE = ('def parse_config(path):\n    result = {}\n    with open(path) as handle:\n        for line in handle:\n'
         '            line = line.strip()\n            if not line or line.startswith("#"):\n                continue\n'
         '            key, value = line.split("=", 1)\n            result[key.strip()] = value.strip()\n'
         '    return result\n')
_TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes planned for the river district. "
         "Residents raised concerns about parking, while shop owners said more cyclists would bring more "
         "customers. The council agreed to run a six-month trial on two streets before deciding on the full "
         "plan, and asked the transport office to publish traffic counts every month.")
HELD_OUT = {  # grounded prompts that no planner setting was tuned on
    "hints": "Add type hints to this function and show the whole code:\n\n" + _CODE,
    "rename2": "Rename `handle` to `config_file` in this code and show the whole code:\n\n" + _CODE,
    "docstring": "Add a docstring to this function and show the whole code:\n\n" + _CODE,
    "bugfix": "This function crashes on lines without '='. Fix it and show the whole code:\n\n" + _CODE,
    "quote": "Quote the sentence about the trial from this text, then explain it in one sentence:\n\n" + _TEXT,
    "summarise2": "Summarise this paragraph in two sentences:\n\n" + _TEXT,
}
_JS = ("function totalPrice(items, taxRate) {\n  let total = 0;\n  for (const item of items) {\n"
       "    if (item.quantity <= 0) {\n      continue;\n    }\n    total += item.price * item.quantity;\n  }\n"
       "  const tax = total * taxRate;\n  return Math.round((total + tax) * 100) / 100;\n}\n")
_CLASS = ("class Inventory:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, name, count):\n"
          "        if name in self.items:\n            self.items[name] += count\n        else:\n"
          "            self.items[name] = count\n\n    def remove(self, name, count):\n"
          "        if name not in self.items:\n            raise KeyError(name)\n        self.items[name] -= count\n"
          "        if self.items[name] <= 0:\n            del self.items[name]\n")
_NOTICE = ("The library will close for renovation from the first of March until the end of May. During this time, "
           "members can borrow books from the mobile library that will visit the town square every Saturday "
           "morning. Returns can be made at the post office. The renovated building will have a larger children's "
           "section, a quiet study room and new computers for public use.")
_REVIEW = ("Our team tested three coffee machines over two weeks. The cheapest machine made good coffee but was "
           "loud and hard to clean. The mid-range machine was quiet and easy to clean, and its coffee was the best "
           "of the three. The most expensive machine had many features that nobody used, and it broke down twice.")
MORE = {  # a second set of grounded prompts: other code, other languages, other kinds of prose work
    "js-rename": "Rename `total` to `subtotal` in this JavaScript function and show the whole code:\n\n" + _JS,
    "js-comments": "Add a short comment above each line of this function and show the whole code:\n\n" + _JS,
    "class-hints": "Add type hints to this class and show the whole code:\n\n" + _CLASS,
    "class-rename": "Rename the method `remove` to `take` in this class and show the whole code:\n\n" + _CLASS,
    "class-method": ("Add a method `count(name)` that returns the count of an item (0 if missing) to this class "
                     "and show the whole class:\n\n" + _CLASS),
    "class-error": ("Rewrite this class to raise a ValueError with a helpful message instead of KeyError, and "
                    "show the whole code:\n\n" + _CLASS),
    "sum-notice": "Summarise this notice in two sentences:\n\n" + _NOTICE,
    "sum-review": "Summarise this review in one paragraph:\n\n" + _REVIEW,
    "quote-notice": ("Quote the sentence about returns from this notice, then say where the mobile library will "
                     "be:\n\n" + _NOTICE),
    "typos": "Fix the typos in this text and show the whole corrected text:\n\n" + _REVIEW.replace(
        "machines", "machnes").replace("clean", "claen").replace("features", "featuers"),
    "bullets": "Turn this notice into a bulleted list, keeping the wording:\n\n" + _NOTICE,
    "extract": "List every machine mentioned in this review with what the text says about it:\n\n" + _REVIEW,
}
_GO = ("func countWords(lines []string) map[string]int {\n\tcounts := make(map[string]int)\n"
       "\tfor _, line := range lines {\n\t\tfor _, word := range strings.Fields(line) {\n"
       "\t\t\tword = strings.ToLower(word)\n\t\t\tcounts[word]++\n\t\t}\n\t}\n\treturn counts\n}\n")
_SQL = ("SELECT customers.name, orders.total\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n"
        "WHERE orders.created_at >= '2024-01-01'\nORDER BY orders.total DESC\nLIMIT 10;\n")
_EMAIL = ("Hi Sam, thanks for sending the draft contract. Legal has two changes: the payment term should be 30 "
          "days instead of 45, and the notice period for ending the contract should be three months. Could you "
          "send an updated version by Friday? We would like to sign it at the meeting on the 14th. Best, Ana")
_CONFIG = ('{"server": {"host": "localhost", "port": 8080, "workers": 4}, "database": {"url": '
           '"postgres://db/app", "pool": 10}, "logging": {"level": "info", "file": "app.log"}}')
HELD_BACK = {  # issue 36's held-back set: grounded prompts written before that round's tuning, never changed
    "go-rename": "Rename `counts` to `frequencies` in this Go function and show the whole code:\n\n" + _GO,
    "go-comment": "Add a doc comment to this Go function and show the whole code:\n\n" + _GO,
    "sql-alias": "Rewrite this SQL query with the table aliases c and o and show the whole query:\n\n" + _SQL,
    "sql-limit": "Change this query to return the top 25 rows and show the whole query:\n\n" + _SQL,
    "email-points": "List the requested changes in this email as bullet points:\n\n" + _EMAIL,
    "email-reply": "Write a short reply to this email that repeats the two changes:\n\n" + _EMAIL,
    "json-pretty": "Format this JSON with two-space indentation:\n\n" + _CONFIG,
    "json-port": "Change the port to 9090 in this JSON and show the whole JSON:\n\n" + _CONFIG,
}
REPLAY_PROMPTS = {**PROMPTS, **HELD_OUT, **MORE, **HELD_BACK}
REPLAY_GROUNDED = (*GROUNDED_PROMPTS, *HELD_OUT, *MORE, *HELD_BACK)
DEPTH = GenerationConfig().shape.depth  # the engine's default draft depth
SEARCH_DEPTHS = (0, 1, 2, 3, 4, 5, 7, 9, 11, 15, 19, 23, 27, 31)  # depths hindsight() tries per kind
NGRAM = NGramDrafter  # the planner reads only `source` (None: free proposals) from a drafter

Answers = dict[str, tuple[list[int], list[int]]]  # prompt name: (prompt tokens, greedy output)


@dataclass(frozen=True)
class Replay:
    seconds: float  # target time of the replayed decode
    steps: int
    drafted: int
    accepted: int


def replay(planner: Planner | Mapping[str, int], prompt: Sequence[int], output: Sequence[int],
           cost: Callable[[int], float], max_tokens: int, depth: int = DEPTH, shadow: bool = False,
           kinds: set[str] | None = None, trace: list[tuple[int, str | None, int, int]] | None = None) -> Replay:
    """Decode `output` again as the engine would with the n-gram drafter and this planner: each
    step the lookup proposes, the planner picks a depth, the recorded output says how much of it
    the target accepts (greedy: the drafted tokens that equal it), and the step costs cost(d + 1).
    With `shadow`, every proposal is also scored against the output once the output shows how far
    it was right, and that (not the draft) is what the planner learns acceptance from. A mapping
    instead of a planner is a fixed policy: that many tokens of every proposal of a kind (0 if
    absent). `kinds` collects the kinds of the proposals seen; `trace`, every step's decision:
    (output position, kind of the proposal or None, depth drafted, tokens accepted)."""
    lookup, pending = answer_lookup(output, max_tokens), []
    i = seconds = steps = drafted = accepted = 0
    if isinstance(planner, Planner):
        planner.begin(max_tokens)
    while i < len(output):
        available = min(depth, max_tokens - i - 1)
        proposal = lookup.propose([*prompt, *output[:i]], available) if available > 0 else None
        kind, d = None, 0
        if proposal is not None:
            kind = ngram_kind(proposal)
            if isinstance(planner, Planner):
                d, _ = planner.choose(NGRAM, kind, len(proposal.tokens))
            else:
                d = min(planner.get(kind, 0), len(proposal.tokens))
            if shadow:
                pending.append((i, proposal.tokens, kind))
            if kinds is not None:
                kinds.add(kind)
        n = _run(proposal.tokens[:d], output[i:]) if d else 0
        secs = cost(d + 1)
        if trace is not None:
            trace.append((i, kind, d, n))
        if isinstance(planner, Planner):
            planner.observe(None if shadow else kind, d, n, d + 1, secs,
                            proposal.tokens if proposal is not None else (), output[i:i + n + 1])
        seconds, steps, drafted, accepted, i = seconds + secs, steps + 1, drafted + d, accepted + n, i + n + 1
        if shadow:
            pending = settle(planner, pending, output[:i])
    if isinstance(planner, Planner):
        planner.finish()  # as the engine does: what it learned goes into its profile
    return Replay(seconds, steps, drafted, accepted)


def answer_lookup(output: Sequence[int], max_tokens: int) -> ContextLookup:
    """The context lookup as the engine makes it, its proposals ending at the model's
    end-of-generation tokens; a replay knows those only from an answer that stopped before
    `max_tokens` (greedy answers stop at one, its last token). An answer cut at `max_tokens` never
    reached one, so a proposal running past one is rejected there in any case (it costs the few
    tokens past it, which the engine does not draft)."""
    if output and len(output) < max_tokens:
        end = output[-1]
        return ContextLookup(lambda t: t == end)
    return ContextLookup()


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


def settle(planner: Planner, pending: list[tuple[int, tuple[int, ...], str]],
           known: Sequence[int]) -> list[tuple[int, tuple[int, ...], str]]:
    """Learn from the proposals whose outcome the known output decides (a mismatch, or every
    token matched), as if each had been drafted whole; returns those still undecided."""
    undecided = []
    for start, tokens, kind in pending:
        n = _run(tokens, known[start:])
        if n == len(tokens) or start + n < len(known):
            planner.acceptance(kind).observe(n, len(tokens))
        else:
            undecided.append((start, tokens, kind))
    return undecided


class _Target:
    file_bytes = 1  # only read for draft models' size-scaled costs (none here)


def fresh_profile(curve: dict[int, float], prefill: float, warm_costs: bool) -> Profile:
    """A replay's own profile (never saved): the whole measured curve, or what a first run knows
    before its first draft (c(1) from its first step, c(16) and the prefill rate from its prefill)."""
    profile = Profile("replay", {})
    profile.costs = dict(curve) if warm_costs else {n: curve[n] for n in (1, 16) if n in curve}
    profile.prefill = prefill
    return profile


def planner_for(profile: Profile, uncapped: bool = False) -> Planner:
    """A planner of the engine's default shape that learns into `profile` (`uncapped`: one that
    drafts any kind as deep as its acceptance says pays, however little explored)."""
    return (UncappedPlanner if uncapped else Planner)(_Target(), GenerationConfig().shape,
                                                      profiles=Profiles.in_memory(), profile=profile)


class UnexploredAcceptance(Acceptance):
    def explored_depth(self) -> int:
        return NO_LIMIT


class UncappedPlanner(Planner):
    """The planner without its exploration cap (Acceptance.explored_depth): a first try of a kind
    may be as deep as the prior says pays."""

    acceptance_type = UnexploredAcceptance


def self_taught(prompt: Sequence[int], output: Sequence[int], curve: dict[int, float], prefill: float,
                cost: CostTable, max_tokens: int, rounds: int) -> float:
    """The uncapped planner's speedup on an answer after learning from that answer alone (`rounds`
    replays of it): what the planner reaches when the profile knows only this kind of prompt and
    nothing holds back deep drafts."""
    profile = warm_profile({"": (list(prompt), list(output))}, curve, prefill, cost, max_tokens, rounds,
                           shadow=False, uncapped=True)
    return speedup(profile, prompt, output, cost, max_tokens, shadow=False, uncapped=True)


def speedup(profile: Profile, prompt: Sequence[int], output: Sequence[int], cost: CostTable, max_tokens: int,
            shadow: bool, uncapped: bool = False) -> float:
    """The replayed decode's speed over the target alone's, starting from `profile`."""
    got = replay(planner_for(profile, uncapped), prompt, output, cost, max_tokens, shadow=shadow)
    return len(output) * cost(1) / got.seconds


def warm_profile(answers: Answers, curve: dict[int, float], prefill: float, cost: CostTable, max_tokens: int,
                 rounds: int, shadow: bool, uncapped: bool = False) -> Profile:
    """The profile after replaying every answer `rounds` times in order."""
    profile = fresh_profile(curve, prefill, warm_costs=True)
    for _ in range(rounds):
        for prompt, output in answers.values():
            replay(planner_for(profile, uncapped), prompt, output, cost, max_tokens, shadow=shadow)
            profile.cap_acceptance()
    return profile


def table(answers: Answers, curve: dict[int, float], prefill: float, max_tokens: int, rounds: int,
          variants: Sequence[bool], population: bool = False) -> list[str]:
    cost = CostTable(dict(curve), lambda: prefill)  # passes beyond the curve: a prefill's cost per further token
    names = {False: "baseline", True: "shadow"}
    header = ("| prompt | output tokens | ceiling | best depth per kind, in hindsight | uncapped, taught on this answer |"
              + (" one depth per kind for every prompt | the same, fitted on the other prompts |" if population else "")
              + "".join(f" {names[v]} cold | {names[v]} warm |" for v in variants))
    lines = [header, "|" + " --- |" + " ---: |" * (4 + 2 * population + 2 * len(variants))]
    warm = {v: warm_profile(answers, curve, prefill, cost, max_tokens, rounds, v) for v in variants}
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
        rows[name] = cells
        label = f"{name} (grounded)" if name in REPLAY_GROUNDED else name
        lines.append(f"| {label} | {len(output)} | " + " | ".join(f"{x:.2f}×" for x in cells) + " |")
    for label, names in (("grounded", REPLAY_GROUNDED), ("held back (issue 36)", HELD_BACK), ("every prompt", rows)):
        lines += summary(label, [cells for name, cells in rows.items() if name in names])
    return lines


def summary(label: str, cells: list[list[float]]) -> list[str]:
    """Geometric mean and worst of each column over a set of prompts (none: no lines)."""
    if not cells:
        return []
    means = [math.exp(sum(math.log(x) for x in column) / len(column)) for column in zip(*cells)]
    return [f"| {label}, geometric mean | | " + " | ".join(f"{x:.2f}×" for x in means) + " |",
            f"| {label}, worst | | " + " | ".join(f"{min(column):.2f}×" for column in zip(*cells)) + " |"]


def record(target, prompts: dict[str, str], max_tokens: int, saved: Path | None = None) -> Answers:
    """The target alone's greedy answer to each prompt (chat template), as token ids; with
    `saved`, answers recorded earlier for the same model file, prompt text and length are read
    from there and new ones added to it (a replay then needs no decoding)."""
    key = {"model": Path(target.path).name, "bytes": target.file_bytes, "tokens": max_tokens}
    store = _read_answers(saved, key)
    found = _found(store, prompts)
    for name, text in prompts.items():
        if name not in found:
            print(f"recording {name}", file=sys.stderr, flush=True)
            found[name] = greedy_answer(target, text, max_tokens)
            store[name] = {"text": text, "prompt": found[name][0], "output": found[name][1]}
    if saved is not None:
        saved.write_text(json.dumps({**key, "answers": store}))
    return {name: found[name] for name in prompts}


def _read_answers(saved: Path | None, key: dict) -> dict:
    """The answers in `saved` if it holds answers recorded under `key` (model, length), else none."""
    if saved is None or not saved.is_file():
        return {}
    data = json.loads(saved.read_text())
    same = all(data.get(k) == v for k, v in key.items())
    return data.get("answers", {}) if same else {}


def _found(store: dict, prompts: dict[str, str]) -> Answers:
    """The answers in `store` to those of `prompts` whose text it holds unchanged, in their order."""
    return {name: (list(entry["prompt"]), list(entry["output"])) for name, text in prompts.items()
            if (entry := store.get(name)) is not None and entry.get("text") == text}


def prefill_rate(target, tokens: int = 256) -> float:
    """Seconds per token of a long prompt prefill."""
    ids = (target.tokenize("The quick brown fox jumps over the lazy dog. " * 64) * 2)[:tokens]
    target.prefill(ids[:8], 0)  # warm-up
    target.seq_rm(0, 0, -1)
    t0 = time.perf_counter()
    target.prefill(ids, 0)
    rate = (time.perf_counter() - t0) / len(ids)
    target.seq_rm(0, 0, -1)
    return rate


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_prompts_option(p, REPLAY_PROMPTS)
    p.add_argument("--tokens", type=int, default=128, help="max tokens per answer (default 128)")
    p.add_argument("--warm-rounds", type=int, default=2, help="replays of every answer that build the warm profile")
    p.add_argument("--shadow", action="store_true", help="also replay the planner that learns from every proposal")
    p.add_argument("--population", action="store_true",
                   help="also the best fixed depth per kind for the whole set of prompts, fitted on the set and on "
                        "the other prompts (leave one out: one fit per prompt, minutes)")
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
    if args.prefill_rate is not None and (args.curve is None or not 0 < args.prefill_rate < 1):
        p.error("--prefill-rate needs --curve and must be between 0 and 1 (a prefill token is cheaper than a step)")
    return args


def parse_curve(text: str) -> dict[int, float]:
    """`2:1.76,4:3.02,...` as {1: 1.0, 2: 1.76, 4: 3.02, ...}, checked (an argparse type: --curve here
    and in gpu_predict.py)."""
    curve = {1: 1.0}
    for item in text.replace(" ", "").split(","):
        n, _, ratio = item.partition(":")
        try:
            size, value = int(n), float(ratio)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not N:RATIO (a pass size and its cost in c(1), "
                                             "e.g. 16:8.43)") from None
        if not 1 <= size <= 64 or not 1.0 <= value <= size:
            raise argparse.ArgumentTypeError(f"{item!r}: a pass of 1 to 64 tokens costs between c(1) and N·c(1)")
        curve[size] = value
    return curve


NOMINAL_C1 = 0.03  # seconds: c(1) of a replay that decodes nothing (speedups are ratios, the scale cancels)


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
    print("\n".join(table(answers, curve, prefill, args.tokens, args.warm_rounds, variants, args.population)))
    c1 = curve[1]
    print("\nn-gram decode speedup over the target alone; cost curve c(n)/c(1): "
          + ", ".join(f"{n}: {curve[n] / c1:.2f}" for n in sorted(curve)) + f"; prefill {prefill / c1:.2f} c(1)/token")
    return 0


def recorded(saved: Path | None, prompts: dict[str, str], max_tokens: int) -> Answers | None:
    """Every prompt's answer from `saved` (whatever model recorded them), or None if one is missing."""
    found = _found(_read_answers(saved, {"tokens": max_tokens}), prompts)
    return found if len(found) == len(prompts) else None


def measure(args: argparse.Namespace, prompts: dict[str, str]) -> tuple[Answers, dict[int, float], float]:
    """The default pair's target: its cost curve (or c(1) under the given ratios), prefill rate and answers."""
    from localspec.llama import registry
    from localspec.api import load_model

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
