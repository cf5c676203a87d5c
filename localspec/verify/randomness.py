"""The randomness of the reference verifiers (:mod:`localspec.verify.reference`): a method draws
through a :class:`Randomness`; :class:`Uniforms` replays caller-supplied uniforms (the C
verifier's slots, so the two can be compared draw for draw); :func:`enumerate_outcomes` runs an
algorithm over *every* branch of its randomness and returns the exact output distribution."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np


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


T = TypeVar("T")


class _Branch(Exception):
    def __init__(self, options: Sequence[tuple[object, float]]) -> None:
        self.options = options


@dataclass
class _Replay:
    choices: list[object]
    prob: float = 1.0
    i: int = 0

    def _take(self, options: Sequence[tuple[T, float]]) -> T:
        """The replayed choice: the option equal to it (one of these, as the replay records them)."""
        if self.i == len(self.choices):
            raise _Branch(options)
        value = self.choices[self.i]
        self.i += 1
        for option, q in options:
            if option == value:
                self.prob *= q
                return option
        raise KeyError(value)

    def bernoulli(self, prob: float, slot: int) -> bool:
        p = min(max(float(prob), 0.0), 1.0)
        opts = [(v, q) for v, q in ((True, p), (False, 1.0 - p)) if q > 0]
        return self._take(opts)

    def categorical(self, weights: np.ndarray, total: float, slot: int) -> int:
        w = np.asarray(weights, dtype=np.float64)
        s = w.sum()
        opts = [(int(x), float(w[x] / s)) for x in np.flatnonzero(w > 0)]
        return self._take(opts)


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
