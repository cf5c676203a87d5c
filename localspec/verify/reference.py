"""Independent numpy reference of every verification method (slow; for tests, checks and bench).

Each function follows its paper literally (block verification computes every h_i, batch follows
Alg. 4's loops, traversal keeps explicit per-node residual rows) and reads the same uniform slots
as the C verifier (see :mod:`localspec.verify.verifier`), so the two can be compared draw for draw.

Randomness goes through a :class:`Randomness` object: :class:`Uniforms` replays caller-supplied
uniforms; :func:`enumerate_outcomes` runs an algorithm over *every* branch of its randomness and
returns the exact output distribution.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Protocol, Sequence

import numpy as np

Outcome = tuple[tuple[int, ...], int]  # (accepted node path, extra token)


class Randomness(Protocol):
    def bernoulli(self, prob: float, slot: int) -> bool: ...

    def categorical(self, weights: np.ndarray, total: float, slot: int) -> int: ...


@dataclass
class Uniforms:
    """Draws from fixed uniforms: bernoulli(h) = u[slot] < h; categorical = inverse CDF."""

    u: np.ndarray

    def bernoulli(self, prob: float, slot: int) -> bool:
        return bool(self.u[slot] < prob)

    def categorical(self, weights: np.ndarray, total: float, slot: int) -> int:
        cum = np.cumsum(weights)
        i = int(np.searchsorted(cum, self.u[slot] * total, side="right"))
        if i < len(weights):
            return i
        return int(np.flatnonzero(weights > 0)[-1])


class _Branch(Exception):
    def __init__(self, options: list[tuple[object, float]]) -> None:
        self.options = options


@dataclass
class _Replay:
    choices: list[object]
    prob: float = 1.0
    i: int = 0

    def _take(self, options: list[tuple[object, float]]) -> object:
        if self.i == len(self.choices):
            raise _Branch(options)
        value = self.choices[self.i]
        self.i += 1
        self.prob *= dict(options)[value]
        return value

    def bernoulli(self, prob: float, slot: int) -> bool:
        p = min(max(float(prob), 0.0), 1.0)
        opts = [(v, q) for v, q in ((True, p), (False, 1.0 - p)) if q > 0]
        return bool(self._take(opts))

    def categorical(self, weights: np.ndarray, total: float, slot: int) -> int:
        w = np.asarray(weights, dtype=np.float64)
        s = w.sum()
        opts = [(int(x), float(w[x] / s)) for x in np.flatnonzero(w > 0)]
        return int(self._take(opts))


def enumerate_outcomes(run: Callable[[Randomness], Hashable]) -> dict[Hashable, float]:
    """Exact distribution of run(rng) over all branches of its random choices (by replay)."""
    dist: dict[Hashable, float] = defaultdict(float)
    stack: list[list[object]] = [[]]
    while stack:
        choices = stack.pop()
        rng = _Replay(choices)
        try:
            out = run(rng)
        except _Branch as b:
            stack.extend(choices + [v] for v, _ in b.options)
            continue
        dist[out] += rng.prob
    return dict(dist)


# --------------------------------------------------------------------------- target transform


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


# --------------------------------------------------------------------------- tree helpers


@dataclass
class Tree:
    """Row ids: 0 = root, j+1 = node j."""

    tokens: np.ndarray
    parents: np.ndarray
    children: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, tokens: Sequence[int], parents: Sequence[int]) -> "Tree":
        t = cls(np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64))
        t.children = [[] for _ in range(len(t.tokens) + 1)]
        for j, p in enumerate(t.parents):
            t.children[p + 1].append(j + 1)
        return t

    @property
    def n(self) -> int:
        return len(self.tokens)

    def token(self, row: int) -> int:
        return int(self.tokens[row - 1])

    def parent(self, row: int) -> int:
        return int(self.parents[row - 1]) + 1

    def path(self, row: int) -> tuple[int, ...]:
        out = []
        while row > 0:
            out.append(row - 1)
            row = self.parent(row)
        return tuple(reversed(out))

    def chains(self) -> list[list[int]]:
        """Rows of each root-to-leaf chain; raises if a non-root node branches."""
        out = []
        for first in self.children[0]:
            chain = [first]
            while self.children[chain[-1]]:
                if len(self.children[chain[-1]]) > 1:
                    raise ValueError("only the root may branch")
                chain.append(self.children[chain[-1]][0])
            out.append(chain)
        return out


def _ratio(t: float, d: float) -> float:
    return t / d if d > 0 else 0.0


def _sample_target(tp: np.ndarray, row: int, rng: Randomness, slot: int) -> int:
    return rng.categorical(tp[row], 1.0, slot)


def _sample_residual(t: np.ndarray, d: np.ndarray, a: float, rng: Randomness, slot: int) -> int:
    w = np.maximum(a * t - d, 0.0)
    total = float(w.sum())
    if total > 0:
        return rng.categorical(w, total, slot)
    return rng.categorical(t, 1.0, slot)


# --------------------------------------------------------------------------- methods


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
        y = _sample_target(tp, row, rng, row)
        nxt = [c for c in tree.children[row] if tree.token(c) == y]
        if not nxt:
            return tree.path(row), y
        row = nxt[0]


def _chain(tree: Tree) -> list[int]:
    chains = tree.chains()
    if len(chains) > 1:
        raise ValueError("a single chain is required")
    return chains[0] if chains else []


def token(tp, dp, tree: Tree, rng: Randomness, lenience: float = 0.0, allowed: np.ndarray | None = None
          ) -> Outcome:
    """Block paper Alg. 1; lenience: Yin et al. b(x) = min{1, (target+eps)/draft}, residual Thm 4
    (never for a token the mask forbids: `allowed` [rows, V] booleans, None = no mask)."""
    rows = [0] + _chain(tree)
    n = tree.n
    for i in range(1, len(rows)):
        prev, x = rows[i - 1], tree.token(rows[i])
        t, d = tp[prev, x], dp[prev, x]
        ok = allowed is None or bool(allowed[prev, x])
        h = min(1.0, (t + lenience) / d) if d > 0 and ok else 0.0
        if not rng.bernoulli(h, rows[i] - 1):
            return tree.path(prev), _sample_residual(tp[prev], dp[prev], 1.0, rng, n)
    return tree.path(rows[-1]), _sample_target(tp, rows[-1], rng, n)


def _block_on(tp_rows, dp_rows, x, slots, rng: Randomness, n: int):
    """Block paper Alg. 2 on rows 0..g (tp_rows[i]: target after X^i; dp_rows[i]: draft after X^i)."""
    g = len(x)
    p = [1.0]
    for i in range(1, g + 1):
        p.append(min(p[i - 1] * _ratio(tp_rows[i - 1][x[i - 1]], dp_rows[i - 1][x[i - 1]]), 1.0))
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
    return tau, _sample_residual(tp_rows[tau], dp_rows[tau], p[tau], rng, n)  # Eq. 4


def block(tp, dp, tree: Tree, rng: Randomness) -> Outcome:
    rows = [0] + _chain(tree)
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


def rrs(tp, dp, tree: Tree, rng: Randomness, without_replacement: bool = False) -> Outcome:
    """Traversal paper Alg. 2 applied layer by layer (RRS, or RRSw without replacement)."""
    n = tree.n
    row = 0
    while True:
        kids = tree.children[row]
        if not kids:
            return tree.path(row), _sample_target(tp, row, rng, n)
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
        if rng.bernoulli(min(1.0, _ratio(q0[x], dp[0, x])), chain[0] - 1):
            for i in range(1, len(chain)):  # token verification down this draft
                prev, xi = chain[i - 1], tree.token(chain[i])
                if not rng.bernoulli(min(1.0, _ratio(tp[prev, xi], dp[prev, xi])), chain[i] - 1):
                    return tree.path(prev), _sample_residual(tp[prev], dp[prev], 1.0, rng, n)
            return tree.path(chain[-1]), _sample_target(tp, chain[-1], rng, n)
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
        p[q] = min(p[par] * _ratio(T[par][tree.token(q)], S[par][tree.token(q)]), 1.0)
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
            p[q] = min(p[par] * _ratio(T[par][tree.token(q)], S[par][tree.token(q)]), 1.0)
            stack.extend(kids[q])


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
