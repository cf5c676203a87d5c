"""What the reference verifiers (:mod:`localspec.verify.reference`) share: the draft tree, an
outcome, and the draws every method makes (the target's, and the residual's after a rejection)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from localspec.verify.randomness import Randomness

Outcome = tuple[tuple[int, ...], int]  # (accepted node path, extra token)


@dataclass
class Tree:
    """Row ids: 0 = root, j+1 = node j."""

    tokens: np.ndarray
    parents: np.ndarray
    children: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, tokens: Sequence[int], parents: Sequence[int]) -> Tree:
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


def ratio(t: float, d: float) -> float:
    return t / d if d > 0 else 0.0


def sample_target(tp: np.ndarray, row: int, rng: Randomness, slot: int) -> int:
    return rng.categorical(tp[row], 1.0, slot)


def sample_residual(t: np.ndarray, d: np.ndarray, a: float, rng: Randomness, slot: int) -> int:
    """A draw from max(a * t - d, 0), or from t when that is all zero. The methods look it up here at
    each call (``base.sample_residual``): the negative controls of tests/test_lossless_*.py replace it."""
    w = np.maximum(a * t - d, 0.0)
    total = float(w.sum())
    if total > 0:
        return rng.categorical(w, total, slot)
    return rng.categorical(t, 1.0, slot)


def single_chain(tree: Tree) -> list[int]:
    """The rows of the tree's one chain (ValueError when it has several)."""
    chains = tree.chains()
    if len(chains) > 1:
        raise ValueError("a single chain is required")
    return chains[0] if chains else []
