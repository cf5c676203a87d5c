"""Cost-aware planning: how deep to draft at each step, or not at all, counting every cost.

The model (docs/design.md, "The cost model"): a step that drafts d levels and verifies n(d) + 1
tokens yields E(d) = (1 - α^(d+1)) / (1 - α) tokens on average (per-level acceptance α) and
costs what the drafter spends (nothing for n-gram lookups; for a draft model its catch-up on
tokens it has not seen plus d levels) plus c_target(n(d) + 1); the target alone yields one token
per c_target(1). The planner picks the d that maximises E(d) / cost(d), and d = 0 unless that
beats the target alone by a margin.

* Costs come from the models' profiles (localspec.decoding.profiles, passed in by whoever set the
  generation up): measured on earlier runs, refined by every step, never by dummy batches; the
  planner works on its own copies (localspec.decoding.costs.CostTable) and writes them back with
  :meth:`Planner.record`. A size never measured is first estimated optimistically (from c(1) and
  the prompt prefill's rate), so it gets tried once and measured.
* Acceptance is tracked per kind of draft and per draft level (localspec.decoding.acceptance):
  E(d) comes from the measured chance of getting past each level, kept apart for a sampling
  target (temperature > 0); decisions use an upper confidence bound, but never deeper than twice
  the levels that kind has been seen to reach (a first try is FIRST_TRY deep).
* A draft accepted whole says nothing about the levels it did not draft, so a planner that
  learned only from its drafts would never learn that a copy drafted 3 tokens at a time runs on
  for 20 (on a curve where 4 to 7 tokens cost more per token than 3, it never tried deeper). The
  rest of such a draft's proposal (a deterministic one: the n-gram drafter's) is compared with
  the tokens that follow, and the draft counts as drafted that deep
  (localspec.decoding.acceptance.Censored).
* Drafts are paid for: a draft is made only when its worst case (every token rejected: its cost
  less c(1)) fits in what this generation's drafts have saved so far plus an allowance of the
  generation's length at c(1): LOSS_ALLOWANCE for a draft deeper than FIRST_TRY levels, FLOOR for
  a shallower one. So a warm profile whose copies ran long elsewhere cannot cost a prompt whose
  drafts are rejected more than that: once its allowance is spent, a generation drafts only where
  its own drafts have paid (never below 1 - FLOOR of the target alone's speed).
* A draft model that is not loaded is loaded only when, at α = 1 and with measured target costs,
  its best case over the tokens still to generate repays loading it and prefilling the prompt.

Choosing the draft length from past observations keeps verification lossless: each step is
verified exactly, whatever length the history chose.

The planner's interface is the policy's (localspec.decoding.policy.Policy): :meth:`Planner.pick`,
:meth:`Planner.prefill`, :meth:`Planner.observe_step` and :meth:`Planner.finish`, which the engine
calls and the benchmarks' replays call the same way. :meth:`Planner.choose` and
:meth:`Planner.worth_loading` answer what it would decide without changing anything (reports ask
them); the other methods are the steps those are built from (the unit tests take them one by one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from localspec.decoding import passes
from localspec.decoding.acceptance import DEFAULT_PRIOR_HAZARD, FIRST_TRY, LEVELS, PRIOR_HAZARD, Acceptance, Censored
from localspec.decoding.batch_plan import Offer
from localspec.decoding.costs import EMA, CostTable, plausible_costs
from localspec.decoding.passes import Steps
from localspec.decoding.profiles import Profile, Profiled, Profiles
from localspec.settings.shape import Shape

if TYPE_CHECKING:
    from localspec.decoding.drafters import Drafter, DraftProposal, ModelDrafter
    from localspec.decoding.state import Draft
    from localspec.llama.sequence import KVSequence

log = logging.getLogger(__name__)

MARGIN = 1.1  # speculate only when it is predicted to be at least 10 % faster (estimates are noisy)
CURVE_SIZES = (16,)  # pass sizes the prompt prefill measures, once (others: by drafts; a measured pass of
# n tokens costs ~n·(c(n)/n - prefill rate) more than prefilling them, ~0.1 s for 16 on the reference CPU)
PREFILL_WARM_UP = 4  # prompt tokens decoded before a measured chunk, unmeasured (a cold first decode is slow)
SAMPLED = "@sampled"  # suffix of a kind's profile entry when the target samples (temperature > 0)
LOSS_ALLOWANCE = 0.01  # of a generation's tokens at c(1): what deep drafts may lose before they have saved anything
FLOOR = 0.03  # ... and what any drafts may lose: a generation's drafts never cost it more than 3 %
MIN_TOKEN_SHARE = 0.05  # of c(1): the least a token adds to a pass where no prefill rate is known
MAX_CENSORED = 64  # drafts whose outcome past their depth is still open (each settles within its proposal's length)


class Planner:
    """Chooses each step's draft depth for one target and its drafters."""

    acceptance_type: type[Acceptance] = Acceptance  # what tracks each kind's acceptance (a replay may vary it)
    margin: float = MARGIN  # the predicted speed over the target alone's a draft must reach (a replay may vary it)

    def __init__(self, target: Profiled, shape: Shape, sampled: bool = False, *, profiles: Profiles,
                 profile: Profile | None = None) -> None:
        self.shape = shape
        self.sampled = sampled  # temperature > 0: acceptance is kept apart from greedy decoding's
        self._nodes = [shape.truncated(d).n_nodes for d in range(shape.depth + 1)]  # nodes by depth
        self.target_bytes = target.file_bytes
        self.profiles = profiles  # given by whoever sets up the generation (the engine)
        self.profile = self.profiles.get(target.identity) if profile is None else profile  # given: a replay's
        self.target_cost = CostTable(plausible_costs(self.profile.costs), lambda: self.profile.prefill)
        self._acceptance: dict[str, Acceptance] = {}
        self._draft_costs: dict[str, tuple[Profile, CostTable]] = {}
        self._censored: list[Censored] = []  # whole drafts whose proposals are still being compared
        self.saved: float | None = None  # seconds this generation's drafts saved (None: not started)
        self.length = 0  # tokens the generation may make (its allowances are fractions of them at c(1))

    # ------------------------------------------------------------------ the policy (localspec.decoding.policy)

    def pick(self, proposals: Sequence[DraftProposal], depth: int, prompt_tokens: int,
             remaining: int, batch: int = 0) -> tuple[DraftProposal, int] | None:
        """The proposal with the best predicted rate, at its best depth; None when none beats the
        target alone (a draft model not loaded yet only where loading it would pay). `batch`: the
        tokens other calls put in the same target pass: a draft then pays for its share of the
        pass, what its tokens add to it (see :meth:`choose`)."""
        if self.saved is None:
            self.begin(remaining)
        best: tuple[float, int, DraftProposal] | None = None
        for proposal in proposals:
            drafter = proposal.drafter
            if not drafter.loaded and not self.worth_loading(drafter, prompt_tokens, remaining):
                continue
            planned, rate = self.choose(drafter, proposal.kind, proposal.levels, proposal.lag, batch)
            if planned > 0 and (best is None or rate > best[0]):
                best = (rate, planned, proposal)
        return None if best is None else (best[2], best[1])

    def offer(self, proposals: Sequence[DraftProposal], depth: int, prompt_tokens: int,
              remaining: int) -> tuple[DraftProposal, Offer] | None:
        """The step's options for a round planned with other calls (localspec.decoding.batch_plan):
        the proposal pick would draft from alone, with every depth this generation may draft it
        (explored, and within what it may lose: the allowances) and, at each, its expected tokens,
        its tokens in the pass and its draft model's seconds. None: nothing to offer (a target-only
        step; c(1) unmeasured yet, or no depth allowed)."""
        if self.saved is None:
            self.begin(remaining)
        c1 = self._measured_c1()
        if c1 <= 0:
            return None
        best: tuple[float, DraftProposal, list[int], list[float]] | None = None
        for proposal in proposals:
            drafter = proposal.drafter
            if not drafter.loaded and not self.worth_loading(drafter, prompt_tokens, remaining):
                continue
            options, expected = self._allowed(drafter, proposal.kind, proposal.levels, proposal.lag, c1)
            if options:
                rate = max(expected[d] / cost for d, cost in options)
                if best is None or rate > best[0]:
                    best = (rate, proposal, [d for d, _ in options], expected)
        if best is None:
            return None
        _, proposal, allowed, expected = best
        depths = (0, *allowed)
        tokens = tuple(self._nodes[d] + 1 for d in depths)
        drafting = tuple(self.step_cost(proposal.drafter, d, proposal.lag) - self.target_cost(self._nodes[d] + 1)
                         for d in depths)
        return proposal, Offer(depths, tuple(expected[d] for d in depths), tokens, drafting, self.target_cost,
                               self.margin)

    def begin(self, remaining: int) -> None:
        """A generation of up to `remaining` tokens starts (at its first step): nothing saved yet."""
        self.saved, self.length = 0.0, remaining

    def allowance(self, depth: int) -> float:
        """What drafts `depth` levels deep may lose beyond what this generation's drafts saved."""
        return (LOSS_ALLOWANCE if depth > FIRST_TRY else FLOOR) * self.length * self._measured_c1()

    def prefill(self, sequence: KVSequence, upto: int) -> Steps[None]:
        """Decode the prompt up to `upto`: chunks of the pass sizes whose cost is unknown are
        decoded as verification passes are (logits for every token) and timed, real work that
        measures the cost curve; the rest is timed as a prefill (nothing to measure: one plain
        prefill, as the target alone does). A pass other calls shared (the pair's scheduler)
        measures nothing."""
        sizes = self.sizes_to_measure(upto - sequence.n_cached - PREFILL_WARM_UP)
        if sizes:  # warm up first, unmeasured (a cold first decode is slow)
            yield from passes.fill(sequence, sequence.n_cached + PREFILL_WARM_UP)
        for n in sizes:
            decoded = yield passes.Fill(sequence, sequence.n_cached + n, outputs="all", measure=True)
            if decoded.alone(n) and decoded.timed is not None:
                self.target_cost.observe(n, decoded.timed)
        rest, t0, shared = upto - sequence.n_cached, time.perf_counter(), False
        while sequence.n_cached < upto:
            before = sequence.n_cached
            decoded = yield passes.Fill(sequence, upto)
            shared = shared or not decoded.alone(sequence.n_cached - before) or decoded.timed is None
        if not shared:
            self.observe_prefill(self.profile, rest, time.perf_counter() - t0)

    def observe_step(self, draft: Draft, n_accepted: int, target_seconds: float | None, new: Sequence[int],
                     pass_tokens: int | None = None) -> None:
        """A verified step: acceptance of its kind, the target pass's cost (not a forced chain's,
        decoded with one logits row; none where the step used the prefill's logits), the draft
        model's timing; `new`: the tokens it committed; `pass_tokens`: the tokens of the pass,
        other calls' included (the cost is a point of the curve at that size)."""
        kind = draft.kind if draft.n else None
        draft_seconds = 0.0
        if draft.decoded_depth:  # a draft model's draft: only a ModelDrafter decodes levels
            drafter = cast("ModelDrafter", draft.drafter)  # (not imported here: it needs llama.cpp)
            self.observe_draft(drafter)
            timing = drafter.timing
            draft_seconds = timing.catch_up[1] + timing.levels[1]
        self.observe(kind, max(draft.tree.depths, default=0), n_accepted, draft.n + 1,
                     None if draft.certain else target_seconds, draft.offered, new, draft_seconds, pass_tokens)

    def finish(self) -> None:
        """The generation ended: what it learned goes into the profile."""
        self._censored.clear()  # their levels are counted as far as the output decided them
        self.saved = None
        self.record()

    def profile_of(self, model: Profiled) -> Profile:
        """The cost profile of a loaded (or lazily loaded) model."""
        return self.profiles.get(model.identity)

    def record(self) -> None:
        """Write what this planner learned (costs, acceptance) into the profiles, in memory; the
        profiles' owner saves them."""
        with self.profiles.lock:
            self._record()

    def _record(self) -> None:
        for profile, table in ((self.profile, self.target_cost), *self._draft_costs.values()):
            profile.costs = dict(table.seconds)
            profile.prefill = table.prefill_rate()  # at today's c(1); an implausible one is forgotten
            table.prefill_scale = 1.0
            profile.dirty = True
        for kind, acc in self._acceptance.items():
            self.profile.acceptance[self._entry(kind)] = [list(acc.at_risk), list(acc.rejected)]

    # ------------------------------------------------------------------ what things cost

    def _entry(self, kind: str) -> str:
        """The profile's entry for a kind of draft: a sampled target accepts fewer copies than a
        greedy one, so they are learned apart."""
        return kind + SAMPLED if self.sampled else kind

    def acceptance(self, kind: str) -> Acceptance:
        acc = self._acceptance.get(kind)
        if acc is None:
            at_risk, rejected = self.profile.levels(self._entry(kind), LEVELS)
            prior = PRIOR_HAZARD.get(kind, DEFAULT_PRIOR_HAZARD)
            acc = self._acceptance[kind] = self.acceptance_type(list(at_risk), list(rejected), prior)
        return acc

    def draft_cost(self, source: Profiled) -> CostTable:
        """A draft model's cost per level, from its profile."""
        return self._cost_table_of(self.profile_of(source))

    def _draft_level(self, source: Profiled) -> float:
        """Seconds per draft level: measured, else the target's c(1) scaled by the file sizes
        (on a CPU a model's step costs about its size)."""
        own = self.draft_cost(source)(1)
        return own if own > 0 else self.target_cost(1) * source.file_bytes / self.target_bytes

    def pass_cost(self, tokens: int, batch: int = 0) -> float:
        """What `tokens` add to a target pass that holds `batch` tokens of other calls (alone:
        the cost of a pass of `tokens`)."""
        if batch <= 0:
            return self.target_cost(tokens)
        # never free: a token costs at least what a token of a long prefill costs (a flat stretch of
        # the curve between two measured sizes is an estimate, not a free ride)
        floor = tokens * (self.target_cost.prefill_rate() or MIN_TOKEN_SHARE * self.target_cost(1))
        return max(self.target_cost(batch + tokens) - self.target_cost(batch), floor)

    def step_cost(self, drafter: Drafter, depth: int, lag: int, batch: int = 0) -> float:
        cost = self.pass_cost(self._nodes[depth] + 1, batch)
        source = drafter.source
        if source is not None:  # a draft model: catch up on `lag` tokens, then `depth` levels
            level = self._draft_level(source)
            per_token = self.draft_cost(source).prefill_rate() or level / 3
            cost += lag * per_token + depth * level
        return cost

    # ------------------------------------------------------------------ decisions

    def _measured_c1(self) -> float:
        """c(1) as measured (0 until a single-token step has run), never estimated from larger passes."""
        return self.target_cost.seconds.get(1, 0.0)

    def choose(self, drafter: Drafter, kind: str, available: int, lag: int = 0, batch: int = 0) -> tuple[int, float]:
        """The draft depth to use now with this drafter and its predicted tokens per second
        (depth 0: the target alone does better), deciding with the upper bound of the acceptance
        (so a kind little seen gets tried) but never deeper than the kind has been explored
        (Acceptance.explored_depth: a first try is cheap, later ones double). With `batch`
        tokens of other calls in the pass, a step costs what its tokens add to the pass
        (speculation and batching compete for the same spare compute: Su et al., "The synergy of
        speculative decoding and batching", arXiv 2310.18813), and so does the step it would replace."""
        c1 = self._measured_c1()
        if available <= 0 or c1 <= 0:
            return 0, 0.0  # nothing to draft, or c(1) not measured yet: this step measures it
        if batch > 0:
            c1 = self.pass_cost(1, batch) or c1
        allowed, expected = self._allowed(drafter, kind, available, lag, c1, batch)
        best, best_rate = 0, self.margin / c1
        for d, cost in allowed:
            rate = expected[d] / cost
            if rate > best_rate:
                best, best_rate = d, rate
        return best, best_rate

    def _allowed(self, drafter: Drafter, kind: str, available: int, lag: int, root: float,
                 batch: int = 0) -> tuple[list[tuple[int, float]], list[float]]:
        """The depths this generation may draft a proposal of `kind` to now, each with its step's
        cost: up to `available`, no deeper than the kind has been explored, and only those whose
        worst case (the step's cost beyond `root`, the step without a draft) is within what the
        generation may lose (every depth of a certain kind: forced tokens, nothing to lose); and
        E[tokens per step] at each depth."""
        acc = self.acceptance(kind)
        limit = min(available, acc.explored_depth())
        expected = acc.expectations(limit)
        certain = acc.prior == 0.0 and not any(acc.rejected)
        saved = None if certain else self.saved  # drafts are held to what the generation may lose (None: not held)
        costs = [(d, self.step_cost(drafter, d, lag, batch)) for d in range(1, limit + 1)]
        return [(d, cost) for d, cost in costs if saved is None or cost - root <= saved + self.allowance(d)], expected

    def worth_loading(self, drafter: Drafter, prompt_tokens: int, remaining: int) -> bool:
        """Is a draft model worth loading now? Only with measured target costs, and only when its
        best case (everything accepted) over the `remaining` tokens repays loading it and
        prefilling the prompt."""
        c1 = self._measured_c1()
        measured = [n for n in self.target_cost.seconds if n > 1]
        source = drafter.source
        if c1 <= 0 or not measured or remaining <= 1 or source is None:  # None: no model to load
            return False
        level = self._draft_level(source)
        load = self.profile_of(source).load or 2.0 * source.file_bytes / 1e9  # ~2 s per GB here
        prefill = prompt_tokens * (self.draft_cost(source).prefill_rate() or level / 3)
        best = min(self.step_cost(drafter, d, 0) / (d + 1) for d in range(1, self.shape.depth + 1))
        gain = remaining * (c1 - best)
        log.debug("draft model: best case %.1f ms/token vs %.1f, gain %.2f s vs load+prefill %.2f s",
                  best * 1e3, c1 * 1e3, gain, load + prefill)
        return gain > load + prefill

    # ------------------------------------------------------------------ learning

    def sizes_to_measure(self, budget: int) -> list[int]:
        """Pass sizes whose cost is not known yet that a prefill of `budget` tokens can measure
        (largest first): the cost curve is learned from the prompt, a chunk of each size."""
        out = []
        for n in CURVE_SIZES:
            if n <= budget and n not in self.target_cost.seconds:
                out.append(n)
                budget -= n
        return out

    def observe(self, kind: str | None, depth: int, n_accepted: int, n_target_tokens: int,
                target_seconds: float | None, offered: Sequence[int] = (), new: Sequence[int] = (),
                draft_seconds: float = 0.0, pass_tokens: int | None = None) -> None:
        """One step: its draft's acceptance and what its target pass cost (None: not a
        verification pass, e.g. a forced run decoded with one logits row; not a point of the curve).
        `offered`: a deterministic draft's whole proposal (the tokens it was cut from), `new`: the
        tokens the step committed; a draft accepted whole and shorter than its proposal is
        counted once the output shows how far the proposal was right (Censored). `pass_tokens`:
        the tokens of the pass with other calls' (their cost is a point of the curve at that size;
        what the step saved is counted as if it ran alone)."""
        for acc in self._acceptance.values():
            acc.decay()
        if target_seconds is not None:
            size = max(pass_tokens or n_target_tokens, n_target_tokens)
            self.target_cost.observe(size, target_seconds)
            if depth > 0 and self.saved is not None:
                # what the draft saved, counted in steps of this call alone (the allowances' unit),
                # beside others too (its step alone read from the curve): priced at its marginal
                # share of a batched pass, a token costs about the same drafted or not, so nothing
                # would ever count as saved and drafts beside others would never go past a first try
                share = target_seconds if size == n_target_tokens else self.target_cost(n_target_tokens)
                self.saved += (n_accepted + 1) * self._measured_c1() - share - draft_seconds
        self._settle_censored(new)
        if kind is not None and depth > 0:
            acc = self.acceptance(kind)
            acc.observe(n_accepted, depth)
            if n_accepted == depth < len(offered) and len(self._censored) < MAX_CENSORED:
                censored = Censored(acc, tuple(offered), depth)
                if not censored.follow(new[depth:]):  # this step's extra token decides the next level
                    self._censored.append(censored)
        self.profile.dirty = True

    def _settle_censored(self, new: Sequence[int]) -> None:
        """Compare the open drafts' proposals with the committed tokens, level by level."""
        self._censored = [c for c in self._censored if not c.follow(new)]

    def observe_draft(self, drafter: ModelDrafter) -> None:
        """A draft model's last draft: its cost per level, its catch-up as a prefill rate, and
        what loading it took (a lazy draft loaded for this draft)."""
        profile = self.profile_of(drafter.source)
        if drafter.source.load_seconds is not None:
            profile.load = drafter.source.load_seconds
        levels, secs = drafter.timing.levels
        if levels > 0:
            self.draft_cost(drafter.source).observe(1, secs / levels)
        n, secs = drafter.timing.catch_up
        self.observe_prefill(profile, n, secs)
        profile.dirty = True

    def observe_prefill(self, profile: Profile, n_tokens: int, seconds: float) -> None:
        """A prompt prefill: the per-token rate of long batches (only long ones tell it)."""
        if n_tokens >= 32:
            rate = seconds / n_tokens
            table = self._cost_table_of(profile)
            known = table.prefill_rate()
            profile.prefill = rate if known is None else (1 - EMA) * known + EMA * rate
            table.prefill_observed()
            profile.dirty = True

    def _cost_table_of(self, profile: Profile) -> CostTable:
        """The cost table that prices passes of the model `profile` belongs to."""
        if profile is self.profile:
            return self.target_cost
        found = self._draft_costs.get(profile.key)
        if found is None:
            found = self._draft_costs[profile.key] = (profile, CostTable(dict(profile.costs), lambda: profile.prefill))
        return found[1]
