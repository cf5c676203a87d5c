"""The plain sampler's settings (:class:`SamplingParams`) and the ones users get by default
(:data:`DEFAULT_SAMPLING`: llama.cpp's). A leaf: the standard library and the shared checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

from localspec.settings.validation import INT32_MAX, as_float, as_int, is_int, is_number, require, show

MIN_TEMPERATURE = 1e-4  # below, logits / temperature overflows float32: use 0 (greedy)
MAX_TEMPERATURE = 1e6
MIN_PROBABILITY = 2.0**-126  # smallest top_p and min_p > 0: the smallest normal float32 (C's FLT_MIN)

@dataclass(frozen=True)
class SamplingParams:
    """The plain sampler's settings. The verifier transforms the target exactly as plain sampling
    does: top-k, then top-p, then min-p on the temperature-1 distribution, then temperature."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", as_float(self.temperature))
        object.__setattr__(self, "top_k", as_int(self.top_k))
        object.__setattr__(self, "top_p", as_float(self.top_p))
        object.__setattr__(self, "min_p", as_float(self.min_p))
        # the ranges of the C verifier, which holds these as float32 (native/verifier.h: ls_sampling)
        t, p = self.temperature, self.min_p
        require(is_number(t) and math.isfinite(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
                "temperature", f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                                f"{MAX_TEMPERATURE:g}], got {show(t)}")
        require(is_int(self.top_k) and 0 <= self.top_k <= INT32_MAX, "top_k",
                f"top_k must be an integer in [0, {INT32_MAX}] (0: off), got {show(self.top_k)}")
        require(is_number(self.top_p) and MIN_PROBABILITY <= self.top_p <= 1, "top_p",
                f"top_p must lie in (0, 1] (1: off) and be at least 2**-126 (about 1.2e-38, the smallest normal "
                f"float32: the sampler computes in float32), got {show(self.top_p)}")
        require(is_number(p) and (p == 0 or MIN_PROBABILITY <= p <= 1), "min_p",
                f"min_p must lie in [0, 1] (0: off) and be 0 or at least 2**-126 (about 1.2e-38, the smallest "
                f"normal float32: the sampler computes in float32), got {show(p)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


DEFAULT_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)  # llama.cpp's defaults
