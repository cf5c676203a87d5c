"""Losslessness checks a user can run and see (``localspec check``).

(a) Toy checks, seconds in all:

* exact: for every lossless verifier, the one-step output distribution (drafting included,
  every random draw enumerated; numpy reference of the rule) continued by the target equals the
  target's own joint distribution to 1e-9 (:func:`localspec.verify.lossless.exact_error`);
* Monte Carlo: the C verifier's one-step outputs over N seeded steps against that exact
  joint, Pearson chi-square at significance ``alpha`` (a correct verifier fails with probability
  ``alpha``);
* a negative control: ``token`` with ``lenience=0.5`` (the lossy over-acceptance of Yin et al.)
  must be *detected* by both tests, which shows they can fail;
* the same exact and Monte Carlo checks with token masks ("masked" rows): a toy grammar
  (context -> one, two or all tokens) masks the target at every row, one drafter drafts under
  the mask and one ignores it, and the reference is plain constrained sampling; a second
  control - the masks are not given to the verifier - must be detected.

(b) The model pair: from a fixed prompt, N full speculative steps (draft + verify, plan fixed)
each record their first token; a one-sample chi-square compares the counts with the target's
exact next-token distribution after the same sampling transform (temperature, top-k, top-p,
min-p; :func:`localspec.verify.verifier.probs`, what the verifier and plain sampling use).

The chi-square test comes from :mod:`localspec.verify.stats` (no SciPy at run time).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from localspec.settings.generation import DEFAULTS, VERIFIERS, WITHOUT_REPLACEMENT, GenerationConfig
from localspec.settings.sampling import DEFAULT_SAMPLING, SamplingParams
from localspec.settings.shape import Shape
from localspec.verify import lossless, reference
from localspec.verify.lossless import ToyGrammar, ToyModel
from localspec.verify.stats import pearson_pvalue

log = logging.getLogger(__name__)

EXACT_TOLERANCE = 1e-9
CONTROL_MIN_ERROR = 1e-3  # the control's exact error must exceed this to count as detected
TOY_SAMPLES = 4000  # Monte Carlo steps per toy check
CONTROL_LENIENCE = 0.5
LOSSLESS_METHODS = tuple(m for m in VERIFIERS if m != "greedy")  # greedy is exact at T = 0 only

# exact checks: vocabulary 3, a near and a far draft, two sampling settings
_EXACT_TARGET = ToyModel(3, seed=1)
_EXACT_DRAFTS = (ToyModel(3, seed=2, base=_EXACT_TARGET, noise=1.0), ToyModel(3, seed=3))
_EXACT_SETTINGS = (SamplingParams(1.0), SamplingParams(0.7, top_k=2, top_p=0.9))
_EXACT_SHAPES = {"chain": Shape.chain(3), "paths": Shape.k_paths(2, 2), "tree": Shape.tree((2, 1))}
# Monte Carlo checks: vocabulary 4
_MC_TARGET = ToyModel(4, seed=41)
_MC_DRAFT = ToyModel(4, seed=42, base=_MC_TARGET, noise=1.0)
_MC_SETTINGS = SamplingParams(1.0, top_p=0.95)
_MC_SHAPES = _EXACT_SHAPES

# token masks: a toy grammar over each vocabulary (root: 2 of 3 tokens / 2 of 4 tokens allowed)
_EXACT_GRAMMAR = ToyGrammar(3, seed=1)
_EXACT_MASKED_DRAFTS = ((_EXACT_DRAFTS[0], True), (_EXACT_DRAFTS[1], False))  # (drafter, drafts under the mask?)
_MC_GRAMMAR = ToyGrammar(4, seed=3)

PAIR_PROMPT = "The best programming language is"
PAIR_DRAFT = 4  # draft tokens per step of the pair check (every step drafts them: plan fixed)
PAIR_SAMPLES = 200  # about 0.25 s a step on the default 1.5B/0.5B pair on 2 CPU cores (k=4): ~50 s


@dataclass(frozen=True)
class CheckResult:
    """One check: did it pass, its numbers, and a one-line explanation.

    For a negative control ``passed`` means the lossy rule was detected."""

    name: str
    passed: bool
    numbers: Mapping[str, float] = field(default_factory=dict)
    detail: str = ""
    control: bool = False


# ---------------------------------------------------------------- toy checks


def _exact_settings(method: str) -> tuple[SamplingParams, ...]:
    return (SamplingParams(0.0),) if method == "greedy" else _EXACT_SETTINGS


def exact_check(method: str, tolerance: float = EXACT_TOLERANCE, masked: bool = False) -> CheckResult:
    """Exact one-step output distribution of `method` vs the target's joint (numpy reference);
    masked: under the toy grammar, vs plain constrained sampling."""
    shape = _EXACT_SHAPES[lossless.SHAPES_BY_METHOD[method]]
    drafts = _EXACT_MASKED_DRAFTS if masked else tuple((d, True) for d in _EXACT_DRAFTS)
    grammar = _EXACT_GRAMMAR if masked else None
    error = max(lossless.exact_error(method, _EXACT_TARGET, d, shape, s, grammar=grammar, draft_masked=dm)
                for d, dm in drafts for s in _exact_settings(method))
    what = ("2 drafts (under the mask / ignoring it)" if masked else "2 drafts")
    return CheckResult(f"exact {method}" + (" masked" if masked else ""), error <= tolerance,
                       {"max_error": error, "tolerance": tolerance},
                       f"max |P(step) - P(target)| = {error:.1e} (tolerance {tolerance:.0e}); "
                       f"V=3{', toy grammar' if masked else ''}, {_describe(shape, method)}, {what} x "
                       f"{len(_exact_settings(method))} sampling settings")


def _describe(shape: Shape, method: str) -> str:
    return shape.describe() + (" w/o replacement" if method in WITHOUT_REPLACEMENT else "")


def monte_carlo_check(method: str, alpha: float, seed: int, n: int = TOY_SAMPLES,
                      masked: bool = False) -> CheckResult:
    """The C verifier's one-step outputs vs the exact target joint (Pearson chi-square); masked:
    the toy grammar's bitmasks passed to the verifier, the drafter drafting under them."""
    shape = _MC_SHAPES[lossless.SHAPES_BY_METHOD[method]]
    p = _toy_pvalue(method, shape, n, seed, None, _MC_GRAMMAR if masked else None)
    return CheckResult(f"chi-square {method}{' masked' if masked else ''} (C)", p > alpha,
                       {"p_value": p, "alpha": alpha, "samples": n},
                       f"p = {p:.3g} vs alpha {alpha:g}; {n} steps, V=4{', toy grammar' if masked else ''}, "
                       f"{_describe(shape, method)}, T=1 top-p 0.95")


def _toy_pvalue(method: str, shape: Shape, n: int, seed: int, step: Callable[..., tuple] | None,
                grammar: ToyGrammar | None = None) -> float:
    counts = lossless.monte_carlo_counts(method, _MC_TARGET, _MC_DRAFT, shape, _MC_SETTINGS, n, seed, step,
                                         grammar=grammar)
    joint = lossless.target_joint(_MC_TARGET, (), shape.depth + 1, _MC_SETTINGS, grammar)
    return pearson_pvalue(counts, joint)[2]


def negative_control(alpha: float, seed: int, n: int = TOY_SAMPLES,
                     lenience: float = CONTROL_LENIENCE) -> CheckResult:
    """`token` with lenience (lossy): detected when its exact error is large AND p < alpha."""

    def ref_step(method: str, tp: np.ndarray, dp: np.ndarray, tree: Any, rng: Any) -> tuple:
        return reference.verify("token", tp, dp, tree.tokens, tree.parents, rng, lenience)

    def c_step(method: str, logits: np.ndarray, dprobs: np.ndarray, tree: Any, s: int,
               settings: SamplingParams) -> tuple:
        return lossless.c_step("token", logits, dprobs, tree, s, settings, lenience=lenience)

    chain = _EXACT_SHAPES["chain"]
    error = max(lossless.exact_error("token", _EXACT_TARGET, d, chain, SamplingParams(1.0), step=ref_step)
                for d in _EXACT_DRAFTS)
    p = _toy_pvalue("token", _MC_SHAPES["chain"], n, seed, c_step)
    detected = error > CONTROL_MIN_ERROR and p < alpha
    return CheckResult("control: detected" if detected else "control: NOT detected", detected,
                       {"exact_error": error, "p_value": p, "alpha": alpha, "lenience": lenience, "samples": n},
                       f"lossy token verification (lenience {lenience:g}): exact error {error:.3f} "
                       f"(must exceed {CONTROL_MIN_ERROR:g}), chi-square p = {p:.3g} (must be < {alpha:g})",
                       control=True)


def mask_control(alpha: float, seed: int, n: int = TOY_SAMPLES, method: str = "traversal") -> CheckResult:
    """The verifier is not given the masks (the drafter drafts under them): detected when its
    exact error is large AND the C verifier's chi-square p < alpha."""
    shape = _EXACT_SHAPES[lossless.SHAPES_BY_METHOD[method]]
    settings = SamplingParams(1.0)

    def ref_step(m: str, tp: np.ndarray, dp: np.ndarray, tree: Any, rng: Any) -> tuple:
        unmasked = np.stack([lossless.target_distribution(_EXACT_TARGET, c, settings) for c in tree.contexts])
        return reference.verify(method, unmasked, dp, tree.tokens, tree.parents, rng)

    def c_step(m: str, logits: np.ndarray, dprobs: np.ndarray, tree: Any, s: int,
               sampling: SamplingParams) -> tuple:
        from localspec.verify import verifier

        v = verifier.verify(method, logits, dprobs.astype(np.float32), tree.tokens, tree.parents, seed=s,
                            sampling=sampling)  # masks deliberately left out
        return v.path, v.token

    error = max(lossless.exact_error(method, _EXACT_TARGET, d, shape, settings, step=ref_step,
                                     grammar=_EXACT_GRAMMAR, draft_masked=True) for d in _EXACT_DRAFTS)
    p = _toy_pvalue(method, _MC_SHAPES[lossless.SHAPES_BY_METHOD[method]], n, seed, c_step, _MC_GRAMMAR)
    detected = error > CONTROL_MIN_ERROR and p < alpha
    return CheckResult("control (masks dropped): " + ("detected" if detected else "NOT detected"), detected,
                       {"exact_error": error, "p_value": p, "alpha": alpha, "samples": n},
                       f"{method} verifying the unmasked target under a grammar: exact error {error:.3f} "
                       f"(must exceed {CONTROL_MIN_ERROR:g}), chi-square p = {p:.3g} (must be < {alpha:g})",
                       control=True)


def toy_suite(alpha: float, seed: int = 0, n: int = TOY_SAMPLES,
              progress: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Exact checks (every lossless method, greedy at T=0), C Monte Carlo checks, the negative
    control; then the same with token masks (a toy grammar) and the masks' negative control."""
    methods = ("greedy",) + LOSSLESS_METHODS
    jobs: list[Callable[[], CheckResult]] = [functools.partial(exact_check, m) for m in methods]
    jobs += [functools.partial(monte_carlo_check, m, alpha, seed + i, n) for i, m in enumerate(LOSSLESS_METHODS)]
    jobs.append(functools.partial(negative_control, alpha, seed, n))
    jobs += [functools.partial(exact_check, m, masked=True) for m in methods]
    k = len(LOSSLESS_METHODS)
    jobs += [functools.partial(monte_carlo_check, m, alpha, seed + k + i, n, masked=True)
             for i, m in enumerate(LOSSLESS_METHODS)]
    jobs.append(functools.partial(mask_control, alpha, seed, n))
    results = []
    for job in jobs:
        result = job()
        results.append(result)
        if progress is not None:
            progress(result)
    return results


# ---------------------------------------------------------------- the model pair


def target_next_token_probs(target: Any, prompt_tokens: Sequence[int], sampling: Any) -> np.ndarray:
    """The target's exact next-token distribution after the prompt, after the sampling transform."""
    from localspec.verify import verifier

    target.clear()
    target.prefill(list(prompt_tokens), 0)
    logits = np.array(target.logits_array(1)[0], dtype=np.float32)
    target.clear()
    return verifier.probs(logits, sampling=sampling)


def _step_seed(seed: int, i: int) -> int:
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, i]).generate_state(1, np.uint64)[0] >> 1)


def speculative_first_tokens(target: Any, draft: Any, prompt_tokens: Sequence[int], config: GenerationConfig,
                             samples: int, seed: int, progress: bool = False) -> tuple[Counter, int, int]:
    """(first-token counts, drafted, accepted) of `samples` full speculative steps from the prompt."""
    from dataclasses import replace

    from tqdm import tqdm

    from localspec.decoding.drafters import make_drafters
    from localspec.decoding.engine import Engine

    drafters = make_drafters(target, draft, replace(config, drafter="model"))
    counts: Counter = Counter()
    drafted = accepted = 0
    for i in tqdm(range(samples), file=sys.stderr, disable=not progress, desc="pair check", unit="step",
                  leave=False):
        engine = Engine(target, drafters, replace(config, seed=_step_seed(seed, i)))
        engine.start(prompt_tokens)
        new = engine.step()
        engine.finish()
        counts[new[0]] += 1
        stats = engine.stats()
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
    return counts, drafted, accepted


def pair_check(target: Any, draft: Any, *, samples: int = PAIR_SAMPLES, alpha: float = 1e-3, seed: int = 0,
               prompt: str = PAIR_PROMPT, verifier: str = DEFAULTS.verifier, num_draft_tokens: int = PAIR_DRAFT,
               sampling: SamplingParams = DEFAULT_SAMPLING, lenience: float = 0.0,
               progress: bool = False) -> CheckResult:
    """First token of N speculative steps (draft + verify) vs the target's exact next-token distribution.

    `lenience` > 0 makes the verification lossy (verifier `token`): for testing that this check fails."""
    from localspec.errors import ConfigError

    if draft is None:
        raise ConfigError("the model-pair check needs a draft model", "draft")
    if lenience > 0:
        verifier = "token"
    config = GenerationConfig(max_tokens=num_draft_tokens + 1, sampling=sampling, verifier=verifier,
                              shape=Shape.chain(num_draft_tokens), lenience=lenience, plan="fixed")
    tokens = target.tokenize(prompt, add_special=True, parse_special=False)
    probs = target_next_token_probs(target, tokens, sampling)
    counts, drafted, accepted = speculative_first_tokens(target, draft, tokens, config, samples, seed, progress)
    expected = {int(k): float(probs[k]) for k in np.flatnonzero(probs > 0)}
    stat, dof, p = pearson_pvalue(counts, expected)
    tv = 0.5 * sum(abs(counts.get(k, 0) / samples - expected.get(k, 0.0)) for k in set(counts) | set(expected))
    acceptance = accepted / drafted if drafted else 0.0
    lossy = f", LOSSY lenience {lenience:g}" if lenience > 0 else ""
    return CheckResult(
        f"pair first token ({verifier}, k={num_draft_tokens}{lossy})", p > alpha and drafted > 0,
        {"p_value": p, "alpha": alpha, "samples": samples, "chi2": stat, "dof": dof, "tv": tv,
         "acceptance": acceptance, "categories": len(expected)},
        f"p = {p:.3g} vs alpha {alpha:g}; {samples} steps, {len(expected)} tokens possible, TV {tv:.3f}, "
        f"acceptance {acceptance:.0%}; T={sampling.temperature:g} top-k {sampling.top_k} "
        f"top-p {sampling.top_p:g} min-p {sampling.min_p:g}, prompt {prompt!r}"
        + ("" if drafted else "; nothing was drafted, so speculation was not tested"))


# ---------------------------------------------------------------- report


def status(result: CheckResult) -> str:
    return "PASS" if result.passed else "FAIL"


def format_line(result: CheckResult) -> str:
    return f"{status(result):<4}  {result.name:<34} {result.detail}"


def false_positive_note(results: Sequence[CheckResult], alpha: float) -> str:
    """How often a correct implementation fails these statistical checks by chance."""
    stat = sum(1 for r in results if "p_value" in r.numbers and not r.control)
    return (f"alpha = {alpha:g}: each chi-square check fails a correct verifier with probability {alpha:g}; "
            f"with {stat} such checks here, a false alarm happens in at most {stat * alpha:.2%} of runs "
            f"(exact checks have no false alarms).")


__all__ = ["CheckResult", "PAIR_PROMPT", "PAIR_SAMPLES", "TOY_SAMPLES", "exact_check",
           "false_positive_note", "format_line", "mask_control", "monte_carlo_check", "negative_control", "pair_check",
           "speculative_first_tokens", "target_next_token_probs", "toy_suite"]
