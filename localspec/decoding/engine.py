"""The speculative step loop: draft → one target pass → C verify → commit (:meth:`Engine.step`).

Invariant between steps: every committed token but the last (the "root") is in the target's KV
cache as the first sequence of the generation's slot; the pair's state (:class:`~localspec.decoding.state.PairState`) owns the
target's and the draft's KV sequences and the grammar. A step asks each drafter for a proposal,
the policy (localspec.decoding.policy: the planner, or the fixed rule) picks one and a depth, its
drafter drafts a chain/paths/tree, ONE target decode runs over the root and every draft node
(branches as KV sequences sharing the prefix), the C verifier accepts a path and draws the extra
token, and the state commits the new tokens to every cache.

The engine alone keeps the statistics of a generation (:meth:`Engine.stats`). It does no I/O:
what the planner learned goes into the cost profiles it was given, which their owner saves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from localspec.decoding import passes
from localspec.decoding.depth import batch_depth, step_depth
from localspec.decoding.drafters import Drafter, DraftProposal, ForcedDrafter, ModelDrafter
from localspec.decoding.passes import Steps, Turn, resolve, run_alone
from localspec.decoding.planner import Planner
from localspec.decoding.policy import FixedPolicy, Policy
from localspec.decoding.profiles import Profiles
from localspec.decoding.state import NO_DRAFT, Draft, PairState
from localspec.decoding.stats import GenerationStats
from localspec.errors import PromptError
from localspec.llama.model import Model
from localspec.llama.sequence import KVSequence
from localspec.settings.generation import WITHOUT_REPLACEMENT, GenerationConfig
from localspec.verify import verifier

if TYPE_CHECKING:
    from localspec.decoding.grammar.steps import StepMasks, Structured

log = logging.getLogger(__name__)

ALONE = Turn()  # a step with nothing else in its target pass


@dataclass
class _Counters:
    prompt_tokens: int = 0
    generated: int = 0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    prompt_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    verify_s: float = 0.0
    start: float = field(default_factory=time.perf_counter)
    hist: list[int] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=dict)
    constraint_s: float = 0.0
    cached: int = 0
    limits: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> GenerationStats:
        return GenerationStats(self.prompt_tokens, self.generated, self.passes, self.drafted,
                               self.accepted, self.prompt_s, time.perf_counter() - self.start,
                               self.draft_s, self.target_s, self.verify_s, tuple(self.hist),
                               tuple(sorted(self.by_kind.items())), self.constraint_s, self.cached,
                               tuple(sorted(self.limits.items())))

    def step(self, kind: str | None, drafted: int, accepted: int, seconds: tuple[float, float, float]) -> None:
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        if kind is not None and accepted:
            self.by_kind[kind] = self.by_kind.get(kind, 0) + accepted
        if drafted:
            while len(self.hist) <= accepted:
                self.hist.append(0)
            self.hist[accepted] += 1
        self.draft_s += seconds[0]
        self.target_s += seconds[1]
        self.verify_s += seconds[2]


def check_prompt(prompt: Sequence[int], n_ctx: int) -> None:
    """A PromptError unless the prompt has tokens and leaves room in a context of n_ctx."""
    if not prompt:
        raise PromptError("the prompt is empty (no tokens to condition on)")
    if len(prompt) >= n_ctx:
        raise PromptError(f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}; "
                          "shorten the prompt or raise --ctx-size")


def _plain_prefill(sequence: KVSequence, upto: int) -> Steps[None]:
    return passes.fill(sequence, upto)


class Engine:
    """Speculative decoding of one target with drafters tried in order (none: the target alone).
    The planner (``plan="auto"``) learns into `profiles`, which whoever sets up the generation owns
    and saves (None: profiles in memory, never saved — a check, a test)."""

    def __init__(self, target: Model, drafters: Sequence[Drafter], config: GenerationConfig,
                 profiles: Profiles | None = None) -> None:
        if drafters:
            config.check_fits(target.n_batch, target.options.n_seq_max)
        self.target = target
        self.config = config
        # the user's num_draft_tokens in its shape (nothing: the target alone), which step_depth cuts
        self.requested = config.shape if drafters else config.shape.truncated(0)
        # the deepest draft a step can have (what the drafters' buffers and the planner are sized for)
        self.shape = self.requested.truncated(batch_depth(self.requested, target.n_batch))
        self.sampling = config.sampling
        self.rng = np.random.default_rng(config.seed)
        self.finish_reason: str | None = None  # "stop" (end of generation) or "length" once done
        self.speculated = 0  # of the last step's new tokens, how many came first from an accepted draft (not forced)
        self._counters = _Counters()
        self.structured = self._structured(config) if config.constraint is not None else None
        forced = [ForcedDrafter(self.structured.follower, target.n_vocab, max(self.shape.depth, 1))
                  if self.structured is not None and drafters else None]
        self.drafters: list[Drafter] = [d for d in forced if d is not None] + list(drafters)
        model_drafter = next((d for d in self.drafters if isinstance(d, ModelDrafter)), None)
        self.state = PairState(target, model_drafter, self.structured)
        self.planner = (Planner(target, self.shape, sampled=not self.sampling.greedy,
                                profiles=Profiles.in_memory() if profiles is None else profiles)
                        if config.plan == "auto" else None)  # (the target alone's steps teach it c(1))
        self.policy: Policy = self.planner if self.planner is not None else FixedPolicy(self.drafters)

    def _structured(self, config: GenerationConfig) -> Structured:
        """The grammar of a constrained generation, compiled and followed from its start over the
        target's vocabulary now (ConfigError before any decoding); imported only for one, so an
        unconstrained run never loads llguidance."""
        from localspec.decoding.grammar.steps import Structured

        assert config.constraint is not None
        return Structured(config.constraint, self.target, max(self.shape.n_nodes, 1))

    @property
    def constraint_satisfied(self) -> bool | None:
        """Whether the text so far is a complete answer of the constraint (None: no constraint)."""
        return None if self.structured is None else self.structured.satisfied

    def stats(self) -> GenerationStats:
        return self._counters.snapshot()

    @property
    def tokens(self) -> list[int]:
        """The committed tokens: the prompt and what was generated."""
        return self.state.tokens

    # ------------------------------------------------------------------ prompt

    def start(self, prompt: Sequence[int]) -> None:
        """Make the target KV hold the prompt, reusing what an earlier call left there (decoding
        alone on the model: see :meth:`start_steps`)."""
        run_alone(self.start_steps(prompt))

    def bind(self, slot: int) -> None:
        """Generate in the target's slot `slot` (and the draft model's): its own KV sequences."""
        self.state.bind(slot)
        for d in self.drafters:
            if isinstance(d, ModelDrafter):
                d.slot = slot

    def start_steps(self, prompt: Sequence[int]) -> Steps[None]:
        """The prompt into the target's KV (its decodes as requests: localspec.decoding.passes)."""
        check_prompt(prompt, self.target.n_ctx)
        self._counters = _Counters(prompt_tokens=len(prompt))
        self.finish_reason = None
        t0 = time.perf_counter()
        prefill = self.policy.prefill if self.drafters else _plain_prefill  # nothing drafts: nothing to measure
        self._counters.cached = yield from self.state.start(prompt, prefill)
        for d in self.drafters:
            d.start(prompt)
        self._counters.prompt_s = time.perf_counter() - t0
        self._counters.start = time.perf_counter()

    def finish(self) -> None:
        """The generation ended: what the planner learned goes into the cost profiles (for the
        next run, once their owner saves them). The caches' sequences are already true, so the
        next prompt reuses their shared prefix."""
        self.policy.finish()
        self.close()

    def close(self) -> None:
        """The grammar of a constrained generation stops following the target (also after an
        error; the generation that owns the engine calls it in any case)."""
        self.state.close()

    # ------------------------------------------------------------------ step

    def step(self) -> list[int]:
        """One speculative step, decoding alone on the model (see :meth:`steps`)."""
        return run_alone(self.steps())

    def steps(self, turn: Turn = ALONE) -> Steps[list[int]]:
        """One speculative step: draft → one target pass → C verify → commit, its decodes as
        requests (localspec.decoding.passes: the pair's scheduler puts other calls' in the same
        decodes; `turn`: the tokens they put in this step's target pass, which the policy prices,
        and the room left in it). Returns the newly generated tokens (accepted + the extra one),
        cut after an end-of-generation token and at max_tokens; sets finish_reason when done."""
        depth = self._depth(self.target.n_batch if turn.room is None else turn.room)
        if depth is None:
            self.finish_reason = self.finish_reason or "length"
            return []
        t0 = time.perf_counter()
        masks = self.state.new_step()
        draft = yield from self._draft(depth, masks, turn)
        t1 = time.perf_counter()
        first_row, decoded = yield from self.state.target_pass(draft)
        t2 = time.perf_counter()
        verdict = self._verify(draft, masks, first_row)
        t3 = time.perf_counter()
        new = self._emit(draft.tree.path_tokens(verdict.path) + [verdict.token])
        self.speculated = 0 if draft.certain else min(verdict.n_accepted, len(new))
        self.state.accept(draft, verdict.path, new)
        self._counters.step(draft.kind if draft.n else None, draft.n, verdict.n_accepted, (t1 - t0, t2 - t1, t3 - t2))
        if self.structured is not None:
            self._counters.constraint_s = self.structured.seconds
        if decoded is not None:  # a step that used the prefill's logits decoded nothing: no cost to learn
            self.policy.observe_step(draft, verdict.n_accepted, decoded.timed, new, decoded.tokens)
        else:
            self.policy.observe_step(draft, verdict.n_accepted, None, new)
        return new

    def _depth(self, n_batch: int) -> int | None:
        """The most levels this step may draft (localspec.decoding.depth.step_depth: the one place
        that cuts num_draft_tokens, for the context, max_tokens or the batch: `n_batch`, the
        tokens the target pass has room for; each cut step is counted by reason); None when the
        generation is over."""
        remaining = self._remaining()
        room = self.target.n_ctx - len(self.tokens)
        if self.finish_reason or remaining <= 0 or room < 0:
            return None
        depth, limit = step_depth(self.requested, remaining, room, n_batch)
        if limit is not None:
            self._counters.limits[limit] = self._counters.limits.get(limit, 0) + 1
        return depth

    def _draft(self, depth: int, masks: StepMasks | None, turn: Turn) -> Steps[Draft]:
        """The step's draft: the drafters' proposals of at most `depth` levels (a fixed one cut
        before the first token the grammar forbids), the one the policy picks, drafted at the
        depth it picks (at most what the proposal offers); in a round planned as a whole, at the
        depth the round's plan gives its offer."""
        if depth <= 0:
            return NO_DRAFT
        proposals: list[DraftProposal] = []
        for d in self.drafters:
            proposal = d.propose(self.tokens, depth)
            if masks is not None and proposal is not None and proposal.tokens:
                proposal = masks.cut(proposal)
            if proposal is not None and proposal.levels > 0:
                if proposal.levels > depth:  # a drafter's bug: the step's cap is the one place depth is cut
                    raise RuntimeError(f"{d.kind} drafter offered {proposal.levels} levels, asked for {depth}")
                proposals.append(proposal)
        picked = yield from self._pick(proposals, depth, turn)
        if picked is None:
            return NO_DRAFT
        proposal, levels = picked
        return (yield from resolve(proposal.drafter.draft(proposal, self.state, self.shape.truncated(levels),
                                                          self.sampling, self.rng,
                                                          self.config.verifier in WITHOUT_REPLACEMENT, masks)))

    def _pick(self, proposals: list[DraftProposal], depth: int, turn: Turn) -> Steps[tuple[DraftProposal, int] | None]:
        """The policy's pick; in a planned round (turn.planned), its offer sent to the round's plan
        (localspec.decoding.batch_plan) and the depth that comes back."""
        prompt_tokens, remaining = self._counters.prompt_tokens, self._remaining()
        if turn.planned and proposals:
            made = self.policy.offer(proposals, depth, prompt_tokens, remaining)
            if made is not None:
                proposal, offer = made
                levels = yield offer
                return (proposal, levels) if levels > 0 else None
        return self.policy.pick(proposals, depth, prompt_tokens, remaining, batch=turn.batch)

    def _verify(self, draft: Draft, masks: StepMasks | None, first_row: int) -> verifier.VerifyOutcome:
        """The configured verification of the step's draft, under the grammar's masks if any. A
        certain draft (a forced chain, decoded with the last row's logits only) has rows that each
        allow exactly its token (checked), so the masked target is certain of it and every rule
        accepts it with probability 1 (each verifier's equations with p = q = a point mass); the
        token after it is drawn from the last row under its mask, as after an empty draft."""
        tree = draft.tree
        rows = masks.verified_rows(tree, draft.certain) if masks is not None else None
        if draft.certain:
            v = verifier.verify(self.config.verifier, self.target.logits(1, first_row), None, [], [],
                                sampling=self.sampling,
                                seed=int(self.rng.integers(0, 2**63)), lenience=self.config.lenience,
                                masks=None if rows is None else rows[tree.n:tree.n + 1])
            return verifier.VerifyOutcome(tuple(range(tree.n)), v.token, tree.n)
        return verifier.verify(self.config.verifier, self.target.logits(tree.n + 1, first_row),
                               tree.probs if tree.n else None, tree.tokens, tree.parents,
                               sampling=self.sampling, seed=int(self.rng.integers(0, 2**63)),
                               lenience=self.config.lenience, masks=rows)

    def _emit(self, new: list[int]) -> list[int]:
        """The tokens up to the first end-of-generation token, counted as generated (the
        caches keep nothing past it)."""
        for i, tok in enumerate(new):
            if self.target.is_eog(tok):
                new = new[: i + 1]
                self.finish_reason = "stop"
                break
        self._counters.generated += len(new)
        if self.finish_reason is None and self._counters.generated >= self.config.max_tokens:
            self.finish_reason = "length"
        return new

    def _remaining(self) -> int:
        return self.config.max_tokens - self._counters.generated
