"""Independent numpy reference of every verification method (slow; for tests, checks and bench).

Each function follows its paper literally (block verification computes every h_i, batch follows
Alg. 4's loops, traversal keeps explicit per-node residual rows) and reads the same uniform slots
as the C verifier (see :mod:`localspec.verify.verifier`), so the two can be compared draw for draw.

Randomness goes through a :class:`Randomness` object: :class:`Uniforms` replays caller-supplied
uniforms; :func:`enumerate_outcomes` runs an algorithm over *every* branch of its randomness and
returns the exact output distribution (:mod:`localspec.verify.randomness`).

This module is the entry point — the sampler's target transform, token masks and :func:`verify` —
over the methods by family: one chain in :mod:`localspec.verify.reference_chain` (greedy, match,
token, block, gbv), several drafts in :mod:`localspec.verify.reference_multi` (rrs, rrsw, batch,
traversal); the tree and the shared draws are :mod:`localspec.verify.reference_tree`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from localspec.verify.randomness import Randomness, Uniforms, enumerate_outcomes
from localspec.verify.reference_chain import block, gbv, greedy, match, token
from localspec.verify.reference_multi import batch, rrs, rrsw, traversal
from localspec.verify.reference_tree import Outcome, Tree

__all__ = ["Outcome", "Randomness", "Uniforms", "enumerate_outcomes", "Tree", "bool_masks", "transform", "METHODS",
           "verify", "greedy", "match", "token", "block", "gbv", "rrs", "rrsw", "batch", "traversal"]


def bool_masks(masks: np.ndarray, n_rows: int, V: int) -> np.ndarray:
    """Token masks as booleans [n_rows, V]: booleans as given, or uint32 bitmasks (bit t % 32 of
    word t // 32, the C verifier's layout, unpacked here independently). ValueError when a row
    allows no token."""
    m = np.asarray(masks)
    if m.ndim == 1:
        m = m[None, :]
    if m.dtype == np.bool_:
        allowed = m[:, :V]
    else:
        t = np.arange(V)
        allowed = ((m.astype(np.uint64)[:, t // 32] >> (t % 32).astype(np.uint64)) & 1).astype(bool)
    if allowed.shape != (n_rows, V):
        raise ValueError(f"masks of shape {m.shape} do not cover {n_rows} rows of {V} tokens")
    empty = np.flatnonzero(~allowed.any(axis=1))
    if empty.size:
        raise ValueError(f"masks row {int(empty[0])} allows no token")
    return allowed


def transform(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0, mask: np.ndarray | None = None) -> np.ndarray:
    """Plain sampler distribution, float64: the token mask first (disallowed logits -> -inf, their
    values never used), then top-k, top-p, min-p at T=1 over the allowed tokens, then temperature."""
    logits = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    if mask is not None:
        allowed = bool_masks(mask, logits.shape[0], logits.shape[1])
        logits = np.where(allowed, logits, -np.inf)
    out = np.zeros_like(logits)
    for r, row in enumerate(logits):
        V = row.shape[0]
        order = np.lexsort((np.arange(V), -row))  # logit descending, then id ascending
        keep = np.zeros(V, dtype=bool)
        if temperature == 0:
            out[r, order[0]] = 1.0
            continue
        kept = order[: top_k] if 0 < top_k < V else order
        if top_p < 1.0:
            e = np.exp(row[kept] - row.max())
            cum = np.cumsum(e / e.sum())
            cut = int(np.searchsorted(cum, top_p, side="left"))
            kept = kept[: min(cut + 1, len(kept))]
        keep[kept] = True
        if min_p > 0:
            keep &= row >= row.max() + np.log(np.float32(min_p))
        keep &= row > -np.inf  # the mask: top-k may have listed disallowed (-inf) tokens
        e = np.where(keep, np.exp((row - row.max()) / temperature), 0.0)
        out[r] = e / e.sum()
    return out



METHODS: dict[str, Callable[..., Outcome]] = {
    "greedy": greedy,
    "match": match,
    "token": token,
    "block": block,
    "gbv": gbv,
    "rrs": rrs,
    "rrsw": rrsw,
    "traversal": traversal,
    "batch": batch,
}


def verify(method: str, target_probs: np.ndarray, draft_probs: np.ndarray, tokens: Sequence[int],
           parents: Sequence[int], rng: Randomness, lenience: float = 0.0,
           masks: np.ndarray | None = None) -> Outcome:
    """Run the reference of `method` on already transformed target probabilities.

    With ``masks`` (booleans or uint32 bitmasks, one row per target row) the target rows must
    be the masked ones (``transform(..., mask=...)``): every method then runs unchanged on them,
    which is what makes it lossless w.r.t. the masked target; a row allowing no token, or target
    mass on a disallowed token, is a ValueError."""
    tree = Tree.of(tokens, parents)
    tp = np.asarray(target_probs, dtype=np.float64)
    dp = np.asarray(draft_probs, dtype=np.float64)
    allowed = None
    if masks is not None:
        allowed = bool_masks(masks, tp.shape[0], tp.shape[1])
        bad = np.argwhere((tp > 0) & ~allowed)
        if bad.size:
            raise ValueError(f"target_probs row {int(bad[0][0])} has mass on disallowed token {int(bad[0][1])}")
    if method == "token":
        return token(tp, dp, tree, rng, lenience, allowed)
    return METHODS[method](tp, dp, tree, rng)
