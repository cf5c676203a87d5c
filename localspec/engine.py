"""The speculative step loop.

Invariant between steps: every committed token but the last (the "root") is in the target's KV
cache as sequence 0. A step drafts a chain/paths/tree, runs ONE target decode over the root and
all draft nodes (branches as KV sequences sharing the prefix), lets the C verifier accept a path
and draw the extra token, and keeps exactly the accepted path in both KV caches.

The engine alone keeps the statistics of a generation (:meth:`Engine.stats`). It does no I/O:
what the planner learned goes into the cost profiles it was given, which their owner saves.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from localspec import verifier
from localspec.config import WITHOUT_REPLACEMENT, GenerationConfig
from localspec.drafters import Drafter
from localspec.errors import ConfigError, PromptError
from localspec.model import Model
from localspec.planner import PREFILL_WARM_UP, Planner
from localspec.profiles import Profiles
from localspec.tree import DraftTree

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
                "accept_histogram": list(self.accept_histogram), "verifier_share": self.verifier_share}


def combine(stats: Sequence[GenerationStats]) -> GenerationStats:
    """The statistics of several generations taken together (sums; histograms added bin by bin),
    so rates and shares of a session or a benchmark row come from the same properties."""
    hist = [0] * max((len(s.accept_histogram) for s in stats), default=0)
    for s in stats:
        for n, count in enumerate(s.accept_histogram):
            hist[n] += count
    return GenerationStats(
        sum(s.prompt_tokens for s in stats), sum(s.generated_tokens for s in stats),
        sum(s.target_passes for s in stats), sum(s.drafted_tokens for s in stats),
        sum(s.accepted_tokens for s in stats), sum(s.prompt_seconds for s in stats),
        sum(s.elapsed_seconds for s in stats), sum(s.draft_seconds for s in stats),
        sum(s.target_seconds for s in stats), sum(s.verify_seconds for s in stats), tuple(hist))


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

    def snapshot(self) -> GenerationStats:
        return GenerationStats(self.prompt_tokens, self.generated, self.passes, self.drafted,
                               self.accepted, self.prompt_s, time.perf_counter() - self.start,
                               self.draft_s, self.target_s, self.verify_s, tuple(self.hist))

    def step(self, drafted: int, accepted: int, seconds: tuple[float, float, float]) -> None:
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
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
        self.tokens: list[int] = []
        self.n_cached = 0  # committed tokens in the target KV (sequence 0)
        self.finish_reason: str | None = None  # "stop" (end of generation) or "length" once done
        self._counters = _Counters()
        self.planner = (Planner(target, self.shape, sampled=not self.sampling.greedy, profiles=profiles)
                        if config.plan == "auto" else None)

    def stats(self) -> GenerationStats:
        return self._counters.snapshot()

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
        common = self.target.reuse_prefix(prompt)
        self._prefill(list(prompt[common:-1]), common)
        for d in self.drafters:
            d.start(prompt)
        self._counters.prompt_s = time.perf_counter() - t0
        self._counters.start = time.perf_counter()
        self.tokens = list(prompt)
        self.n_cached = len(prompt) - 1

    def _prefill(self, tokens: list[int], start: int) -> None:
        """Decode the prompt into the target's cache. With the planner, chunks of the pass sizes
        whose cost is unknown are decoded as verification passes are (logits for every token) and
        timed: real work that measures the cost curve; the rest is timed as a prefill."""
        if self.planner is None or not self.drafters:
            self.target.prefill(tokens, start)
            return
        planner, i = self.planner, 0
        sizes = planner.sizes_to_measure(len(tokens) - PREFILL_WARM_UP)
        if sizes:  # warm up first, unmeasured; nothing to measure: one plain prefill, as the target alone does
            self.target.prefill(tokens[:PREFILL_WARM_UP], start)
            i = PREFILL_WARM_UP
        for n in sizes:
            t0 = time.perf_counter()
            self.target.decode(tokens[i: i + n], range(start + i, start + i + n), outputs="all")
            planner.target_cost.observe(n, time.perf_counter() - t0)
            i += n
        t0 = time.perf_counter()
        self.target.prefill(tokens[i:], start + i)
        planner.observe_prefill(planner.profile, len(tokens) - i, time.perf_counter() - t0)

    def finish(self) -> None:
        """Record what the KV caches hold, so the next prompt can reuse its shared prefix, and
        what the planner learned, in the cost profiles (for the next run, once their owner saves them)."""
        self.target.kv_tokens = self.tokens[: self.n_cached]
        for d in self.drafters:
            d.finish(self.tokens)
        if self.planner is not None:
            self.planner.record()

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
        tree, drafter, kind = self._draft(depth)
        t1 = time.perf_counter()
        branches = self._target_pass(tree)
        t2 = time.perf_counter()
        v = verifier.verify(self.config.verifier, self.target.logits(tree.n + 1),
                            tree.probs if tree.n else None, tree.tokens, tree.parents,
                            sampling=self.sampling, seed=int(self.rng.integers(0, 2**63)),
                            lenience=self.config.lenience)
        t3 = time.perf_counter()
        self.target.keep_branch(tree.branch_of(v.path), L0 + v.n_accepted, branches)
        if drafter is not None:
            drafter.commit(self.tokens, tree, v.path)
        new = tree.path_tokens(v.path) + [v.token]
        self.tokens.extend(new)
        self.n_cached = L0 + v.n_accepted
        c.step(tree.n, v.n_accepted, (t1 - t0, t2 - t1, t3 - t2))
        if self.planner is not None:
            self.planner.observe(kind, max(tree.depths, default=0), v.n_accepted, tree.n + 1, t2 - t1)
            if drafter is not None and drafter.source is not None:
                self.planner.observe_draft(drafter)
        return self._emit(new)

    def _emit(self, new: list[int]) -> list[int]:
        """The tokens up to the first end-of-generation token, counted as generated."""
        for i, tok in enumerate(new):
            if self.target.is_eog(tok):
                new = new[: i + 1]
                self.finish_reason = "stop"
                break
        self._counters.generated += len(new)
        if self.finish_reason is None and self._counters.generated >= self.config.max_tokens:
            self.finish_reason = "length"
        return new

    def _target_pass(self, tree: DraftTree) -> int:
        """ONE target decode over the root and every draft node (each root-to-leaf path a KV
        sequence sharing the prefix); returns the number of sequences used."""
        L0 = len(self.tokens)
        branches = max((s[-1] for s in tree.seqs), default=0) + 1
        for s in range(1, branches):
            self.target.seq_cp(0, s)
        self.target.decode([self.tokens[-1]] + tree.tokens,
                           [L0 - 1] + [L0 - 1 + d for d in tree.depths],
                           [tuple(range(branches))] + tree.seqs, outputs="all")
        return branches

    def _draft(self, depth: int) -> tuple[DraftTree, Drafter | None, str | None]:
        """The step's draft, the drafter that made it and the acceptance kind of its proposal.
        With the planner: the drafter with the best predicted rate, at its best depth (none when
        no drafter beats the target alone). Without (plan fixed): the first drafter that proposes
        at least MIN_PROPOSAL tokens (the last one's proposal is always taken)."""
        if depth <= 0:
            return DraftTree(), None, None
        choice: tuple[float, int, Drafter, str] | None = None
        for i, d in enumerate(self.drafters):
            kind, available = d.plan(self.tokens, depth)
            available = min(available, depth)
            if available <= 0:
                continue
            if self.planner is None:
                if i == len(self.drafters) - 1 or available >= min(MIN_PROPOSAL, depth):
                    choice = (0.0, available, d, kind)
                    break
                continue
            if not d.loaded and not self.planner.worth_loading(d, self._counters.prompt_tokens, self._remaining()):
                continue
            planned, rate = self.planner.choose(d, kind, available, d.lag(self.tokens))
            if planned > 0 and (choice is None or rate > choice[0]):
                choice = (rate, planned, d, kind)
        if choice is None:
            return DraftTree(), None, None
        _, planned, drafter, kind = choice
        tree = drafter.draft(self.tokens, self.shape.truncated(planned), self.sampling, self.rng,
                             self.config.verifier in WITHOUT_REPLACEMENT)
        return (tree, drafter, kind) if tree.n else (DraftTree(), None, None)

    def _remaining(self) -> int:
        return self.config.max_tokens - self._counters.generated

    def score(self, methods: Sequence[tuple[str, int | None]], draws: int) -> list[float]:
        """Tokens per target pass of several verifiers on ONE draft of the full shape from the
        current context, committing nothing (paired verifier comparisons, benchmarks/).

        Each (verifier, branch) verifies the whole draft (branch None) or only the chain that
        ends in that leaf branch; each runs `draws` times with the same seeds, and its value is
        the mean of accepted tokens + 1 over the draws."""
        if draws < 1:
            raise ConfigError(f"draws must be >= 1, got {draws}", "draws")
        if not self.drafters or len(self.tokens) + self.shape.n_nodes > self.target.n_ctx:
            raise ConfigError("score needs a drafter and room for the whole draft in the context")
        drafter = self.drafters[-1]
        L0 = len(self.tokens)
        tree = drafter.draft(self.tokens, self.shape, self.sampling, self.rng,
                             self.config.verifier in WITHOUT_REPLACEMENT)
        branches = self._target_pass(tree)
        logits = self.target.logits_array(tree.n + 1)
        seeds = [int(s) for s in self.rng.integers(0, 2**63, size=draws)]
        values = []
        for method, branch in methods:
            nodes = list(range(tree.n)) if branch is None else tree.chain_nodes(branch)
            index = {j: i for i, j in enumerate(nodes)}
            rows = [0] + [j + 1 for j in nodes]
            target_rows, draft_rows = np.ascontiguousarray(logits[rows]), np.ascontiguousarray(tree.probs[rows])
            tokens, parents = tree.path_tokens(tuple(nodes)), [index.get(tree.parents[j], -1) for j in nodes]
            total = sum(verifier.verify(method, target_rows, draft_rows if nodes else None, tokens, parents,
                                        sampling=self.sampling, seed=s).n_accepted + 1 for s in seeds)
            values.append(total / draws)
        self.target.keep_branch(0, L0 - 1, branches)
        if tree.n:
            drafter.commit(self.tokens, tree, ())
        return values
