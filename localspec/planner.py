"""Cost-aware planning: how deep to draft at each step, or whether to speculate at all.

The model (docs/design.md, "The cost model"): a step that drafts d levels and verifies n(d) + 1 tokens
yields E(d) = (1 - α^(d+1)) / (1 - α) tokens on average (per-level acceptance α) and costs
d·c_draft + c_target(n(d) + 1); the target alone yields 1 token per c_target(1). The planner
picks the d that maximises E(d) / cost(d), and d = 0 (no speculation) unless that beats the
target alone by a margin.

* target costs per batch size are measured once per model (a short calibration of dummy batches
  of 1, 2, 4, 8, ... tokens and the shape's own sizes, in a scratch KV sequence) and then updated
  from every step; unmeasured sizes are interpolated between measured neighbours (the CPU curve
  has kinks: see docs/head-to-head.md);
* the draft model's cost per level is calibrated the same way and then tracked per step;
  n-gram drafts cost nothing;
* α is estimated per drafter from accepted lengths, with counts that decay back towards an
  optimistic prior, so a drafter that stopped being used is probed again after a while
  (only where speculation can pay at all at the prior's α).

Choosing the draft length from past observations keeps verification lossless: each step is
verified exactly, whatever length the history chose.
"""

from __future__ import annotations

import bisect
import logging
import time
import weakref
from dataclasses import dataclass, field

from localspec.config import Shape
from localspec.errors import ModelError
from localspec.model import Model

log = logging.getLogger(__name__)

EMA = 0.2  # weight of a new cost observation
DECAY = 0.97  # per step: acceptance counts fade so the estimate can recover
PRIOR_ACCEPT, PRIOR_REJECT = 2.0, 1.0  # α prior 2/3, worth three observations
MARGIN = 1.03  # speculate only when it is predicted to be at least 3 % faster
OPTIMISM = 1.0  # decide with α + OPTIMISM·sd (explores a drafter until its acceptance is known)


@dataclass
class CostTable:
    """Seconds per decode call, by number of tokens in the batch (EMA of measurements).

    Unmeasured sizes are interpolated linearly between their measured neighbours (CPU costs are
    not a line: on the 2-core reference machine a batch of 16 costs about what 9 cost), and beyond
    the measured range extended along the line through the two nearest sizes."""

    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, n: int, secs: float) -> None:
        old = self.seconds.get(n)
        self.seconds[n] = secs if old is None else (1 - EMA) * old + EMA * secs

    def __call__(self, n: int) -> float:
        if n in self.seconds:
            return self.seconds[n]
        if not self.seconds:
            return 0.0
        sizes = sorted(self.seconds)
        if len(sizes) == 1:
            return self.seconds[sizes[0]] * n / sizes[0]  # pessimistic: proportional to the batch size
        i = min(max(bisect.bisect_left(sizes, n), 1), len(sizes) - 1)  # sizes[i-1] < n < sizes[i] inside
        lo, hi = sizes[i - 1], sizes[i]
        c_lo, c_hi = self.seconds[lo], self.seconds[hi]
        line = c_lo + (c_hi - c_lo) * (n - lo) / (hi - lo)
        if n > hi:  # beyond the largest measured size: never cheaper than it
            return max(line, c_hi)
        if n < lo:  # below the smallest: never cheaper per token than it
            return max(line, c_lo * n / lo)
        return line


def time_decode(model: Model, n: int, seq: int) -> float:
    """Seconds for one decode of n dummy tokens (all logits) in scratch KV sequence `seq`."""
    tokens = [model.bos if model.bos >= 0 else 0] * n
    t0 = time.perf_counter()
    model.decode(tokens, range(n), [(seq,)] * n, outputs="all")
    secs = time.perf_counter() - t0
    model.seq_rm(seq, -1, -1)
    return secs


_TABLES: "weakref.WeakKeyDictionary[Model, CostTable]" = weakref.WeakKeyDictionary()


def step_costs(model: Model) -> CostTable:
    """The cost table of a loaded model: measured once, refined by every planned step."""
    table = _TABLES.get(model)
    if table is None:
        table = _TABLES[model] = CostTable()
    return table


def calibrate(model: Model, sizes: tuple[int, ...]) -> CostTable:
    """Time dummy batches of the given sizes in a scratch KV sequence (best of two, after one
    warm-up decode) that the model's cost table does not hold yet."""
    table = step_costs(model)
    seq = model.options.n_seq_max - 1
    missing = [n for n in sizes if n not in table.seconds and n <= model.n_batch]
    if seq < 1 or not missing:
        return table
    try:
        time_decode(model, 1, seq)  # warm-up: a cold first decode would inflate c(1)
        for n in missing:
            table.observe(n, min(time_decode(model, n, seq) for _ in range(2)))
    except ModelError as exc:  # no free KV cells: learn from real steps instead
        log.debug("calibration of %s skipped: %s", model.path.name, exc)
    log.debug("step costs of %s: %s", model.path.name,
              {n: f"{s * 1e3:.1f} ms" for n, s in sorted(table.seconds.items())})
    return table


def one_token_seconds(model: Model) -> float:
    """The measured cost of decoding one token (calibrated if not measured yet)."""
    return calibrate(model, (1,))(1)


@dataclass
class Acceptance:
    """Per-level acceptance rate from accepted lengths (decaying Beta-style counts)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def decay(self) -> None:
        self.accepted *= DECAY
        self.rejected *= DECAY

    def observe(self, n_accepted: int, depth: int) -> None:
        self.accepted += n_accepted
        self.rejected += 1.0 if n_accepted < depth else 0.0

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ACCEPT) / (self.accepted + self.rejected + PRIOR_ACCEPT + PRIOR_REJECT)

    @property
    def optimistic(self) -> float:
        """α plus one standard deviation of its Beta posterior: an upper confidence bound, so a
        drafter with few (or decayed) observations gets tried, and one measured to lose does not."""
        a, b = self.accepted + PRIOR_ACCEPT, self.rejected + PRIOR_REJECT
        sd = (a * b / ((a + b) ** 2 * (a + b + 1))) ** 0.5
        return min(1.0, self.alpha + OPTIMISM * sd)


def expected_tokens(alpha: float, depth: int) -> float:
    """E[tokens per step] for a chain of `depth` drafts with per-level acceptance α."""
    if alpha >= 1.0:
        return depth + 1.0
    return (1.0 - alpha ** (depth + 1)) / (1.0 - alpha)


class Planner:
    """Chooses each step's draft depth for one generation (costs persist on the models)."""

    def __init__(self, target: Model, draft: Model | None, shape: Shape) -> None:
        self.shape = shape
        top = shape.n_nodes + 1
        powers = {2 ** i for i in range(top.bit_length()) if 2 ** i <= top}  # 1, 2, 4, 8, ... (the curve's shape)
        sizes = tuple(sorted(powers | {shape.truncated(1).n_nodes + 1, top}))
        self.target_cost = calibrate(target, sizes)
        self.draft_cost = calibrate(draft, (1,)) if draft is not None else None
        self.acceptance = {"model": Acceptance(), "ngram": Acceptance()}

    def draft_level_cost(self) -> float:
        return self.draft_cost(1) if self.draft_cost is not None else 0.0

    def rate(self, drafter: str, depth: int) -> float:
        """Predicted tokens per second when drafting `depth` levels with `drafter`."""
        c_draft = self.draft_level_cost() if drafter == "model" else 0.0
        nodes = self.shape.truncated(depth).n_nodes
        cost = depth * c_draft + self.target_cost(nodes + 1)
        if cost <= 0:
            return float("inf")
        return expected_tokens(self.acceptance[drafter].optimistic, depth) / cost

    def depth(self, drafter: str, max_depth: int) -> int:
        """The draft depth to use now (0: decode with the target alone)."""
        if max_depth <= 0 or self.target_cost(1) <= 0:
            return max_depth
        plain = 1.0 / self.target_cost(1)
        best, best_rate = 0, plain * MARGIN
        for d in range(1, max_depth + 1):
            r = self.rate(drafter, d)
            if r > best_rate:
                best, best_rate = d, r
        return best

    def observe(self, drafter: str | None, depth: int, n_accepted: int, n_target_tokens: int,
                target_seconds: float, draft_seconds: float) -> None:
        for acc in self.acceptance.values():
            acc.decay()
        self.target_cost.observe(n_target_tokens, target_seconds)
        if drafter is None or depth <= 0:
            return
        self.acceptance[drafter].observe(n_accepted, depth)
        if drafter == "model" and self.draft_cost is not None:
            self.draft_cost.observe(1, draft_seconds / depth)
