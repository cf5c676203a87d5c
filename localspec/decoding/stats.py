"""What one generation did (:class:`GenerationStats`), and several taken together (:func:`combine`).

A leaf (the standard library only): the engine makes these, and a ``localspec`` client rebuilds
them from what a resident service sent (:meth:`GenerationStats.from_json`) to print ``-u`` and
chat's ``/stats`` exactly as a call in its own process does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

TYPE_CHECKING = False  # no typing at run time: the `localspec` client imports this module
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any


@dataclass(frozen=True)
class GenerationStats:
    """Running statistics of one generation (a snapshot)."""

    prompt_tokens: int
    generated_tokens: int
    target_passes: int
    drafted_tokens: int
    accepted_tokens: int
    prompt_seconds: float
    elapsed_seconds: float
    draft_seconds: float
    target_seconds: float
    verify_seconds: float
    accept_histogram: tuple[int, ...]
    # tokens accepted per kind of draft ("forced", "ngram:…", "model:…"), sorted by kind
    accepted_by_kind: tuple[tuple[str, int], ...] = ()
    constraint_seconds: float = 0.0  # in the grammar: masks, forced tokens, following the committed tokens
    cached_tokens: int = 0  # prompt tokens the KV cache held already (an earlier prompt's, or restored)
    # steps whose draft depth was capped below num_draft_tokens, by reason (localspec.decoding.depth.LIMITS:
    # "context", "max_tokens", "batch"), sorted by reason; the planner's own choice is not counted
    depth_limits: tuple[tuple[str, int], ...] = ()

    @property
    def block_efficiency(self) -> float:
        """Generated tokens per target forward pass (the papers' metric)."""
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def verifier_share(self) -> float:
        busy = self.draft_seconds + self.target_seconds + self.verify_seconds
        return self.verify_seconds / busy if busy > 0 else 0.0

    def as_dict(self) -> dict:
        """The statistics programs read (the CLI's --json `stats`, the server's `speculative`)."""
        return {"generated_tokens": self.generated_tokens, "tokens_per_second": self.tokens_per_second,
                "elapsed_seconds": self.elapsed_seconds, "block_efficiency": self.block_efficiency,
                "acceptance_rate": self.acceptance_rate, "target_passes": self.target_passes,
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "accept_histogram": list(self.accept_histogram), "verifier_share": self.verifier_share,
                "accepted_by_kind": dict(self.accepted_by_kind), "constraint_seconds": self.constraint_seconds,
                "cached_tokens": self.cached_tokens, "depth_limits": dict(self.depth_limits),
                "draft_seconds": self.draft_seconds, "target_seconds": self.target_seconds,
                "verify_seconds": self.verify_seconds}

    def timings(self) -> dict:
        """llama-server's ``timings`` object of this generation, its names and units (its
        ``result_timings``): ``cache_n`` prompt tokens the KV cache held already, ``prompt_n`` those
        processed, in ``prompt_ms`` milliseconds; ``predicted_n`` tokens generated in
        ``predicted_ms``; per token (ms) and per second of each; ``draft_n`` tokens drafted and
        ``draft_n_accepted`` of them accepted, only when something was drafted (as llama-server).
        A rate over no tokens or no time is 0.0 (JSON carries no infinity)."""
        prompt_n = self.prompt_tokens - self.cached_tokens
        prompt_ms, predicted_ms = 1e3 * self.prompt_seconds, 1e3 * self.elapsed_seconds
        out: dict[str, Any] = {
            "cache_n": self.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": _ratio(prompt_ms, prompt_n), "prompt_per_second": _ratio(1e3 * prompt_n, prompt_ms),
            "predicted_n": self.generated_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": _ratio(predicted_ms, self.generated_tokens),
            "predicted_per_second": _ratio(1e3 * self.generated_tokens, predicted_ms)}
        if self.drafted_tokens > 0:
            out.update(draft_n=self.drafted_tokens, draft_n_accepted=self.accepted_tokens)
        return out

    def to_json(self) -> dict:
        """Every field as JSON values (from_json reads it back exactly)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> GenerationStats:
        """The statistics of to_json; ValueError when `data` is not such an object."""
        if not isinstance(data, dict) or set(data) != {f.name for f in fields(cls)}:
            raise ValueError("not the fields of GenerationStats")
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = data[f.name]
            if f.name == "accept_histogram":
                value = tuple(_count(v) for v in _items(value))
            elif f.name in ("accepted_by_kind", "depth_limits"):
                value = tuple(_pair(v) for v in _items(value))
            elif f.type == "int":
                value = _count(value)
            elif not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{f.name} is not a number of seconds")
            values[f.name] = value
        return cls(**values)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _items(value: Any) -> list:
    if not isinstance(value, (list, tuple)):
        raise ValueError("not an array")
    return list(value)


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError("not a count")
    return value


def _pair(value: Any) -> tuple[str, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str)):
        raise ValueError("not a (name, count) pair")
    return value[0], _count(value[1])


def combine(stats: Sequence[GenerationStats]) -> GenerationStats:
    """The statistics of several generations taken together (sums; histograms added bin by bin),
    so rates and shares of a session or a benchmark row come from the same properties."""
    hist = [0] * max((len(s.accept_histogram) for s in stats), default=0)
    by_kind: dict[str, int] = {}
    limits: dict[str, int] = {}
    for s in stats:
        for n, count in enumerate(s.accept_histogram):
            hist[n] += count
        for kind, count in s.accepted_by_kind:
            by_kind[kind] = by_kind.get(kind, 0) + count
        for reason, count in s.depth_limits:
            limits[reason] = limits.get(reason, 0) + count
    return GenerationStats(
        sum(s.prompt_tokens for s in stats), sum(s.generated_tokens for s in stats),
        sum(s.target_passes for s in stats), sum(s.drafted_tokens for s in stats),
        sum(s.accepted_tokens for s in stats), sum(s.prompt_seconds for s in stats),
        sum(s.elapsed_seconds for s in stats), sum(s.draft_seconds for s in stats),
        sum(s.target_seconds for s in stats), sum(s.verify_seconds for s in stats), tuple(hist),
        tuple(sorted(by_kind.items())), sum(s.constraint_seconds for s in stats),
        sum(s.cached_tokens for s in stats), tuple(sorted(limits.items())))
