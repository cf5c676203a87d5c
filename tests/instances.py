"""Random verification instances shaped for each method (shared by the verifier tests)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from localspec.settings.sampling import SamplingParams


@dataclass
class Instance:
    method: str
    logits: np.ndarray  # (n+1, V) float32
    draft: np.ndarray  # (n+1, V) float32
    tokens: list[int]
    parents: list[int]
    settings: SamplingParams
    uniforms: np.ndarray
    masks: np.ndarray | None = None  # uint32 bitmasks (n+1, ceil(V/32)), or None

    @property
    def n(self) -> int:
        return len(self.tokens)


def random_settings(rng: np.random.Generator, V: int) -> SamplingParams:
    t = float(rng.choice([0.0, 0.5, 1.0, 1.0, 1.5]))
    top_k = int(rng.choice([0, 0, 1, 3, V]))
    top_p = float(rng.choice([1.0, 1.0, 0.9, 0.5]))
    min_p = float(rng.choice([0.0, 0.0, 0.05, 0.3]))
    return SamplingParams(t, top_k, top_p, min_p)


def random_draft_row(rng: np.random.Generator, V: int, target_row: np.ndarray) -> np.ndarray:
    kind = rng.integers(0, 6)
    if kind == 0:  # the draft equals the target
        row = target_row.astype(np.float64)
    elif kind == 1:  # one-hot
        row = np.zeros(V)
        row[rng.integers(0, V)] = 1.0
    elif kind == 2:  # sparse (a drafter sampling from its own top-k)
        row = rng.dirichlet(np.full(V, 0.5))
        row[rng.permutation(V)[: V // 2]] = 0.0
        if row.sum() == 0:
            row[0] = 1.0
    else:
        row = rng.dirichlet(np.full(V, rng.choice([0.3, 1.0, 3.0])))
    row = row / row.sum()
    return row.astype(np.float32)


def _pick(rng: np.random.Generator, row: np.ndarray, taken: list[int]) -> int:
    w = row.astype(np.float64).copy()
    w[taken] = 0.0
    if w.sum() > 0 and rng.random() < 0.9:
        return int(rng.choice(len(w), p=w / w.sum()))
    free = [x for x in range(len(w)) if x not in taken]
    return int(rng.choice(free))


def random_structure(rng: np.random.Generator, method: str, V: int) -> list[int]:
    """Parents of a random draft shape the method accepts."""
    if method in ("token", "block"):
        g = int(rng.integers(0, 9))
        return [j - 1 for j in range(g)]
    if method in ("gbv", "batch"):
        K = int(rng.integers(1, 5))
        parents = []
        L = int(rng.integers(1, 5))
        for _ in range(K):
            length = L if method == "gbv" else int(rng.integers(1, 5))
            prev = -1
            for _ in range(length):
                parents.append(prev)
                prev = len(parents) - 1
        return parents
    n = int(rng.integers(0, 12))
    return [int(rng.integers(-1, j)) if j else -1 for j in range(n)]


def random_allowed(rng: np.random.Generator, n_rows: int, V: int) -> np.ndarray:
    """Boolean token masks of every density: one token, two, sparse, half, all (never empty)."""
    allowed = np.zeros((n_rows, V), dtype=bool)
    for r in range(n_rows):
        kind = rng.integers(0, 5)
        if kind == 0:
            allowed[r, rng.integers(0, V)] = True
        elif kind == 1:
            allowed[r, rng.choice(V, size=min(2, V), replace=False)] = True
        elif kind == 4:
            allowed[r] = True
        else:
            allowed[r] = rng.random(V) < (0.1 if kind == 2 else 0.5)
            allowed[r, rng.integers(0, V)] = True
    return allowed


def masked_draft_row(rng: np.random.Generator, row: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Half the time a drafter that honours the mask (its own row restricted to the allowed
    tokens), else one that ignores it (so it drafts forbidden tokens)."""
    if rng.random() < 0.5:
        return row
    w = row.astype(np.float64) * allowed
    if w.sum() <= 0:
        w = allowed.astype(np.float64)
    return (w / w.sum()).astype(np.float32)


def random_instance(rng: np.random.Generator, method: str, V: int | None = None,
                    masked: bool = False) -> Instance:
    V = V or int(rng.choice([2, 3, 5, 8, 33, 200, 3000]))
    parents = random_structure(rng, method, V)
    n = len(parents)
    scale = float(rng.choice([0.5, 2.0, 5.0]))
    logits = (rng.normal(0, scale, size=(n + 1, V))).astype(np.float32)
    if rng.random() < 0.2:  # ties
        logits = np.round(logits).astype(np.float32)
    settings = random_settings(rng, V)
    from localspec.verify import verifier

    masks = None
    if masked:
        allowed = random_allowed(rng, n + 1, V)
        junk = ~allowed & (rng.random((n + 1, V)) < 0.3)  # disallowed logits are never read
        logits[junk] = rng.choice(np.array([np.nan, -np.inf, np.inf, 50.0], dtype=np.float32), size=int(junk.sum()))
        masks = verifier.pack_mask(allowed)
    tp = verifier.probs(logits, sampling=settings, masks=masks)
    draft = np.stack([random_draft_row(rng, V, tp[r]) for r in range(n + 1)])
    if masked:
        draft = np.stack([masked_draft_row(rng, draft[r], allowed[r]) for r in range(n + 1)])
    distinct = method in ("rrsw", "traversal")
    tokens: list[int] = []
    siblings: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        taken = siblings.setdefault(p, [])
        if distinct and len(taken) >= V:  # no distinct token left: re-hang under node j-1
            parents[j] = j - 1
            taken = siblings.setdefault(j - 1, [])
        x = _pick(rng, draft[parents[j] + 1], taken if distinct else [])
        taken.append(x)
        tokens.append(x)
    u = rng.random(n + 1)
    return Instance(method, logits, draft, tokens, parents, settings, u, masks)
