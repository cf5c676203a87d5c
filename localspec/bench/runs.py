"""Benchmark runs and reports: verifiers x draft shapes x temperatures against target-only decoding.

Every row is measured in the same process, on the same prompts and seeds, side by side with a
target-only baseline row of the same prompt set and temperature, so the speedup column compares
like with like (see docs/design.md, "Metrics")::

    from localspec.bench.runs import BenchSettings, run_bench, to_markdown
    from localspec.settings.shape import Shape
    from localspec.bench.prompts import builtin_prompts

    settings = BenchSettings(verifiers=("block",), shapes=(Shape.parse("k4"),), temperatures=(0.0,))
    results = run_bench(target, draft, builtin_prompts("code"), settings)
    print(to_markdown(results))

No click here: the ``bench`` command (localspec/cli/bench.py) turns errors into messages.
Prompt sets live in :mod:`localspec.bench.prompts`.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from localspec.decoding.stats import GenerationStats, combine
from localspec.errors import BenchError, ConfigError, DependencyError
from localspec.settings.generation import GenerationConfig
from localspec.settings.sampling import DEFAULT_SAMPLING, SamplingParams
from localspec.settings.shape import Shape

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- configurations


@dataclass(frozen=True)
class BenchSettings:
    """The matrix to run and the sampling settings shared by every row."""

    verifiers: tuple[str, ...] = ("match", "token", "block")
    shapes: tuple[Shape, ...] = (Shape.chain(4),)
    drafters: tuple[str, ...] = ("model",)
    temperatures: tuple[float, ...] = (0.0, 0.8)
    plan: str = "fixed"
    max_tokens: int = 64
    repeat: int = 1
    seed: int = 0
    sampling: SamplingParams = DEFAULT_SAMPLING  # top-k, top-p, min-p; the temperature is per row
    chat: bool = True


@dataclass(frozen=True)
class BenchConfig:
    """One row: verifier None means target-only decoding (the baseline)."""

    verifier: str | None
    drafter: str | None
    shape: Shape | None
    plan: str
    temperature: float

    @property
    def baseline(self) -> bool:
        return self.verifier is None

    def generation(self, settings: BenchSettings, seed: int, max_tokens: int) -> GenerationConfig:
        """The GenerationConfig of this row for one prompt."""
        sampling = replace(settings.sampling, temperature=self.temperature)
        if self.baseline:
            return GenerationConfig(max_tokens=max_tokens, sampling=sampling, seed=seed, shape=Shape(0),
                                    plan=self.plan)
        assert self.verifier is not None and self.drafter is not None and self.shape is not None
        return GenerationConfig(max_tokens=max_tokens, sampling=sampling, seed=seed, verifier=self.verifier,
                                shape=self.shape, drafter=self.drafter, plan=self.plan)


def configurations(settings: BenchSettings, limits: tuple[int, int], temperature: float,
                   has_draft: bool) -> tuple[list[BenchConfig], list[str]]:
    """The valid speculative configurations at one temperature, and why the others were skipped."""
    valid: list[BenchConfig] = []
    skipped: list[str] = []
    for drafter in settings.drafters:
        for verifier in settings.verifiers:
            for shape in settings.shapes:
                what = f"{verifier}/{drafter}/{shape.label}"
                row = BenchConfig(verifier, drafter, shape, settings.plan, temperature)
                if verifier == "greedy" and temperature > 0:
                    skipped.append(f"{what} at T={temperature:g}: greedy verification is lossless at T=0 only")
                    continue
                if drafter in ("model", "hybrid") and not has_draft:
                    skipped.append(f"{what}: the {drafter} drafter needs a draft model")
                    continue
                try:
                    row.generation(settings, 0, settings.max_tokens).check_fits(*limits)
                except ConfigError as exc:
                    skipped.append(f"{what}: {exc}")
                    continue
                valid.append(row)
    return valid, skipped


def run_matrix(settings: BenchSettings, limits: tuple[int, int],
               has_draft: bool) -> tuple[list[BenchConfig], list[str]]:
    """Baseline + valid configurations for every temperature (in run order), and the skip notes.
    `limits`: the target's (n_batch, n_seq_max)."""
    rows: list[BenchConfig] = []
    notes: list[str] = []
    for t in settings.temperatures:
        valid, skipped = configurations(settings, limits, t, has_draft)
        rows.append(BenchConfig(None, None, None, settings.plan, t))
        rows += valid
        notes += [s for s in skipped if s not in notes]
    if not any(not r.baseline for r in rows):
        raise BenchError("no valid speculative configuration: " + "; ".join(notes))
    return rows, notes


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class BenchResult:
    """One row of the table: a configuration measured over one prompt set."""

    prompts: str
    temperature: float
    verifier: str  # "target only" for the baseline
    drafter: str
    shape: str
    plan: str
    baseline: bool
    tokens_per_second: float
    speedup: float
    block_efficiency: float
    acceptance_rate: float
    verifier_share: float
    generated_tokens: int
    generation_seconds: float
    target_passes: int
    drafted_tokens: int
    accepted_tokens: int
    generations: int


def _result(name: str, config: BenchConfig, runs: Sequence[GenerationStats], baseline_tps: float) -> BenchResult:
    t = combine(runs)
    shape = config.shape
    return BenchResult(
        prompts=name, temperature=config.temperature,
        verifier="target only" if config.baseline else str(config.verifier),
        drafter="-" if config.baseline else str(config.drafter),
        shape="-" if shape is None else shape.label,
        plan="-" if config.baseline else config.plan, baseline=config.baseline,
        tokens_per_second=t.tokens_per_second,
        speedup=t.tokens_per_second / baseline_tps if baseline_tps > 0 else 0.0,
        block_efficiency=t.block_efficiency, acceptance_rate=t.acceptance_rate, verifier_share=t.verifier_share,
        generated_tokens=t.generated_tokens, generation_seconds=t.elapsed_seconds, target_passes=t.target_passes,
        drafted_tokens=t.drafted_tokens, accepted_tokens=t.accepted_tokens, generations=len(runs))


# ---------------------------------------------------------------- running


def _message(target: Any, prompt: str, chat: bool) -> Any:
    if chat and target.chat_template:
        return [{"role": "user", "content": prompt}]
    return prompt


def _generate_stats(target: Any, draft: Any, prompt: Any, config: BenchConfig, settings: BenchSettings,
                    seed: int, max_tokens: int) -> GenerationStats:
    """One generation; its final statistics."""
    from localspec.api import stream_generate

    last = None
    for r in stream_generate(target, None if config.baseline else draft, prompt,
                             config.generation(settings, seed, max_tokens)):
        last = r
    if last is None:  # stream_generate yields at least one response; keep the type checker honest
        raise BenchError("a generation produced no output")
    return last.stats


def _measure(target: Any, draft: Any, prompts: Sequence[str], config: BenchConfig, settings: BenchSettings,
             bar: Any) -> list[GenerationStats]:
    runs = []
    for r in range(settings.repeat):
        for i, prompt in enumerate(prompts):
            seed = settings.seed + 1000 * r + i  # the same seeds for every row
            runs.append(_generate_stats(target, draft, _message(target, prompt, settings.chat), config,
                                        settings, seed, settings.max_tokens))
            bar.update(1)
    return runs


def _warm_up(target: Any, draft: Any, prompt: str, rows: Sequence[BenchConfig], settings: BenchSettings) -> None:
    """Short untimed generations: the baseline and the first speculative row (caches, planner costs)."""
    message = _message(target, prompt, settings.chat)
    for config in (rows[0], next(r for r in rows if not r.baseline)):
        _generate_stats(target, draft, message, config, settings, settings.seed, min(8, settings.max_tokens))


def run_bench(target: Any, draft: Any, prompt_sets: Mapping[str, Sequence[str]], settings: BenchSettings,
              progress: bool = True) -> list[BenchResult]:
    """Measure every configuration with its target-only baseline, for every prompt set and temperature."""
    from tqdm import tqdm

    if settings.repeat < 1 or settings.max_tokens < 1:
        raise BenchError("repeat and max_tokens must be >= 1")
    if not prompt_sets or not all(prompt_sets.values()):
        raise BenchError("no prompts to run")
    rows, notes = run_matrix(settings, limits(target), draft is not None)
    for note in notes:
        log.info("skipped %s", note)
    per_row = settings.repeat * sum(len(p) for p in prompt_sets.values())
    results: list[BenchResult] = []
    with tqdm(total=per_row * len(rows), file=sys.stderr, disable=not progress, unit="gen",
              desc="bench", leave=False) as bar:
        _warm_up(target, draft, next(iter(prompt_sets.values()))[0], rows, settings)
        for name, prompts in prompt_sets.items():
            baseline_tps = 0.0
            for config in rows:
                bar.set_postfix_str(f"{name} T={config.temperature:g} "
                                    f"{'target only' if config.baseline else config.verifier}")
                runs = _measure(target, draft, prompts, config, settings, bar)
                if config.baseline:
                    baseline_tps = combine(runs).tokens_per_second
                results.append(_result(name, config, runs, baseline_tps))
    return results


# ---------------------------------------------------------------- reports

COLUMNS = ("prompts", "T", "verifier", "drafter", "shape", "plan", "tok/s", "speedup", "block eff.",
           "acceptance", "verifier %")


def _cells(r: BenchResult) -> list[str]:
    return [r.prompts, f"{r.temperature:g}", r.verifier, r.drafter, r.shape, r.plan,
            f"{r.tokens_per_second:.1f}", f"{r.speedup:.2f}x", f"{r.block_efficiency:.2f}",
            "-" if r.baseline else f"{r.acceptance_rate:.1%}", f"{r.verifier_share:.1%}"]


def to_markdown(results: Sequence[BenchResult]) -> str:
    """One markdown table, a row per result, the baseline first in each group."""
    lines = ["| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---:" if c in ("T", "tok/s", "speedup", "block eff.", "acceptance", "verifier %")
                            else "---" for c in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in results]
    return "\n".join(lines)


def limits(target: Any) -> tuple[int, int]:
    """What a draft must fit in: the target's (n_batch, n_seq_max)."""
    return target.n_batch, target.options.n_seq_max


def settings_dict(settings: BenchSettings) -> dict:
    data = asdict(settings)
    data["shapes"] = [s.label for s in settings.shapes]
    return data


def to_json(results: Sequence[BenchResult], settings: BenchSettings | None = None,
            extra: Mapping[str, Any] | None = None) -> str:
    """{"settings": ..., "results": [one object per row]} as indented JSON."""
    data: dict[str, Any] = {"settings": settings_dict(settings) if settings else None}
    data.update(extra or {})
    data["results"] = [asdict(r) for r in results]
    return json.dumps(data, indent=2)


def config_label(r: BenchResult) -> str:
    label = f"{r.verifier}/{r.drafter}/{r.shape}"
    return label if r.plan == "fixed" else f"{label} ({r.plan})"


def plot(results: Sequence[BenchResult], path: str | Path) -> Path:
    """Speedup bars per configuration, grouped by prompt set, one panel per temperature (PNG).
    Needs matplotlib (the extra localspec[plot])."""
    try:
        import matplotlib
    except ImportError:
        raise DependencyError("plotting needs matplotlib: pip install 'localspec[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    temps = sorted({r.temperature for r in results})
    sets = list(dict.fromkeys(r.prompts for r in results))
    labels = list(dict.fromkeys(config_label(r) for r in results if not r.baseline))
    width = 0.8 / max(len(labels), 1)
    fig_width = max(7.0, min(16.0, 2.0 + 0.3 * len(sets) * max(len(labels), 1)))
    legend_rows = (len(labels) + 1 + 3) // 4
    fig, axes = plt.subplots(len(temps), 1, figsize=(fig_width, 3.0 * len(temps) + 0.3 * legend_rows + 0.4),
                             squeeze=False)
    colors = plt.get_cmap("tab20" if len(labels) > 10 else "tab10")
    for ax, t in zip(axes[:, 0], temps, strict=True):
        for j, label in enumerate(labels):
            xs, ys = [], []
            for i, name in enumerate(sets):
                row = next((r for r in results if r.temperature == t and r.prompts == name
                            and not r.baseline and config_label(r) == label), None)
                if row is not None:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(row.speedup)
            ax.bar(xs, ys, width, label=label, color=colors(j % colors.N))
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="target only")
        ax.set_xticks(range(len(sets)), sets)
        ax.set_ylim(0, 1.12 * max([1.0] + [r.speedup for r in results if r.temperature == t]))
        ax.set_title(f"T = {t:g}")
        ax.set_ylabel("speedup vs target only")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(4, len(names)), fontsize="small")
    fig.tight_layout(rect=(0, (0.3 * legend_rows + 0.2) / fig.get_figheight(), 1, 1))
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path


__all__ = ["BenchConfig", "BenchError", "BenchResult", "BenchSettings", "configurations", "limits",
           "run_matrix", "plot", "run_bench", "to_json", "to_markdown"]
