"""Greedy outputs computed with different batch shapes agree up to a near-tie.

llama.cpp's CPU kernels give a token's logits that differ in the last bits between batch shapes
(native AVX-512 builds: rows of n <= 3 tokens and blocks of 4 take different code paths), so a
greedy speculative run (the target scores 1 + k tokens per pass) and the target alone (1 token
per pass) may pick different tokens where the target's two best logits (nearly) tie. What is
guaranteed, and what these helpers assert: the outputs are equal up to their first difference,
and there the token each run chose is within NEAR_TIE of the target's best logit. A real bug
(a wrong row, a wrong verifier) gives a difference of whole logits, far beyond NEAR_TIE.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from localspec.api import stream_generate
from localspec.llama.model import Model
from localspec.prompt import prompt_tokens

NEAR_TIE = 1e-3  # logits; batch-shape noise on the tiny F32 models is ~1e-5
NOISE_MARGIN = 4.0  # a near-tie: two logits each off by the noise, and positions the measure did not see
CHAINS = (2, 4, 8, 16)  # pass sizes whose first row batch_noise compares with a single token's


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where a and b differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def next_token_logits(target: Model, context: Sequence[int]) -> np.ndarray:
    """The target's logits after `context` (decoded afresh; the KV cache is cleared around it)."""
    target.clear()
    target.prefill(list(context), 0)
    row = np.array(target.logits_array(1)[0], dtype=np.float64)
    target.clear()
    return row


def row_difference(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference of two rows of logits."""
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def _row_after(target: Model, context: Sequence[int], extra: Sequence[int], beside: Sequence[int]) -> np.ndarray:
    """The logits after `context`, its last token decoded with `extra` tokens after it (a draft) and
    `beside` tokens of another slot in the same decode."""
    from localspec.llama.sequence import Part

    target.clear()
    target.prefill(list(context[:-1]), 0)
    n = len(context) - 1
    parts = [Part([context[-1], *extra], range(n, n + 1 + len(extra)), [(0,)] * (1 + len(extra)), "all")]
    if beside:
        other = target.sequences[-1].base
        parts.append(Part(list(beside), range(len(beside)), [(other,)] * len(beside), "all"))
    target.decode_parts(parts)
    row = np.array(target.logits_array(1, parts[0].first_row)[0], dtype=np.float64)
    target.clear()
    return row


def batch_noise(target: Model, context: Sequence[int], positions: int = 3) -> float:
    """How much this build's logits of a token change with the batch it is decoded in: the
    largest difference between its row decoded alone and inside a draft's pass (CHAINS) or beside
    another slot's tokens, over a few positions of `context`. 0.0: the build's logits are
    batch-independent here (F32 KV cache, flash attention off, kernels that do not tile by batch)."""
    worst = 0.0
    for end in np.linspace(len(context) // 2, len(context), positions, dtype=int):
        ctx = list(context[: max(int(end), 2)])
        alone = _row_after(target, ctx, (), ())
        for n in CHAINS:
            worst = max(worst, row_difference(alone, _row_after(target, ctx, ctx[1:n], ())))
        if target.n_slots > 1:
            worst = max(worst, row_difference(alone, _row_after(target, ctx, (), ctx[:8])))
    return worst


def near_tie(noise: float) -> float:
    """The tolerance of assert_near_tie on a build with this batch noise (0: exact equality)."""
    return NOISE_MARGIN * noise


def assert_near_tie(target: Model, context: Sequence[int], a: int, b: int, what: str, tol: float = NEAR_TIE) -> None:
    logits = next_token_logits(target, context)
    top = logits.max()
    gaps = (top - logits[a], top - logits[b])
    assert max(gaps) <= tol, (f"{what}: tokens {a} and {b} after {len(context)} tokens; their logits are "
                              f"{gaps[0]:.3g} and {gaps[1]:.3g} below the best (a near-tie is <= {tol})")


def assert_greedy_equal(target: Model, prompt: Any, got: Sequence[int], want: Sequence[int],
                        what: str = "greedy outputs differ", tol: float = NEAR_TIE) -> None:
    """Token lists from two greedy runs of `prompt` agree up to a near-tie (see the module)."""
    i = first_difference(got, want)
    if i is None:
        return
    assert i < min(len(got), len(want)), f"{what}: one output stops early at token {i}: {got} vs {want}"
    assert_near_tie(target, prompt_tokens(target, prompt) + list(want[:i]), got[i], want[i], what, tol)


def greedy_tokens(target: Model, prompt: Any, **kw: Any) -> list[tuple[int, str]]:
    """(token, text) of each token of the target's own greedy output."""
    return [(r.token, r.text) for r in stream_generate(target, None, prompt, temperature=0, **kw)
            if r.token is not None]


def assert_greedy_text(target: Model, prompt: Any, got: str, max_tokens: int, what: str = "greedy text differs",
                       **kw: Any) -> None:
    """Text a greedy run printed equals the target's own greedy text, or differs first where the
    target's two best tokens nearly tie."""
    pieces = greedy_tokens(target, prompt, max_tokens=max_tokens, **kw)
    want = "".join(text for _, text in pieces)
    if got == want:
        return
    at = next((k for k, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    done = 0
    for i, (token, text) in enumerate(pieces):
        done += len(text)
        if done > at or i == len(pieces) - 1:
            context = prompt_tokens(target, prompt) + [t for t, _ in pieces[:i]]
            logits = next_token_logits(target, context)
            gap = logits.max() - np.sort(logits)[-2]
            assert gap <= NEAR_TIE, (f"{what} at character {at} (token {i}), where the target's best token "
                                     f"leads by {gap:.3g} (not a near-tie):\n{got!r}\n{want!r}")
            return
