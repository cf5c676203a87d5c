"""Paired block-efficiency comparison of verifiers: the same contexts, the same drafts.

Block efficiency (tokens per target pass) of one verifier measured by running it alone is noisy:
every run samples different text, so two verifiers are compared on different contexts and
different drafts, and ~100 target passes give a standard error near 4 % on their ratio. Here
every verifier of a :class:`Group` is run on the SAME draft (chains are cut out of a K-path
draft for token/block, GBV takes all K paths; RRSw and traversal share one tree) at the SAME
contexts, which are prefixes of text the target generated alone, so the ratio's noise comes only
from the verifiers themselves and a paired bootstrap over contexts gives its confidence interval.

The estimand is the mean over target-distributed contexts of E[accepted + 1 | context], the
papers' block efficiency E[τ + 1] (GBV paper, Sec. 3; traversal paper, Sec. 4) averaged over
contexts instead of weighted by where a speculative run happens to stop.

Benchmark code (benchmarks/decode/head_to_head.py uses it): it drives the engine's pieces directly
(:func:`score`), which no user-facing path needs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from localspec.decoding.engine import Engine
from localspec.decoding.passes import resolve, run_alone
from localspec.decoding.tree import DraftTree
from localspec.errors import ConfigError
from localspec.llama.model import Model
from localspec.settings.generation import WITHOUT_REPLACEMENT, GenerationConfig
from localspec.settings.sampling import SamplingParams
from localspec.settings.shape import Shape
from localspec.verify import verifier

log = logging.getLogger(__name__)

PLAIN_T1 = SamplingParams()  # the papers' setting: temperature 1, no truncation


@dataclass(frozen=True)
class Method:
    label: str
    verifier: str
    branch: int | None = None  # verify only the chain ending in this leaf branch (None: all)


@dataclass(frozen=True)
class Group:
    """One draft shape (its config) and the verifiers scored on each of its drafts."""

    config: GenerationConfig
    methods: tuple[Method, ...]


def default_groups(gamma: int = 8, paths: int = 3,
                   trees: Sequence[tuple[int, ...]] = ((3, 2, 1, 1, 1, 1, 1, 1), (2, 2, 2, 2))) -> list[Group]:
    """token and block on path 0 of a K-path draft, GBV on all K; RRSw and traversal per tree."""
    groups = [Group(GenerationConfig(verifier="gbv", shape=Shape.k_paths(paths, gamma), plan="fixed"),
                    (Method(f"token k{gamma}", "token", 0), Method(f"block k{gamma}", "block", 0),
                     Method(f"gbv K={paths} k{gamma}", "gbv")))]
    for tree in trees:
        name = "x".join(map(str, tree))
        groups.append(Group(GenerationConfig(verifier="traversal", shape=Shape.tree(tree), plan="fixed"),
                            (Method(f"rrsw tree {name}", "rrsw"), Method(f"traversal tree {name}", "traversal"))))
    return groups


def target_contexts(target: Model, prompts: Sequence[Sequence[int]], tokens: int, seeds: Sequence[int],
                    stride: int, sampling: SamplingParams = PLAIN_T1) -> list[list[int]]:
    """Prefixes (every `stride` tokens) of continuations the target samples alone from each prompt."""
    from localspec.api import stream_generate

    if stride < 1 or tokens < 1:
        raise ValueError(f"tokens and stride must be >= 1, got {tokens} and {stride}")
    out: list[list[int]] = []
    for prompt in prompts:
        for seed in seeds:
            config = GenerationConfig(max_tokens=tokens, seed=seed, sampling=sampling)
            cont = [r.token for r in stream_generate(target, None, list(prompt), config) if r.token is not None]
            out += [list(prompt) + cont[:i] for i in range(0, len(cont), stride)]
    return out


def paired_scores(target: Model, draft: Model, contexts: Sequence[Sequence[int]], groups: Sequence[Group],
                  draws: int = 16, sampling: SamplingParams = PLAIN_T1, seed: int = 0,
                  progress: bool = False) -> dict[str, np.ndarray]:
    """Per method label, its tokens per target pass at each context (one draft per group and context)."""
    from tqdm import tqdm

    from localspec.decoding.drafters import make_drafters

    scores: dict[str, list[float]] = {}
    bar = tqdm(total=len(groups) * len(contexts), file=sys.stderr, disable=not progress, unit="draft",
               desc="paired efficiency", leave=False)
    for g, group in enumerate(groups):
        config = replace(group.config, sampling=sampling, seed=seed + g)
        engine = Engine(target, make_drafters(target, draft, replace(config, drafter="model")), config)
        for ctx in contexts:
            engine.start(ctx)
            values = score(engine, [(m.verifier, m.branch) for m in group.methods], draws)
            engine.finish()
            for m, v in zip(group.methods, values, strict=True):
                scores.setdefault(m.label, []).append(v)
            bar.update()
    bar.close()
    return {label: np.asarray(v) for label, v in scores.items()}


def score(engine: Engine, methods: Sequence[tuple[str, int | None]], draws: int) -> list[float]:
    """Tokens per target pass of several verifiers on ONE draft of the full shape from the
    engine's current context, committing nothing.

    Each (verifier, branch) verifies the whole draft (branch None) or only the chain that ends in
    that leaf branch; each runs `draws` times with the same seeds, and its value is the mean of
    accepted tokens + 1 over the draws."""
    if draws < 1:
        raise ConfigError(f"draws must be >= 1, got {draws}", "draws")
    if not engine.drafters or len(engine.tokens) + engine.shape.n_nodes > engine.target.n_ctx:
        raise ConfigError("score needs a drafter and room for the whole draft in the context")
    drafter, context = engine.drafters[-1], engine.tokens
    proposal = drafter.propose(context, engine.shape.depth)
    if proposal is None:
        raise ConfigError("the last drafter proposes nothing here; score needs a draft model's drafter")
    L0 = len(context)
    draft = run_alone(resolve(drafter.draft(proposal, engine.state, engine.shape, engine.sampling, engine.rng,
                                            engine.config.verifier in WITHOUT_REPLACEMENT)))
    tree = draft.tree
    assert tree.probs is not None  # a drafter's tree carries the rows it was drawn from
    first_row, _ = run_alone(engine.state.target_pass(draft))
    logits = engine.target.logits_array(tree.n + 1, first_row)
    seeds = [int(s) for s in engine.rng.integers(0, 2**63, size=draws)]
    values = []
    for method, branch in methods:
        nodes = list(range(tree.n)) if branch is None else chain_nodes(tree, branch)
        index = {j: i for i, j in enumerate(nodes)}
        rows = [0] + [j + 1 for j in nodes]
        target_rows, draft_rows = np.ascontiguousarray(logits[rows]), np.ascontiguousarray(tree.probs[rows])
        tokens, parents = tree.path_tokens(tuple(nodes)), [index.get(tree.parents[j], -1) for j in nodes]
        total = sum(verifier.verify(method, target_rows, draft_rows if nodes else None, tokens, parents,
                                    sampling=engine.sampling, seed=s).n_accepted + 1 for s in seeds)
        values.append(total / draws)
    engine.state.target.keep_branch(0, L0 - 1)  # nothing committed: the root stays out of the cache
    draft_seq = engine.state.draft_sequence()
    if draft_seq is not None:  # the draft keeps the context it caught up on, none of its draft
        draft_seq.keep_branch(0, L0)
    return values


def chain_nodes(tree: DraftTree, branch: int) -> list[int]:
    """The nodes on the root-to-leaf path of KV sequence `branch`, root side first."""
    return [j for j, seqs in enumerate(tree.seqs) if branch in seqs]


@dataclass(frozen=True)
class Ratio:
    value: float  # mean(numerator) / mean(denominator)
    low: float  # 95 % paired-bootstrap interval over contexts
    high: float


def paired_ratio(numerator: np.ndarray, denominator: np.ndarray, resamples: int = 4000,
                 seed: int = 0) -> Ratio:
    """Ratio of means with a paired percentile-bootstrap 95 % interval (contexts resampled together).
    It treats contexts as independent; prefixes of one sampled text are correlated, so the interval
    is somewhat too narrow when contexts are taken close together."""
    if numerator.shape != denominator.shape or numerator.size == 0:
        raise ValueError("paired_ratio needs two equally long, non-empty score arrays")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, numerator.size, size=(resamples, numerator.size))
    boot = numerator[idx].mean(axis=1) / denominator[idx].mean(axis=1)
    low, high = np.percentile(boot, [2.5, 97.5])
    return Ratio(float(numerator.mean() / denominator.mean()), float(low), float(high))
