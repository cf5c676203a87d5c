"""Proving "lossless": toy models, draft-tree sampling, exact and statistical step distributions.

A verifier step is lossless when its output (accepted draft tokens, then the extra token),
continued by the target, is distributed exactly like the target's distribution (sampling from
the target). Constrained decoding is covered by a :class:`ToyGrammar` (context -> allowed
tokens): the target is then the masked target (mask first, then the sampling chain), the
drafter draws from its own masked distribution (or ignores the grammar: ``draft_masked=False``),
and the target's distribution is plain constrained sampling. This module computes that distribution exactly for the numpy reference (:func:`exact_error`) and tests the C
verifier against it by Monte Carlo (:func:`monte_carlo_pvalue`). Used by the tests and by
``localspec check``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import numpy as np

from localspec.settings.generation import WITHOUT_REPLACEMENT
from localspec.settings.sampling import SamplingParams
from localspec.settings.shape import Shape
from localspec.verify import reference, verifier
from localspec.verify.stats import pearson_pvalue

Context = tuple[int, ...]


@dataclass(frozen=True)
class ToyModel:
    """A context-dependent random language model over a tiny vocabulary.

    Its logits after a context are normal(0, scale) draws seeded by (seed, context); a draft is
    built from a target by adding `noise` to the target's logits (`base`). `fixed` logits make
    a context-independent model (the block paper's Sec. 2 example).
    """

    vocab: int
    seed: int
    scale: float = 1.5
    base: ToyModel | None = None
    noise: float = 0.0
    fixed: tuple[float, ...] | None = None

    def logits(self, context: Context) -> np.ndarray:
        return _toy_logits(self, context)


@lru_cache(maxsize=200_000)
def _toy_logits(model: ToyModel, context: Context) -> np.ndarray:
    if model.fixed is not None:
        return np.array(model.fixed, dtype=np.float64)
    digest = hashlib.blake2b(repr((model.seed, context)).encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    own = rng.normal(0.0, model.scale, size=model.vocab)
    if model.base is not None:
        own = model.base.logits(context) + model.noise * own / model.scale
    return own


@dataclass(frozen=True)
class ToyGrammar:
    """A deterministic toy "grammar" over a tiny vocabulary: context -> allowed tokens.

    A hash of (seed, context) decides how many tokens the context allows - one, two, or every
    token, about a third each - and which ones; never none. Applied to the toy target (and, for a
    masked drafter, to the toy draft) at every row, it exercises every kind of row a real grammar
    produces: forced tokens, narrow choices and unconstrained positions."""

    vocab: int
    seed: int

    def allowed(self, context: Context) -> np.ndarray:
        return _toy_allowed(self, context)


@lru_cache(maxsize=200_000)
def _toy_allowed(grammar: ToyGrammar, context: Context) -> np.ndarray:
    digest = hashlib.blake2b(repr(("grammar", grammar.seed, context)).encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    size = (1, min(2, grammar.vocab), grammar.vocab)[int(rng.integers(0, 3))]
    out = np.zeros(grammar.vocab, dtype=bool)
    out[rng.choice(grammar.vocab, size=size, replace=False)] = True
    out.flags.writeable = False
    return out


def _mask(grammar: ToyGrammar | None, context: Context) -> np.ndarray | None:
    return None if grammar is None else grammar.allowed(context)


SHAPES_BY_METHOD: dict[str, str] = {
    "greedy": "tree",
    "match": "tree",
    "token": "chain",
    "block": "chain",
    "gbv": "paths",
    "batch": "paths",
    "rrs": "tree",
    "rrsw": "tree",
    "traversal": "tree",
}


@dataclass
class ToyTree:
    """A draft tree sampled from a toy drafter, with each row's context (and grammar mask)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    contexts: list[Context] = field(default_factory=list)  # row r's context (row 0 = prefix)
    masks: list[np.ndarray] | None = None  # row r's allowed tokens under the grammar (None: no grammar)


@lru_cache(maxsize=200_000)
def draft_distribution(draft: ToyModel, context: Context, settings: SamplingParams,
                       grammar: ToyGrammar | None = None) -> np.ndarray:
    """What the drafter samples from: its own logits at the target's temperature (T=0: T=1),
    masked by `grammar` when it drafts under the constraint."""
    t = settings.temperature if settings.temperature > 0 else 1.0
    return reference.transform(draft.logits(context), temperature=t, mask=_mask(grammar, context))[0]


@lru_cache(maxsize=200_000)
def target_distribution(target: ToyModel, context: Context, settings: SamplingParams,
                        grammar: ToyGrammar | None = None) -> np.ndarray:
    """The transformed target row after `context` (numpy reference transform; `grammar`'s mask
    first, then the sampling chain)."""
    return reference.transform(target.logits(context), **asdict(settings), mask=_mask(grammar, context))[0]


def sample_tree(shape: Shape, draft: ToyModel, prefix: Context, settings: SamplingParams,
                rng: reference.Randomness, without_replacement: bool = False,
                grammar: ToyGrammar | None = None, draft_masked: bool = True) -> ToyTree:
    """Draw a draft tree through `rng` (so it can be enumerated exactly); siblings without
    replacement for the verifiers that need it. With a grammar, the tree records every row's
    mask, and the drafter samples from its masked distribution unless draft_masked is False."""
    tree = ToyTree(contexts=[prefix])
    dg = grammar if draft_masked else None
    branching = shape.branching or (1,) * shape.depth

    def grow(row: int, depth: int) -> None:
        if depth == shape.depth:
            return
        ctx = tree.contexts[row]
        q = draft_distribution(draft, ctx, settings, dg)
        taken: list[int] = []
        for _ in range(branching[depth]):
            w = q.copy()
            if without_replacement:
                w[taken] = 0.0
                if w.sum() <= 0:
                    break
            x = rng.categorical(w, float(w.sum()), 0)
            taken.append(x)
            tree.tokens.append(x)
            tree.parents.append(row - 1)
            tree.contexts.append(ctx + (x,))
            grow(len(tree.tokens), depth + 1)

    if shape.paths > 1:
        for _ in range(shape.paths):
            row = 0
            for _ in range(shape.depth):
                ctx = tree.contexts[row]
                q = draft_distribution(draft, ctx, settings, dg)
                x = rng.categorical(q, float(q.sum()), 0)
                tree.tokens.append(x)
                tree.parents.append(row - 1)
                tree.contexts.append(ctx + (x,))
                row = len(tree.tokens)
    else:
        grow(0, 0)
    if grammar is not None:
        tree.masks = [grammar.allowed(c) for c in tree.contexts]
    return tree


def tree_rows(tree: ToyTree, target: ToyModel, draft: ToyModel, settings: SamplingParams,
              grammar: ToyGrammar | None = None, draft_masked: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(target_logits float32, draft_probs float64: exactly the rows the tree was drawn from)."""
    dg = grammar if draft_masked else None
    logits = np.stack([target.logits(c) for c in tree.contexts]).astype(np.float32)
    dprobs = np.stack([draft_distribution(draft, c, settings, dg) for c in tree.contexts])
    return logits, dprobs


def tree_masks(tree: ToyTree) -> np.ndarray | None:
    """The tree's target masks as the C verifier's uint32 bitmasks (None without a grammar)."""
    return None if tree.masks is None else verifier.pack_mask(np.stack(tree.masks))


def output_sequence(tree: ToyTree, path: Sequence[int], token: int) -> tuple[int, ...]:
    return tuple(tree.tokens[j] for j in path) + (token,)


# --------------------------------------------------------------------------- exact


def target_joint(target: ToyModel, prefix: Context, length: int, settings: SamplingParams,
                 grammar: ToyGrammar | None = None) -> dict:
    """Exact target probability of every continuation of `length` tokens (plain constrained
    sampling under `grammar`, if given)."""
    out: dict[Context, float] = {(): 1.0}
    for _ in range(length):
        nxt: dict[Context, float] = {}
        for seq, p in out.items():
            row = target_distribution(target, prefix + seq, settings, grammar)
            for x in np.flatnonzero(row > 0):
                nxt[seq + (int(x),)] = p * float(row[x])
        out = nxt
    return out


def extend(dist: dict, target: ToyModel, prefix: Context, length: int, settings: SamplingParams,
           grammar: ToyGrammar | None = None) -> dict:
    """Continue every output sequence with the target up to `length` tokens."""
    full: dict = {}
    for seq, p in dist.items():
        for rest, q in target_joint(target, prefix + seq, length - len(seq), settings, grammar).items():
            full[seq + rest] = full.get(seq + rest, 0.0) + p * q
    return full


VerifyFn = Callable[[str, np.ndarray, np.ndarray, ToyTree, reference.Randomness], tuple]


def reference_step(method: str, target_probs: np.ndarray, draft_probs: np.ndarray,
                   tree: ToyTree, rng: reference.Randomness, lenience: float = 0.0) -> tuple:
    masks = None if tree.masks is None else np.stack(tree.masks)
    return reference.verify(method, target_probs, draft_probs, tree.tokens, tree.parents, rng,
                            lenience, masks=masks)


def exact_distribution(method: str, target: ToyModel, draft: ToyModel, shape: Shape,
                       settings: SamplingParams, prefix: Context = (), step: VerifyFn = reference_step,
                       grammar: ToyGrammar | None = None, draft_masked: bool = True) -> dict:
    """Exact distribution of one speculative step's output sequence (drafting included)."""

    def run(rng: reference.Randomness) -> tuple[int, ...]:
        tree = sample_tree(shape, draft, prefix, settings, rng, method in WITHOUT_REPLACEMENT, grammar,
                           draft_masked)
        _, dprobs = tree_rows(tree, target, draft, settings, grammar, draft_masked)
        tprobs = np.stack([target_distribution(target, c, settings, grammar) for c in tree.contexts])
        path, token = step(method, tprobs, dprobs, tree, rng)
        return output_sequence(tree, path, token)

    return reference.enumerate_outcomes(run)


def exact_error(method: str, target: ToyModel, draft: ToyModel, shape: Shape, settings: SamplingParams,
                step: VerifyFn = reference_step, grammar: ToyGrammar | None = None,
                draft_masked: bool = True) -> float:
    """max |P(output continued by the target) - P(sampled from the target)| over all sequences (with a
    grammar: the masked target, i.e. plain constrained sampling)."""
    dist = exact_distribution(method, target, draft, shape, settings, step=step, grammar=grammar,
                              draft_masked=draft_masked)
    length = shape.depth + 1
    full = extend(dist, target, (), length, settings, grammar)
    joint = target_joint(target, (), length, settings, grammar)
    keys = set(full) | set(joint)
    return max(abs(full.get(k, 0.0) - joint.get(k, 0.0)) for k in keys)


def expected_accepted(method: str, target: ToyModel, draft: ToyModel, shape: Shape,
                      settings: SamplingParams, grammar: ToyGrammar | None = None,
                      draft_masked: bool = True) -> float:
    dist = exact_distribution(method, target, draft, shape, settings, grammar=grammar, draft_masked=draft_masked)
    return sum(p * (len(seq) - 1) for seq, p in dist.items())


# --------------------------------------------------------------------------- statistical


class NumpyDraws:
    """Randomness for drafting trees in Monte Carlo runs."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def bernoulli(self, prob: float, slot: int) -> bool:
        return bool(self.rng.random() < prob)

    def categorical(self, weights: np.ndarray, total: float, slot: int) -> int:
        cum = np.cumsum(weights)
        i = int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right"))
        return min(i, len(weights) - 1)


def c_step(method: str, logits: np.ndarray, dprobs: np.ndarray, tree: ToyTree, seed: int,
           settings: SamplingParams, lenience: float = 0.0) -> tuple:
    v = verifier.verify(method, logits, dprobs.astype(np.float32), tree.tokens, tree.parents, seed=seed,
                        lenience=lenience, sampling=settings, masks=tree_masks(tree))
    return v.path, v.token


def monte_carlo_counts(method: str, target: ToyModel, draft: ToyModel, shape: Shape,
                       settings: SamplingParams, n: int, seed: int,
                       step: Callable[..., tuple] | None = None, grammar: ToyGrammar | None = None,
                       draft_masked: bool = True) -> dict:
    """Counts of the output sequences of `n` steps, each continued by the target to depth+1
    (with a grammar: masked trees, masks passed to the verifier, constrained continuation)."""
    rng = np.random.default_rng(seed)
    draws = NumpyDraws(rng)
    length = shape.depth + 1
    counts: dict = {}
    for _ in range(n):
        tree = sample_tree(shape, draft, (), settings, draws, method in WITHOUT_REPLACEMENT, grammar, draft_masked)
        logits, dprobs = tree_rows(tree, target, draft, settings, grammar, draft_masked)
        s = int(rng.integers(0, 2**63))
        if step is None:
            path, token = c_step(method, logits, dprobs, tree, s, settings)
        else:
            path, token = step(method, logits, dprobs, tree, s, settings)
        seq = output_sequence(tree, path, token)
        while len(seq) < length:
            row = target_distribution(target, seq, settings, grammar)
            seq = seq + (draws.categorical(row, 1.0, 0),)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def chi_square_pvalue(counts: dict, expected: dict, n: int, min_expected: float = 5.0) -> float:
    """Pearson goodness of fit of `counts` (n samples) against the probabilities `expected`;
    categories with expected count < min_expected are pooled (localspec.verify.stats.pearson_pvalue)."""
    if sum(counts.values()) != n:
        raise ValueError(f"counts hold {sum(counts.values())} samples, not n = {n}")
    return pearson_pvalue(counts, expected, min_expected)[2]


def monte_carlo_pvalue(method: str, target: ToyModel, draft: ToyModel, shape: Shape,
                       settings: SamplingParams, n: int, seed: int,
                       step: Callable[..., tuple] | None = None, grammar: ToyGrammar | None = None,
                       draft_masked: bool = True) -> float:
    counts = monte_carlo_counts(method, target, draft, shape, settings, n, seed, step, grammar, draft_masked)
    joint = target_joint(target, (), shape.depth + 1, settings, grammar)
    return chi_square_pvalue(counts, joint, n)
