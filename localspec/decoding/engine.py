"""The speculative step loop.

Invariant between steps: every committed token but the last (the "root") is in the target's KV
cache as sequence 0; the target's :class:`~localspec.llama.sequence.KVSequence` (``target.sequence``)
holds the committed tokens and says so. A step asks each drafter for a proposal, drafts a
chain/paths/tree from the chosen one, runs ONE target decode over the root and all draft nodes
(branches as KV sequences sharing the prefix), lets the C verifier accept a path and draw the
extra token, commits the new tokens and keeps exactly the accepted path in both KV caches.

The engine alone keeps the statistics of a generation (:meth:`Engine.stats`). It does no I/O:
what the planner learned goes into the cost profiles it was given, which their owner saves.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from localspec.verify import verifier
from localspec.config import WITHOUT_REPLACEMENT, GenerationConfig
from localspec.decoding.drafters import DraftProposal, Drafter, ForcedDrafter, ModelDrafter
from localspec.errors import PromptError
from localspec.llama.model import Model
from localspec.decoding.planner import PREFILL_WARM_UP, Planner
from localspec.decoding.profiles import Profiles
from localspec.decoding.tree import DraftTree

if TYPE_CHECKING:
    from localspec.decoding.structured import Structured

log = logging.getLogger(__name__)

MIN_PROPOSAL = 2  # a drafter followed by another is used when it proposes at least this many tokens


@dataclass(frozen=True)
class GenerationStats:
    """Running statistics of one generation (a snapshot)."""

    prompt_tokens: int
    generated_tokens: int
    target_passes: int
    drafted_tokens: int
    accepted_tokens: int
    prompt_seconds: float
    elapsed_seconds: float
    draft_seconds: float
    target_seconds: float
    verify_seconds: float
    accept_histogram: tuple[int, ...]
    # tokens accepted per kind of draft ("forced", "ngram:…", "model:…"), sorted by kind
    accepted_by_kind: tuple[tuple[str, int], ...] = ()
    constraint_seconds: float = 0.0  # in the grammar: masks, forced tokens, following the committed tokens
    cached_tokens: int = 0  # prompt tokens the KV cache held already (an earlier prompt's, or restored)

    @property
    def block_efficiency(self) -> float:
        """Generated tokens per target forward pass (the papers' metric)."""
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def verifier_share(self) -> float:
        busy = self.draft_seconds + self.target_seconds + self.verify_seconds
        return self.verify_seconds / busy if busy > 0 else 0.0

    def as_dict(self) -> dict:
        """The statistics programs read (the CLI's --json `stats`, the server's `speculative`)."""
        return {"generated_tokens": self.generated_tokens, "tokens_per_second": self.tokens_per_second,
                "elapsed_seconds": self.elapsed_seconds, "block_efficiency": self.block_efficiency,
                "acceptance_rate": self.acceptance_rate, "target_passes": self.target_passes,
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "accept_histogram": list(self.accept_histogram), "verifier_share": self.verifier_share,
                "accepted_by_kind": dict(self.accepted_by_kind), "constraint_seconds": self.constraint_seconds,
                "cached_tokens": self.cached_tokens}


def combine(stats: Sequence[GenerationStats]) -> GenerationStats:
    """The statistics of several generations taken together (sums; histograms added bin by bin),
    so rates and shares of a session or a benchmark row come from the same properties."""
    hist = [0] * max((len(s.accept_histogram) for s in stats), default=0)
    by_kind: dict[str, int] = {}
    for s in stats:
        for n, count in enumerate(s.accept_histogram):
            hist[n] += count
        for kind, count in s.accepted_by_kind:
            by_kind[kind] = by_kind.get(kind, 0) + count
    return GenerationStats(
        sum(s.prompt_tokens for s in stats), sum(s.generated_tokens for s in stats),
        sum(s.target_passes for s in stats), sum(s.drafted_tokens for s in stats),
        sum(s.accepted_tokens for s in stats), sum(s.prompt_seconds for s in stats),
        sum(s.elapsed_seconds for s in stats), sum(s.draft_seconds for s in stats),
        sum(s.target_seconds for s in stats), sum(s.verify_seconds for s in stats), tuple(hist),
        tuple(sorted(by_kind.items())), sum(s.constraint_seconds for s in stats),
        sum(s.cached_tokens for s in stats))


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

    def snapshot(self) -> GenerationStats:
        return GenerationStats(self.prompt_tokens, self.generated, self.passes, self.drafted,
                               self.accepted, self.prompt_s, time.perf_counter() - self.start,
                               self.draft_s, self.target_s, self.verify_s, tuple(self.hist),
                               tuple(sorted(self.by_kind.items())), self.constraint_s, self.cached)

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


class Engine:
    """Speculative decoding of one target with drafters tried in order (none: the target alone)."""

    def __init__(self, target: Model, drafters: Sequence[Drafter], config: GenerationConfig,
                 profiles: Profiles | None = None) -> None:
        if drafters:
            config = config.fitted(target.n_batch, target.options.n_seq_max)
        self.target = target
        self.drafters = list(drafters)
        self.config = config
        self.shape = config.shape if drafters else config.shape.truncated(0)
        self.sampling = config.sampling
        self.rng = np.random.default_rng(config.seed)
        self.sequence = target.sequence  # the committed tokens, and what the target's cache holds
        self.finish_reason: str | None = None  # "stop" (end of generation) or "length" once done
        self._counters = _Counters()
        self.planner = (Planner(target, self.shape, sampled=not self.sampling.greedy, profiles=profiles)
                        if config.plan == "auto" else None)
        self.structured = self._structured(config) if config.constraint is not None else None

    def _structured(self, config: GenerationConfig) -> "Structured":
        """The grammar of a constrained generation, compiled and followed from its start over the
        target's vocabulary now (ConfigError before any decoding); imported only for one, so an
        unconstrained run never loads llguidance."""
        from localspec.decoding.structured import Structured

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
        return self.sequence.tokens

    # ------------------------------------------------------------------ prompt

    def start(self, prompt: Sequence[int]) -> None:
        """Make the target KV hold prompt[:-1], reusing what an earlier call left there."""
        if not prompt:
            raise PromptError("the prompt is empty (no tokens to condition on)")
        if len(prompt) >= self.target.n_ctx:
            raise PromptError(f"the prompt has {len(prompt)} tokens but the context holds {self.target.n_ctx}; "
                             "shorten the prompt or raise --ctx-size")
        self._counters = _Counters(prompt_tokens=len(prompt))
        self.finish_reason = None
        t0 = time.perf_counter()
        self._counters.cached = self.sequence.start(prompt)  # keeps the prefix the cache shares with this prompt
        self._prefill(len(prompt) - 1)
        if self.structured is not None:
            self.structured.attach(prompt, [d for d in self.drafters if isinstance(d, ForcedDrafter)])
        for d in self.drafters:
            d.start(prompt)
        self._counters.prompt_s = time.perf_counter() - t0
        self._counters.start = time.perf_counter()

    def _prefill(self, upto: int) -> None:
        """Decode the prompt into the target's cache up to `upto`. With the planner, chunks of the
        pass sizes whose cost is unknown are decoded as verification passes are (logits for every
        token) and timed: real work that measures the cost curve; the rest is timed as a prefill."""
        seq = self.sequence
        if self.planner is None or not self.drafters:
            seq.fill(upto)
            return
        planner = self.planner
        sizes = planner.sizes_to_measure(upto - seq.n_cached - PREFILL_WARM_UP)
        if sizes:  # warm up first, unmeasured; nothing to measure: one plain prefill, as the target alone does
            seq.fill(seq.n_cached + PREFILL_WARM_UP)
        for n in sizes:
            t0 = time.perf_counter()
            seq.fill(seq.n_cached + n, outputs="all")
            planner.target_cost.observe(n, time.perf_counter() - t0)
        rest, t0 = upto - seq.n_cached, time.perf_counter()
        seq.fill(upto)
        planner.observe_prefill(planner.profile, rest, time.perf_counter() - t0)

    def finish(self) -> None:
        """The generation ended: what the planner learned goes into the cost profiles (for the
        next run, once their owner saves them). The caches' sequences are already true, so the
        next prompt reuses their shared prefix."""
        if self.planner is not None:
            self.planner.record()
        self.close()

    def close(self) -> None:
        """The grammar of a constrained generation stops following the target (also after an
        error; the generation that owns the engine calls it in any case)."""
        if self.structured is not None:
            self.structured.detach()

    # ------------------------------------------------------------------ step

    def room(self) -> int:
        """Draft depth the context still has room for (-1: not even the root fits)."""
        return self.target.n_ctx - len(self.tokens)

    def step(self) -> list[int]:
        """One speculative step. Returns the newly generated tokens (accepted + the extra one), cut
        after an end-of-generation token and at max_tokens; sets finish_reason when done."""
        c = self._counters
        remaining = self.config.max_tokens - c.generated
        if self.finish_reason or remaining <= 0 or self.room() < 0:
            self.finish_reason = self.finish_reason or "length"
            return []
        L0 = len(self.tokens)
        depth = min(self.shape.depth, remaining - 1, self.room())
        while depth > 0 and L0 + self.shape.truncated(depth).n_nodes > self.target.n_ctx:
            depth -= 1  # every node of a tree takes a KV cell
        t0 = time.perf_counter()
        tree, proposal = self._draft(depth)
        forced = tree.n > 0 and proposal is not None and isinstance(proposal.drafter, ForcedDrafter)
        t1 = time.perf_counter()
        self._target_pass(tree, outputs="last" if forced else "all")
        t2 = time.perf_counter()
        v = self._verify_forced(tree) if forced else self._verify(tree)
        t3 = time.perf_counter()
        new = self._emit(tree.path_tokens(v.path) + [v.token])
        self.sequence.commit(new)
        self.sequence.keep_branch(tree.branch_of(v.path), L0 + v.n_accepted)
        if proposal is not None:
            proposal.drafter.commit(tree, v.path, new)
        kind = proposal.kind if proposal is not None and tree.n else None
        c.step(kind, tree.n, v.n_accepted, (t1 - t0, t2 - t1, t3 - t2))
        if self.structured is not None:
            c.constraint_s = self.structured.seconds
        if self.planner is not None:
            self.planner.observe(kind, max(tree.depths, default=0), v.n_accepted, tree.n + 1,
                                 None if forced else t2 - t1)
            if proposal is not None and isinstance(proposal.drafter, ModelDrafter):
                self.planner.observe_draft(proposal.drafter)
        return new

    def _verify(self, tree: DraftTree) -> verifier.Verdict:
        """The configured verification of the step's draft (under the grammar's masks, if any)."""
        masks = self.structured.rows(tree, forced=False) if self.structured is not None else None
        return verifier.verify(self.config.verifier, self.target.logits(tree.n + 1),
                               tree.probs if tree.n else None, tree.tokens, tree.parents,
                               sampling=self.sampling, seed=int(self.rng.integers(0, 2**63)),
                               lenience=self.config.lenience, masks=masks)

    def _verify_forced(self, tree: DraftTree) -> verifier.Verdict:
        """A chain of forced tokens, decoded with the last row's logits only. Each row before the
        last allows exactly its token (checked), so the masked target is certain of it and every
        rule accepts it with probability 1 (eqs. of each verifier with p = q = a point mass); the
        token after the chain is drawn from the last row under its mask, as with an empty draft."""
        assert self.structured is not None
        rows = self.structured.rows(tree, forced=True)
        v = verifier.verify(self.config.verifier, self.target.logits(1), None, [], [], sampling=self.sampling,
                            seed=int(self.rng.integers(0, 2**63)), lenience=self.config.lenience,
                            masks=rows[tree.n:tree.n + 1])
        return verifier.Verdict(tuple(range(tree.n)), v.token, tree.n)

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

    def _target_pass(self, tree: DraftTree, outputs: str = "all") -> None:
        """ONE target decode over the root and every draft node (each root-to-leaf path a KV
        sequence sharing the prefix); `outputs` "last": only the last node's logits row."""
        L0 = len(self.tokens)
        branches = max((s[-1] for s in tree.seqs), default=0) + 1
        self.sequence.fork(branches)
        self.sequence.decode([self.tokens[-1]] + tree.tokens, [L0 - 1] + [L0 - 1 + d for d in tree.depths],
                             [tuple(range(branches))] + tree.seqs, outputs=outputs)

    def _draft(self, depth: int) -> tuple[DraftTree, DraftProposal | None]:
        """The step's draft and the proposal it was made from (None: nothing drafted).
        With the planner: the proposal with the best predicted rate, at its best depth (none when
        no drafter beats the target alone). Without (plan fixed): the first drafter that proposes
        at least MIN_PROPOSAL tokens (the last one's proposal is always taken)."""
        structured = self.structured
        if structured is not None:
            assert structured.masks is not None
            structured.masks.begin()
        if depth <= 0:
            return DraftTree(), None
        choice: tuple[float, int, DraftProposal] | None = None
        for i, d in enumerate(self.drafters):
            proposal = d.propose(self.tokens, depth)
            if structured is not None and proposal is not None and proposal.tokens:
                proposal = structured.cut(proposal)  # a fixed draft ends before its first forbidden token
            available = min(proposal.levels, depth) if proposal is not None else 0
            if proposal is None or available <= 0:
                continue
            if self.planner is None:
                if i == len(self.drafters) - 1 or available >= min(MIN_PROPOSAL, depth):
                    choice = (0.0, available, proposal)
                    break
                continue
            if not d.loaded and not self.planner.worth_loading(d, self._counters.prompt_tokens, self._remaining()):
                continue
            planned, rate = self.planner.choose(d, proposal.kind, available, proposal.lag)
            if planned > 0 and (choice is None or rate > choice[0]):
                choice = (rate, planned, proposal)
        if choice is None:
            return DraftTree(), None
        _, planned, proposal = choice
        tree = proposal.drafter.draft(proposal, self.tokens, self.shape.truncated(planned), self.sampling, self.rng,
                                      self.config.verifier in WITHOUT_REPLACEMENT,
                                      None if structured is None else structured.masks)
        return tree, proposal

    def _remaining(self) -> int:
        return self.config.max_tokens - self._counters.generated
