"""What a target (or draft) pass costs: seconds per decode call by the number of tokens in it,
learned from every pass (:class:`CostTable`: the median of its recent passes of each size), and
which recorded costs are too implausible to keep (:func:`plausible_costs`: a pass of n tokens
dearer than n passes of one, or than a longer pass).

A size never measured is first estimated optimistically (from c(1) and the prompt prefill's rate),
so the planner (localspec.decoding.planner) tries it once and measures it. The tables start from
the models' cost profiles (localspec.decoding.profiles); the planner writes them back.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

EMA = 0.2  # weight of a new observation of a rate (a prefill's per-token cost)
WINDOW = 7  # the cost of a pass size: the median of its last WINDOW passes (the recorded cost counts as one)
UNMEASURED_SLOPE = 0.5  # an unmeasured pass of n tokens is first taken to cost c(1)·(1 + 0.5 (n - 1))


@dataclass
class CostTable:
    """Seconds per decode call, by number of tokens in the batch (EMA of measurements).

    Unmeasured sizes are interpolated linearly between their measured neighbours (CPU costs are
    not a line: on the 2-core reference machine a batch of 16 costs about what 9 cost). Beyond the
    largest measured size each further token costs the prefill rate (the least a token of a long
    batch costs), else UNMEASURED_SLOPE·c(1) (else, without c(1), the line through the two largest
    sizes, never below the largest's cost); with c(1) alone, the same from c(1). Optimistic on
    purpose: a draft that deep is then tried and the first real pass replaces the estimate.
    (Extending a steep start, c(2..4), along its line priced 16 tokens at twice their cost, and no
    draft deeper than 3 was ever tried where the prompt cache left no prefill to measure c(16).)"""

    seconds: dict[int, float] = field(default_factory=dict)
    prefill: Callable[[], float | None] = lambda: None  # seconds per token of a long prefill, as recorded
    prefill_scale: float = 1.0  # how c(1) moved since the prefill rate was recorded (it moves with it)
    _prefill_measured: bool = field(default=False, repr=False)  # a prefill was measured since the table was made
    _sizes: list[int] = field(default_factory=list, repr=False)  # sorted keys of `seconds`
    _measured: set[int] = field(default_factory=set, repr=False)  # sizes observed since the table was made
    _recent: dict[int, deque] = field(default_factory=dict, repr=False)  # each size's last passes

    def observe(self, n: int, secs: float) -> None:
        """A pass of n tokens took `secs`: its size's cost is the median of its last WINDOW passes
        (one pass slowed by other work on the machine moves nothing). A new c(1) moves the sizes
        not measured since this table was made (recorded by earlier runs) with it: they are
        measured only when drafts that size are made, so a curve recorded while the machine was
        busier would otherwise keep them dear while c(1) recovers, and no draft would pay again.
        The shape of the curve is the machine's; its level is now's. The prefill rate moves with
        it too until a prefill is measured (:meth:`prefill_rate`)."""
        old = self.seconds.get(n)
        recent = self._recent.get(n)
        if recent is None:
            recent = self._recent[n] = deque([] if old is None else [old], maxlen=WINDOW)
        recent.append(secs)
        self.seconds[n] = statistics.median(recent)
        self._measured.add(n)
        if n == 1 and old:
            scale = self.seconds[1] / old
            if not self._prefill_measured:
                self.prefill_scale *= scale
            for m in self.seconds:
                if m not in self._measured:
                    self.seconds[m] *= scale

    def prefill_observed(self) -> None:
        """The recorded prefill rate now holds a measurement taken at today's c(1)."""
        self.prefill_scale, self._prefill_measured = 1.0, True

    def prefill_rate(self) -> float | None:
        """Seconds per token of a long prefill at today's c(1); None where unknown or implausible:
        a token of a long batch never costs what a pass of one token costs (a rate recorded under
        load, and kept since because prompts came from the prompt cache, would price every pass
        beyond the measured ones as dear as that many single steps)."""
        rate = self.prefill()
        if rate is None:
            return None
        rate *= self.prefill_scale
        c1 = self.seconds.get(1)
        return None if c1 and rate >= c1 else rate

    def __call__(self, n: int) -> float:
        if n in self.seconds:
            return self.seconds[n]
        if not self.seconds:
            return 0.0
        if len(self._sizes) != len(self.seconds):
            self._sizes = sorted(self.seconds)
        sizes = self._sizes
        if len(sizes) == 1:
            c, size = self.seconds[sizes[0]], sizes[0]
            per_token = self.prefill_rate() or UNMEASURED_SLOPE * c / size
            return max(c, c + (n - size) * per_token) if n > size else c * n / size
        i = min(max(bisect.bisect_left(sizes, n), 1), len(sizes) - 1)  # sizes[i-1] < n < sizes[i] inside
        lo, hi = sizes[i - 1], sizes[i]
        c_lo, c_hi = self.seconds[lo], self.seconds[hi]
        line = c_lo + (c_hi - c_lo) * (n - lo) / (hi - lo)
        if n > hi:  # beyond the largest measured size: each further token costs a prefill's token, the
            # least a token of a long batch costs (optimistic, so a deeper draft is tried and measured:
            # neither a flat last segment, c(16) ~ c(9), nor a steep first one, c(2..4), is a trend)
            per_token = self.prefill_rate() or UNMEASURED_SLOPE * self.seconds.get(1, 0.0)
            return c_hi + (n - hi) * per_token if per_token else max(line, c_hi)
        if n < lo:  # below the smallest: never cheaper per token than it
            return max(line, c_lo * n / lo)
        return line


IMPLAUSIBLE = 1.5  # a pass of n tokens recorded as costing more than this many times n·c(1) is forgotten
SLACK = 1.25  # ... or as costing more than this many times a longer pass (equal costs are noise, not a fault)


def implausible_costs(costs: dict[int, float]) -> dict[int, str]:
    """The pass sizes of a recorded curve that no real pass can have cost, and why: more than
    IMPLAUSIBLE·n·c(1) (one pass of n tokens never costs more than n passes of one), or more than
    a longer pass (a pass never gets cheaper with more tokens in it: e.g. c(4) = 395 ms beside
    c(16) = 184 ms). Load on the machine only ever makes a pass dearer, so of two that disagree
    the dearer one goes."""
    out: dict[int, str] = {}
    c1 = costs.get(1)
    sizes = sorted(costs)
    for i, n in enumerate(sizes):
        longer = [m for m in sizes[i + 1:] if SLACK * costs[m] < costs[n]]
        if c1 and costs[n] > IMPLAUSIBLE * n * c1:
            out[n] = f"c({n}) = {costs[n] * 1e3:.1f} ms is more than {IMPLAUSIBLE:g}·{n}·c(1)"
        elif longer:
            m = longer[-1]
            out[n] = f"c({n}) = {costs[n] * 1e3:.1f} ms is more than c({m}) = {costs[m] * 1e3:.1f} ms"
    return out


def plausible_costs(costs: dict[int, float]) -> dict[int, float]:
    """A profile's costs without the implausible ones (implausible_costs): a run under heavy load
    (a compiler on every core) records c(n) seconds-long, and c(1) recovers at the next run's first
    steps while c(n) is only measured again by a draft that those costs forbid. Forgotten, the size
    is measured again (the prompt prefill measures CURVE_SIZES; others, by drafts)."""
    dropped = implausible_costs(costs)
    return {n: c for n, c in costs.items() if n not in dropped}
