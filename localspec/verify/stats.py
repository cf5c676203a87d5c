"""The chi-square goodness-of-fit test, without SciPy at run time (localspec check, lossless).

The tail probability is the regularised upper incomplete gamma function (series for small x,
Lentz's continued fraction otherwise, as in Numerical Recipes 6.2).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)  # a category


def _gamma_q(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) (series / Lentz continued fraction)."""
    if x <= 0:
        return 1.0
    log_pre = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_pre))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_pre) * h


def chi2_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square with `dof` degrees of freedom."""
    if dof < 1:
        return 1.0
    return _gamma_q(dof / 2.0, statistic / 2.0)


def pearson_pvalue(counts: Mapping[K, int], probs: Mapping[K, float],
                   min_expected: float = 5.0) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of a one-sample Pearson chi-square test of
    `counts` against `probs`. Categories with expected count < min_expected are pooled; an
    observation with probability 0 gives p = 0."""
    n = sum(counts.values())
    if n == 0:
        return 0.0, 0, 1.0
    if any(c > 0 and probs.get(k, 0.0) <= 0.0 for k, c in counts.items()):
        return math.inf, 0, 0.0
    keys = [k for k, p in probs.items() if p > 0]
    total = sum(probs[k] for k in keys)
    obs: list[float] = []
    exp: list[float] = []
    pooled_o, pooled_e = 0.0, 0.0
    for k in keys:
        e = n * probs[k] / total
        if e >= min_expected:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            pooled_o += counts.get(k, 0)
            pooled_e += e
    if pooled_e > 0:
        obs.append(pooled_o)
        exp.append(pooled_e)
    if len(obs) < 2:
        return 0.0, 0, 1.0
    stat = float(sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True)))
    dof = len(obs) - 1
    return stat, dof, chi2_sf(stat, dof)
