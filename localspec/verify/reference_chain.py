"""Reference verifiers of one chain (:mod:`localspec.verify.reference`): greedy, sample-and-match,
token verification (with lenience), block verification, and GBV (the multi-path paper's
lexicographically top chain, block-verified with q^Gamma)."""

from __future__ import annotations

import numpy as np

from localspec.verify import reference_tree as base
from localspec.verify.randomness import Randomness
from localspec.verify.reference_tree import Outcome, Tree, ratio, sample_target, single_chain


def greedy(tp, dp, tree: Tree, rng: Randomness) -> Outcome:
    row = 0
    while True:
        y = int(np.argmax(tp[row]))
        nxt = [c for c in tree.children[row] if tree.token(c) == y]
        if not nxt:
            return tree.path(row), y
        row = nxt[0]


def match(tp, dp, tree: Tree, rng: Randomness) -> Outcome:
    """Sample-and-match: the target is sampled at every row; a child with that token is kept."""
    row = 0
    while True:
        y = sample_target(tp, row, rng, row)
        nxt = [c for c in tree.children[row] if tree.token(c) == y]
        if not nxt:
            return tree.path(row), y
        row = nxt[0]


def token(tp, dp, tree: Tree, rng: Randomness, lenience: float = 0.0, allowed: np.ndarray | None = None
          ) -> Outcome:
    """Block paper Alg. 1; lenience: Yin et al. b(x) = min{1, (target+eps)/draft}, residual Thm 4
    (never for a token the mask forbids: `allowed` [rows, V] booleans, None = no mask)."""
    rows = [0] + single_chain(tree)
    n = tree.n
    for i in range(1, len(rows)):
        prev, x = rows[i - 1], tree.token(rows[i])
        t, d = tp[prev, x], dp[prev, x]
        ok = allowed is None or bool(allowed[prev, x])
        h = min(1.0, (t + lenience) / d) if d > 0 and ok else 0.0
        if not rng.bernoulli(h, rows[i] - 1):
            return tree.path(prev), base.sample_residual(tp[prev], dp[prev], 1.0, rng, n)
    return tree.path(rows[-1]), sample_target(tp, rows[-1], rng, n)


def _block_on(tp_rows, dp_rows, x, slots, rng: Randomness, n: int):
    """Block paper Alg. 2 on rows 0..g (tp_rows[i]: target after X^i; dp_rows[i]: draft after X^i)."""
    g = len(x)
    p = [1.0]
    for i in range(1, g + 1):
        p.append(min(p[i - 1] * ratio(tp_rows[i - 1][x[i - 1]], dp_rows[i - 1][x[i - 1]]), 1.0))
    h = []
    for i in range(1, g + 1):
        if i == g:
            h.append(p[g])
            continue
        w = float(np.maximum(p[i] * tp_rows[i] - dp_rows[i], 0.0).sum())  # Eq. 5
        den = w + 1.0 - p[i]
        h.append(w / den if den > 0 else 1.0)
    tau = 0
    for i in range(1, g + 1):  # every eta_i is drawn; tau = the last accepted
        if rng.bernoulli(h[i - 1], slots[i - 1]):
            tau = i
    if tau == g:
        return tau, rng.categorical(tp_rows[g], 1.0, n)
    return tau, base.sample_residual(tp_rows[tau], dp_rows[tau], p[tau], rng, n)  # Eq. 4


def block(tp, dp, tree: Tree, rng: Randomness) -> Outcome:
    rows = [0] + single_chain(tree)
    x = [tree.token(r) for r in rows[1:]]
    tau, y = _block_on([tp[r] for r in rows], [dp[r] for r in rows], x, [r - 1 for r in rows[1:]],
                       rng, tree.n)
    return tree.path(rows[tau]), y


def _key(t, d):
    """GBV local ranking pi = t/d (Eq. 21) rounded to float32; d = 0 ranks last (+inf)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.asarray(d) > 0, np.float32(np.asarray(t) / np.asarray(d)), np.float32(np.inf))


def _poly(u, v, K: int):
    s, vk = np.ones_like(u), v
    for _ in range(1, K):
        s = u * s + vk
        vk = vk * v
    return s


def _skewed(d, C, r: float, rho: float, K: int):
    """q^Gamma(x|prefix) of Eq. 22-23 in the scaled variables r = S/(S+Q), rho = Q/(S+Q)."""
    u = r + rho * C
    v = u + rho * d
    return d * _poly(u, v, K) * (1.0 / _poly(np.float64(r), np.float64(1.0), K))


def _skewed_row(t_row, d_row, r: float, rho: float, K: int) -> np.ndarray:
    idx = np.flatnonzero(d_row > 0)
    keys = _key(t_row[idx], d_row[idx])
    order = idx[np.lexsort((idx, keys))]
    d_sorted = d_row[order]
    C = np.concatenate([[0.0], np.cumsum(d_sorted)[:-1]])
    q = np.zeros_like(t_row)
    q[order] = _skewed(d_sorted, C, r, rho, K)
    return q


def gbv(tp, dp, tree: Tree, rng: Randomness) -> Outcome:
    """Multi-path paper Alg. 1: pick the lexicographically top chain, block-verify it with q^Gamma."""
    chains = tree.chains()
    K = len(chains)
    if K <= 1:
        return block(tp, dp, tree, rng)
    L = len(chains[0])
    if any(len(ch) != L for ch in chains):
        raise ValueError("gbv needs chains of equal length")

    def less(a: list[int], b: list[int]) -> bool:  # does chain b outrank chain a?
        for i in range(L):
            xa, xb = tree.token(a[i]), tree.token(b[i])
            if xa != xb:
                R = 0 if i == 0 else a[i - 1]
                ka, kb = _key(tp[R, xa], dp[R, xa]), _key(tp[R, xb], dp[R, xb])
                return bool(ka < kb or (ka == kb and xa < xb))
        return False

    best = chains[0]
    for ch in chains[1:]:
        if less(best, ch):
            best = ch
    rows = [0] + best
    x = [tree.token(r) for r in best]
    r_, rho = [0.0], [1.0]
    for i in range(1, L + 1):
        R = rows[i - 1]
        d = float(dp[R, x[i - 1]])
        keys = _key(tp[R], dp[R])
        kx = _key(tp[R, x[i - 1]], d)
        below = (keys < kx) | ((keys == kx) & (np.arange(tp.shape[1]) < x[i - 1]))
        C = float(dp[R][below].sum())
        u = r_[-1] + rho[-1] * C
        v = u + rho[-1] * d
        r_.append(u / v if v > 0 else 0.0)
        rho.append(rho[-1] * d / v if v > 0 else 1.0)
    q_rows = [_skewed_row(tp[rows[i]], dp[rows[i]], r_[i], rho[i], K) for i in range(L)]
    q_rows.append(np.zeros(tp.shape[1]))
    tau, y = _block_on([tp[r] for r in rows], q_rows, x, [r - 1 for r in best], rng, tree.n)
    return tree.path(rows[tau]), y
