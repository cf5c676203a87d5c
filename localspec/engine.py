"""The speculative step loop.

Invariant between steps: every committed token but the last (the "root") is in the target's KV
cache as sequence 0. A step drafts a chain/paths/tree, runs ONE target decode over the root and
all draft nodes (branches as KV sequences sharing the prefix), lets the C verifier accept a path
and draw the extra token, and keeps exactly the accepted path in both KV caches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from localspec import verifier
from localspec.drafters import Drafter, HybridDrafter, ModelDrafter, SamplingSettings, keep_branch
from localspec.model import Model, ModelError
from localspec.planner import Planner
from localspec.tree import DraftTree, Shape

log = logging.getLogger(__name__)

CHAIN_ONLY = {"token", "block"}
CHAINS = {"gbv", "batch"}  # K root-to-leaf chains
WITHOUT_REPLACEMENT = {"rrsw", "traversal"}
PLANS = ("auto", "fixed")


class ConfigError(ValueError):
    """An impossible combination of speculative settings."""


@dataclass(frozen=True)
class SpecConfig:
    """What to draft and how to verify it."""

    verifier: str = "block"
    num_draft_tokens: int = 4
    paths: int = 1
    tree: tuple[int, ...] | None = None
    lenience: float = 0.0
    plan: str = "auto"  # auto: choose the draft depth (or none) per step from measured costs; fixed

    def shape(self) -> Shape:
        if self.tree:
            return Shape.tree(tuple(self.tree))
        return Shape.k_paths(self.paths, self.num_draft_tokens)

    def validate(self, drafter: str | None, n_batch: int) -> None:
        if self.plan not in PLANS:
            raise ConfigError(f"plan must be one of {', '.join(PLANS)}, got {self.plan!r}")
        if self.verifier not in verifier.METHODS:
            raise ConfigError(f"unknown verifier {self.verifier!r}; choose one of {', '.join(verifier.METHODS)}")
        if self.num_draft_tokens < 0 or self.num_draft_tokens > 64:
            raise ConfigError(f"num_draft_tokens must lie in [0, 64], got {self.num_draft_tokens}")
        if not 1 <= self.paths <= 16:
            raise ConfigError(f"paths must lie in [1, 16], got {self.paths}")
        if self.tree is not None and (not self.tree or any(b < 1 or b > 16 for b in self.tree)):
            raise ConfigError(f"tree branching factors must lie in [1, 16], got {self.tree}")
        if self.tree and self.paths > 1:
            raise ConfigError("use either paths or tree, not both")
        shape = self.shape()
        if shape.n_leaves > 64 or shape.n_nodes + 1 > n_batch:
            raise ConfigError(f"draft {shape.describe()} has {shape.n_nodes} nodes and {shape.n_leaves} "
                              f"branches; at most 64 branches and n_batch-1 = {n_batch - 1} nodes fit")
        if self.lenience < 0 or (self.lenience > 0 and self.verifier != "token"):
            raise ConfigError("lenience (lossy over-acceptance) must be >= 0 and needs verifier 'token'")
        branched = not shape.is_chain
        if branched and self.verifier in CHAIN_ONLY:
            raise ConfigError(f"verifier {self.verifier!r} verifies one chain; use gbv/batch with paths, "
                              "rrs/rrsw/traversal with a tree")
        if self.tree and self.verifier in CHAINS:
            raise ConfigError(f"verifier {self.verifier!r} takes K paths (--paths), not a tree")
        if self.paths > 1 and self.verifier in WITHOUT_REPLACEMENT:
            raise ConfigError(f"verifier {self.verifier!r} needs a tree drawn without replacement (--tree), "
                              "not independent paths")
        if drafter == "ngram" and branched:
            raise ConfigError("the n-gram drafter proposes a single chain; use --drafter model or hybrid "
                              "for paths and trees")


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


class Engine:
    """Speculative decoding of one target with an optional drafter (None: target alone)."""

    def __init__(self, target: Model, drafter: Drafter | None, spec: SpecConfig,
                 sampling: SamplingSettings, seed: int | None = None) -> None:
        spec.validate(drafter.name if drafter else None, target.n_batch)
        if spec.shape().n_leaves > target.options.n_seq_max:
            raise ConfigError(f"the draft has {spec.shape().n_leaves} branches but the target context "
                              f"holds {target.options.n_seq_max} sequences")
        verifier.check_sampling(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
        self.target = target
        self.drafter = drafter
        self.spec = spec
        self.shape = spec.shape()
        self.sampling = sampling
        self.rng = np.random.default_rng(seed)
        self.tokens: list[int] = []
        self.n_cached = 0  # committed tokens in the target KV (sequence 0)
        self.counters = _Counters()
        self.planner = self._planner() if spec.plan == "auto" else None

    def _planner(self) -> Planner | None:
        if self.drafter is None:
            return None
        d = self.drafter
        model = d.model_drafter.model if isinstance(d, HybridDrafter) else (
            d.model if isinstance(d, ModelDrafter) else None)
        return Planner(self.target, model, self.shape)

    # ------------------------------------------------------------------ prompt

    def start(self, prompt: Sequence[int]) -> None:
        """Make the target KV hold prompt[:-1], reusing what an earlier call left there."""
        if not prompt:
            raise ModelError("the prompt is empty (no tokens to condition on)")
        if len(prompt) >= self.target.n_ctx:
            raise ModelError(f"the prompt has {len(prompt)} tokens but the context holds {self.target.n_ctx}; "
                             "shorten the prompt or raise --ctx-size")
        self.counters = _Counters(prompt_tokens=len(prompt))
        t0 = time.perf_counter()
        common = self.target.reuse_prefix(prompt)
        self.target.prefill(list(prompt[common:-1]), common)
        if self.drafter is not None:
            self.drafter.start(prompt)
        self.counters.prompt_s = time.perf_counter() - t0
        self.counters.start = time.perf_counter()
        self.tokens = list(prompt)
        self.n_cached = len(prompt) - 1

    def finish(self) -> None:
        """Record what the KV caches hold, so the next prompt can reuse its shared prefix."""
        self.target.kv_tokens = self.tokens[: self.n_cached]
        if self.drafter is not None:
            self.drafter.finish(self.tokens)

    # ------------------------------------------------------------------ step

    def room(self) -> int:
        """Draft depth the context still has room for (-1: not even the root fits)."""
        return self.target.n_ctx - len(self.tokens)

    def step(self, depth_limit: int) -> list[int]:
        """One speculative step; returns the newly committed tokens (accepted + extra)."""
        c = self.counters
        L0 = len(self.tokens)
        depth = min(self.shape.depth, depth_limit, self.room())
        while depth > 0 and L0 + self.shape.truncated(depth).n_nodes > self.target.n_ctx:
            depth -= 1  # every node of a tree takes a KV cell
        t0 = time.perf_counter()
        tree, kind = self._draft(depth)
        t1 = time.perf_counter()
        branches = self._target_pass(tree)
        t2 = time.perf_counter()
        v = verifier.verify(self.spec.verifier, self.target.logits(tree.n + 1),
                            tree.probs if tree.n else None, tree.tokens, tree.parents,
                            seed=int(self.rng.integers(0, 2**63)), lenience=self.spec.lenience,
                            **self.sampling.kwargs())
        t3 = time.perf_counter()
        keep_branch(self.target, tree.branch_of(v.path), L0 + v.n_accepted, branches)
        if self.drafter is not None and tree.n:
            self.drafter.commit(self.tokens, tree, v.path)
        new = tree.path_tokens(v.path) + [v.token]
        self.tokens.extend(new)
        self.n_cached = L0 + v.n_accepted
        c.passes += 1
        c.drafted += tree.n
        c.accepted += v.n_accepted
        if tree.n:
            while len(c.hist) <= v.n_accepted:
                c.hist.append(0)
            c.hist[v.n_accepted] += 1
        c.draft_s += t1 - t0
        c.target_s += t2 - t1
        c.verify_s += t3 - t2
        if self.planner is not None:
            self.planner.observe(kind, max(tree.depths, default=0), v.n_accepted, tree.n + 1, t2 - t1, t1 - t0)
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

    def score(self, methods: Sequence[tuple[str, int | None]], draws: int) -> list[float]:
        """Tokens per target pass of several verifiers on ONE draft of the full shape from the
        current context, committing nothing (paired verifier comparisons, benchmarks/).

        Each (verifier, branch) verifies the whole draft (branch None) or only the chain that
        ends in that leaf branch; each runs `draws` times with the same seeds, and its value is
        the mean of accepted tokens + 1 over the draws."""
        if draws < 1:
            raise ConfigError(f"draws must be >= 1, got {draws}")
        if self.drafter is None or len(self.tokens) + self.shape.n_nodes > self.target.n_ctx:
            raise ConfigError("score needs a drafter and room for the whole draft in the context")
        L0 = len(self.tokens)
        tree = self.drafter.draft(self.tokens, self.shape, self.sampling, self.rng,
                                  self.spec.verifier in WITHOUT_REPLACEMENT)
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
                                        seed=s, **self.sampling.kwargs()).n_accepted + 1 for s in seeds)
            values.append(total / draws)
        keep_branch(self.target, 0, L0 - 1, branches)
        if tree.n:
            self.drafter.commit(self.tokens, tree, ())
        return values

    def _draft(self, depth: int) -> tuple[DraftTree, str | None]:
        """The step's draft and which drafter made it (None: no draft)."""
        d = self.drafter
        if d is None or depth <= 0:
            return DraftTree(), None
        without = self.spec.verifier in WITHOUT_REPLACEMENT
        if self.planner is None:
            tree = d.draft(self.tokens, self.shape.truncated(depth), self.sampling, self.rng, without)
            return tree, (d.last if isinstance(d, HybridDrafter) else d.name) if tree.n else None
        if isinstance(d, HybridDrafter):
            ngram = self.shape.truncated(self.planner.depth("ngram", depth))
            model = self.shape.truncated(self.planner.depth("model", depth))
            tree = d.draft_shapes(self.tokens, ngram, model, self.sampling, self.rng, without)
            return tree, d.last if tree.n else None
        planned = self.planner.depth(d.name, depth)
        if planned <= 0:
            return DraftTree(), None
        tree = d.draft(self.tokens, self.shape.truncated(planned), self.sampling, self.rng, without)
        return tree, d.name if tree.n else None


