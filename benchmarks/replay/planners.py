"""The planners a replay runs (benchmarks.replay.steps), each the engine's real planner or a variant of
it that differs in one thing, and the profiles they start from and learn into.

* the planner itself (localspec.decoding.planner.Planner), as ``--plan auto`` runs it;
* :class:`UncappedPlanner`: without its exploration cap (a first try of a kind may be as deep as
  its prior says pays): how close the planner comes when nothing holds back deep drafts;
* :class:`ShadowPlanner`: it learns acceptance from every proposal, drafted or not, compared with
  the tokens that followed, instead of from its drafts (at T = 0 a one-hot draft is accepted
  exactly where it equals the output): acceptance evidence at no cost for every kind and depth,
  which the planner only gets by drafting.
* :class:`BatchBlindPlanner`: it is told it is alone in every pass (batch = 0), so with other
  calls in the pass it drafts as one call alone would: what pricing the batch is worth (the batch
  replay, benchmarks.replay.batch).

A replay's profile is its own (never saved): "cold" knows what a first run knows before its
first draft (c(1), c(16) and the prefill rate), "warm" what replaying a set of answers left.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from localspec.decoding.acceptance import NO_LIMIT, Acceptance
from localspec.decoding.costs import CostTable
from localspec.decoding.drafters import DraftProposal
from localspec.decoding.planner import Planner
from localspec.decoding.profiles import Profile, Profiled, Profiles
from localspec.decoding.state import Draft
from localspec.settings.generation import GenerationConfig
from localspec.settings.shape import Shape

from benchmarks.replay.ceiling import matched_run
from benchmarks.replay.steps import replay

Pending = list[tuple[int, tuple[int, ...], str]]  # proposals not decided yet: (output position, tokens, kind)


class ReplayTarget:
    """What a planner reads of its target in a replay: the file's size (only for draft models'
    size-scaled costs, none here) and the identity its profile would be kept under."""

    file_bytes = 1
    identity = {"model": "replay"}


class UnexploredAcceptance(Acceptance):
    def explored_depth(self) -> int:
        return NO_LIMIT


class UncappedPlanner(Planner):
    """The planner without its exploration cap (Acceptance.explored_depth): a first try of a kind
    may be as deep as the prior says pays."""

    acceptance_type = UnexploredAcceptance


class ShadowPlanner(Planner):
    """The planner that learns acceptance from every proposal it is offered, each counted as if
    drafted whole once the output decides it (:meth:`settle`), and not from its drafts."""

    def __init__(self, target: Profiled, shape: Shape, sampled: bool = False, *, profiles: Profiles,
                 profile: Profile | None = None) -> None:
        super().__init__(target, shape, sampled, profiles=profiles, profile=profile)
        self._pending: Pending = []
        self._output: list[int] = []  # the tokens this generation committed

    def pick(self, proposals: Sequence[DraftProposal], depth: int, prompt_tokens: int,
             remaining: int, batch: int = 0) -> tuple[DraftProposal, int] | None:
        self._pending += [(len(self._output), proposal.tokens, proposal.kind) for proposal in proposals]
        return super().pick(proposals, depth, prompt_tokens, remaining, batch)

    def observe_step(self, draft: Draft, n_accepted: int, target_seconds: float | None, new: Sequence[int],
                     pass_tokens: int | None = None) -> None:
        super().observe_step(replace(draft, kind=None), n_accepted, target_seconds, new, pass_tokens)  # costs, not acceptance
        self._output += new
        self._pending = self.settle(self._pending, self._output)

    def finish(self) -> None:
        self._pending, self._output = [], []
        super().finish()

    def settle(self, pending: Pending, known: Sequence[int]) -> Pending:
        """Learn from the proposals whose outcome the known output decides (a mismatch, or every
        token matched), as if each had been drafted whole; returns those still undecided."""
        undecided = []
        for start, tokens, kind in pending:
            n = matched_run(tokens, known[start:])
            if n == len(tokens) or start + n < len(known):
                self.acceptance(kind).observe(n, len(tokens))
            else:
                undecided.append((start, tokens, kind))
        return undecided


class BatchBlindPlanner(Planner):
    """The planner told that no other call shares its passes: it offers nothing to a round's plan
    and picks with batch = 0, pricing each draft at what it costs alone, not at what its tokens
    add to the pass."""

    def offer(self, proposals: Sequence[DraftProposal], depth: int, prompt_tokens: int,
              remaining: int) -> None:
        return None

    def pick(self, proposals: Sequence[DraftProposal], depth: int, prompt_tokens: int,
             remaining: int, batch: int = 0) -> tuple[DraftProposal, int] | None:
        return super().pick(proposals, depth, prompt_tokens, remaining, 0)


def fresh_profile(curve: dict[int, float], prefill: float, warm_costs: bool) -> Profile:
    """A replay's own profile (never saved): the whole measured curve, or what a first run knows
    before its first draft (c(1) from its first step, c(16) and the prefill rate from its prefill)."""
    profile = Profile("replay", {})
    profile.costs = dict(curve) if warm_costs else {n: curve[n] for n in (1, 16) if n in curve}
    profile.prefill = prefill
    return profile


def planner_for(profile: Profile, uncapped: bool = False, shadow: bool = False, margin: float | None = None,
                batch_blind: bool = False) -> Planner:
    """A planner of the engine's default shape that learns into `profile` (`uncapped`: one that
    drafts any kind as deep as its acceptance says pays, however little explored; `shadow`: one
    that learns from every proposal; `batch_blind`: one told it is alone in every pass; `margin`:
    the predicted speedup a draft must reach, instead of Planner.margin)."""
    if shadow + uncapped + batch_blind > 1:
        raise ValueError("a replay's planner is the planner or one variant of it (uncapped, shadow or batch-blind)")
    kind: type[Planner] = (ShadowPlanner if shadow else UncappedPlanner if uncapped
                           else BatchBlindPlanner if batch_blind else Planner)
    if margin is not None:
        kind = type(f"{kind.__name__}Margin", (kind,), {"margin": margin})
    return kind(ReplayTarget(), GenerationConfig().shape, profiles=Profiles.in_memory(), profile=profile)


def speedup(profile: Profile, prompt: Sequence[int], output: Sequence[int], cost: CostTable, max_tokens: int,
            shadow: bool, uncapped: bool = False, margin: float | None = None) -> float:
    """The replayed decode's speed over the target alone's, starting from `profile`."""
    got = replay(planner_for(profile, uncapped, shadow, margin), prompt, output, cost, max_tokens)
    return len(output) * cost(1) / got.seconds


def warm_profile(answers: Mapping[str, tuple[list[int], list[int]]], curve: dict[int, float], prefill: float,
                 cost: Callable[[int], float], max_tokens: int, rounds: int, shadow: bool,
                 uncapped: bool = False, margin: float | None = None) -> Profile:
    """The profile after replaying every answer `rounds` times in order (acceptance counts capped
    between generations as the profile store caps them)."""
    profile = fresh_profile(curve, prefill, warm_costs=True)
    for _ in range(rounds):
        for prompt, output in answers.values():
            replay(planner_for(profile, uncapped, shadow, margin), prompt, output, cost, max_tokens)
            profile.cap_acceptance()
    return profile


def self_taught(prompt: Sequence[int], output: Sequence[int], curve: dict[int, float], prefill: float,
                cost: CostTable, max_tokens: int, rounds: int) -> float:
    """The uncapped planner's speedup on an answer after learning from that answer alone (`rounds`
    replays of it): what the planner reaches when the profile knows only this kind of prompt and
    nothing holds back deep drafts."""
    profile = warm_profile({"": (list(prompt), list(output))}, curve, prefill, cost, max_tokens, rounds,
                           shadow=False, uncapped=True)
    return speedup(profile, prompt, output, cost, max_tokens, shadow=False, uncapped=True)
