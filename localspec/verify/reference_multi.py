"""Reference verifiers of several drafts (:mod:`localspec.verify.reference`): recursive rejection
sampling layer by layer (RRS, RRSw without replacement), Yin et al.'s batch verification, and
traversal verification with explicit residual rows."""

from __future__ import annotations

import numpy as np

from localspec.verify import reference_tree as base
from localspec.verify.randomness import Randomness
from localspec.verify.reference_tree import Outcome, Tree, ratio, sample_target


def rrs(tp, dp, tree: Tree, rng: Randomness, without_replacement: bool = False) -> Outcome:
    """Traversal paper Alg. 2 applied layer by layer (RRS, or RRSw without replacement)."""
    n = tree.n
    row = 0
    while True:
        kids = tree.children[row]
        if not kids:
            return tree.path(row), sample_target(tp, row, rng, n)
        T, S = tp[row].copy(), dp[row].astype(np.float64)
        rest = 1.0
        nxt = None
        for c in kids:
            x = tree.token(c)
            h = min(1.0, T[x] / S[x]) if S[x] > 0 else 0.0
            if rng.bernoulli(h, c - 1):
                nxt = c
                break
            w = np.maximum(T - S, 0.0)  # line 7
            if w.sum() > 0:
                T = w / w.sum()
            if without_replacement:  # line 9
                rest -= float(dp[row, x])
                S = np.where(S > 0, dp[row] / rest, 0.0) if rest > 0 else np.zeros_like(S)
                S[x] = 0.0
        if nxt is None:
            return tree.path(row), rng.categorical(T, 1.0, n)
        row = nxt


def rrsw(tp, dp, tree: Tree, rng: Randomness) -> Outcome:
    return rrs(tp, dp, tree, rng, without_replacement=True)


def batch(tp, dp, tree: Tree, rng: Randomness) -> Outcome:
    """Yin et al. Alg. 4 (their q = target, p = draft): try the M drafts' first tokens against the
    running residual, continue the accepted draft token by token."""
    chains = tree.chains()
    n = tree.n
    q0 = tp[0].copy()
    for chain in chains:
        x = tree.token(chain[0])
        if rng.bernoulli(min(1.0, ratio(q0[x], dp[0, x])), chain[0] - 1):
            for i in range(1, len(chain)):  # token verification down this draft
                prev, xi = chain[i - 1], tree.token(chain[i])
                if not rng.bernoulli(min(1.0, ratio(tp[prev, xi], dp[prev, xi])), chain[i] - 1):
                    return tree.path(prev), base.sample_residual(tp[prev], dp[prev], 1.0, rng, n)
            return tree.path(chain[-1]), sample_target(tp, chain[-1], rng, n)
        w = np.maximum(q0 - dp[0], 0.0)  # line 19
        if w.sum() > 0:
            q0 = w / w.sum()
    return (), rng.categorical(q0, 1.0, n)


def traversal(tp, dp, tree: Tree, rng: Randomness) -> Outcome:
    """Traversal paper Alg. 3 with explicit residual (Eq. 1) and draft (Eq. 2) rows."""
    n = tree.n
    T = {r: tp[r].copy() for r in range(n + 1)}
    S = {r: dp[r].astype(np.float64) for r in range(n + 1)}
    rest = {r: 1.0 for r in range(n + 1)}
    kids = {r: list(tree.children[r]) for r in range(n + 1)}
    p = {0: 1.0}
    for q in range(1, n + 1):  # line 1
        par = tree.parent(q)
        p[q] = min(p[par] * ratio(T[par][tree.token(q)], S[par][tree.token(q)]), 1.0)
    while True:
        r = 0
        while kids[r]:
            r = kids[r][0]
        if r == 0 or rng.bernoulli(p[r], r - 1):
            return tree.path(r), rng.categorical(T[r], 1.0, n)
        P, x = tree.parent(r), tree.token(r)
        kids[P].pop(0)
        a = p[P]
        w = np.maximum(a * T[P] - S[P], 0.0)
        W = float(w.sum())
        if W > 0:
            T[P] = w / W  # Eq. 1
        rest[P] -= float(dp[P, x])
        S[P] = np.where(S[P] > 0, dp[P] / rest[P], 0.0) if rest[P] > 0 else np.zeros_like(S[P])  # Eq. 2
        S[P][x] = 0.0
        den = W + 1.0 - a
        p[P] = W / den if den > 0 else 1.0  # Eq. 3
        stack = list(kids[P])  # line 13: refresh the remaining subtree of P
        while stack:
            q = stack.pop()
            par = tree.parent(q)
            p[q] = min(p[par] * ratio(T[par][tree.token(q)], S[par][tree.token(q)]), 1.0)
            stack.extend(kids[q])
