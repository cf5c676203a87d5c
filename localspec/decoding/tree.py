"""The draft tree shared by drafters, the engine and the verifier.

Nodes are numbered in the order they were drafted (parents before children, siblings in sampling
order); ``parents[j] == -1`` hangs node j on the committed prefix (the "root"). Row 0 of
``probs`` is the distribution the root's children were drawn from, row j+1 the one node j's
children were drawn from; leaf rows are unused.

A :class:`localspec.settings.shape.Shape` says what to draft: a chain of γ tokens, K independent paths of
γ tokens, or a tree with a branching factor per depth. Every root-to-leaf path of a tree is a KV-cache sequence
(see :func:`leaf_ranges`), so one batch evaluates the whole tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from localspec.settings.shape import Shape


@dataclass
class DraftTree:
    """Drafted tokens with their parents, depths, KV sequence sets and draft distributions."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    seqs: list[tuple[int, ...]] = field(default_factory=list)  # KV sequences of each node
    probs: np.ndarray | None = None  # (n+1, V) float32

    @property
    def n(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, seqs: tuple[int, ...]) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.seqs.append(seqs)
        return len(self.tokens) - 1

    def path_tokens(self, path: tuple[int, ...]) -> list[int]:
        return [self.tokens[j] for j in path]

    def branch_of(self, path: tuple[int, ...]) -> int:
        """A KV sequence that holds the accepted path (the root's is 0)."""
        return self.seqs[path[-1]][0] if path else 0


def leaf_ranges(shape: Shape) -> list[list[tuple[int, int]]]:
    """Per depth, per node (in drafting order within the level), the half-open range of leaf
    branches (KV sequences) below it."""
    if shape.branching is None:
        return [[(k, k + 1) for k in range(shape.paths)] for _ in range(shape.depth)]
    levels = []
    n_leaves = shape.n_leaves
    width = 1
    for b in shape.branching:
        width *= b
        span = n_leaves // width
        levels.append([(i * span, (i + 1) * span) for i in range(width)])
    return levels
