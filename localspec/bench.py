"""Benchmark runs and reports: verifiers x draft shapes x temperatures against target-only decoding.

Every row is measured in the same process, on the same prompts and seeds, side by side with a
target-only baseline row of the same prompt set and temperature, so the speedup column compares
like with like (see DESIGN.md, "Metrics")::

    from localspec.bench import BenchSettings, builtin_prompts, parse_shape, run_bench, to_markdown

    settings = BenchSettings(verifiers=("block",), shapes=(parse_shape("k4"),), temperatures=(0.0,))
    results = run_bench(target, draft, builtin_prompts("code"), settings)
    print(to_markdown(results))

No click here: the ``bench`` command (localspec/commands/bench.py) turns errors into messages.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from localspec.engine import ConfigError, GenerationStats, SpecConfig, combine

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- prompts

PROMPT_SETS: dict[str, tuple[str, ...]] = {
    # fresh code: the draft must guess what comes next
    "code": (
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a Python class for a stack with push, pop and peek methods.",
        "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
        "Write a Python function that merges two sorted lists into one sorted list.",
    ),
    # free text: lower agreement between draft and target
    "prose": (
        "Explain in a short paragraph why the sky is blue.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Describe the water cycle to a ten-year-old.",
        "Give three tips for writing clear technical documentation.",
    ),
    # input-grounded: the answer largely repeats the prompt (n-gram drafting shines here)
    "code-edit": (
        "Add type hints to this function and return it unchanged otherwise:\n\n"
        "def scale(values, factor, offset=0):\n"
        "    result = []\n"
        "    for value in values:\n"
        "        result.append(value * factor + offset)\n"
        "    return result\n",
        "Rename the variable `tmp` to `total` in this code and show the whole code:\n\n"
        "def mean(numbers):\n"
        "    tmp = 0\n"
        "    for n in numbers:\n"
        "        tmp += n\n"
        "    return tmp / len(numbers) if numbers else 0.0\n",
        "Summarise this paragraph in two sentences, reusing its wording:\n\n"
        "Speculative decoding speeds up text generation by letting a small draft model propose "
        "several tokens, which the large target model then checks in a single forward pass. "
        "Tokens the target agrees with are kept; the first disagreement is replaced by a token "
        "drawn from a corrected distribution, so the output is distributed exactly as if the "
        "target had generated it alone.",
    ),
}
ALL = "all"


class BenchError(ValueError):
    """A benchmark input that cannot be used (the message names the option or file)."""


def builtin_prompts(name: str) -> dict[str, tuple[str, ...]]:
    """The built-in prompt set `name` (or every set for "all"), keyed by set name."""
    if name == ALL:
        return dict(PROMPT_SETS)
    if name not in PROMPT_SETS:
        raise BenchError(f"unknown prompt set {name!r}; choose one of {', '.join(PROMPT_SETS)}, {ALL}, "
                         "or give a file path")
    return {name: PROMPT_SETS[name]}


def load_prompt_file(path: str | Path) -> tuple[str, ...]:
    """Prompts from a file: a JSON list of strings, or one prompt per (non-empty) line."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise BenchError(f"prompt file {str(p)!r} does not exist (give code, prose, code-edit, all, "
                         "or the path of a file with one prompt per line or a JSON list of strings)")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"cannot read prompt file {str(p)!r}: {exc}") from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BenchError(f"prompt file {str(p)!r} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                             "give a JSON list of strings or one prompt per line") from None
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise BenchError(f"prompt file {str(p)!r} must hold a JSON list of strings")
        prompts = tuple(x for x in data if x.strip())
    else:
        prompts = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not prompts:
        raise BenchError(f"prompt file {str(p)!r} holds no prompts")
    return prompts


def load_prompts(spec: str) -> dict[str, tuple[str, ...]]:
    """Built-in set names (comma list, or "all"), or a file path (the set is then named after the file)."""
    names = [n.strip() for n in spec.split(",")]
    if all(n == ALL or n in PROMPT_SETS for n in names):
        return {k: v for n in names for k, v in builtin_prompts(n).items()}
    return {Path(spec).stem or spec: load_prompt_file(spec)}


# ---------------------------------------------------------------- draft shapes

_SHAPE_RE = re.compile(r"^(?:k(\d+)|p(\d+)k(\d+)|t(\d+(?:x\d+)*))$")
SHAPE_SYNTAX = ("kN (a chain of N draft tokens), pKkN (K paths of N tokens), "
                "tAxBx.. (a tree, A children at depth 1, ...)")


@dataclass(frozen=True)
class DraftShape:
    """What to draft per step: a chain, K independent paths, or a tree."""

    label: str
    num_draft_tokens: int
    paths: int = 1
    tree: tuple[int, ...] | None = None


def parse_shape(text: str) -> DraftShape:
    """"k4" -> chain of 4, "p3k4" -> 3 paths of 4, "t3x2x1" -> tree; ValueError if malformed."""
    label = text.strip().lower()
    m = _SHAPE_RE.match(label)
    if not m:
        raise ValueError(f"{text!r} is not a draft shape; use {SHAPE_SYNTAX}")
    if m.group(1) is not None:
        shape = DraftShape(label, int(m.group(1)))
    elif m.group(2) is not None:
        shape = DraftShape(label, int(m.group(3)), paths=int(m.group(2)))
    else:
        tree = tuple(int(b) for b in m.group(4).split("x"))
        shape = DraftShape(label, len(tree), tree=tree)
    if shape.num_draft_tokens < 1 or shape.paths < 1 or (shape.tree and min(shape.tree) < 1):
        raise ValueError(f"{text!r}: lengths, path counts and branching factors must be >= 1 "
                         "(the target-only baseline is always included)")
    return shape


# ---------------------------------------------------------------- configurations


@dataclass(frozen=True)
class BenchSettings:
    """The matrix to run and the sampling settings shared by every row."""

    verifiers: tuple[str, ...] = ("match", "token", "block")
    shapes: tuple[DraftShape, ...] = (DraftShape("k4", 4),)
    drafters: tuple[str, ...] = ("model",)
    temperatures: tuple[float, ...] = (0.0, 0.8)
    plan: str = "fixed"
    max_tokens: int = 64
    repeat: int = 1
    seed: int = 0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    chat: bool = True


@dataclass(frozen=True)
class BenchConfig:
    """One row: verifier None means target-only decoding (the baseline)."""

    verifier: str | None
    drafter: str | None
    shape: DraftShape | None
    plan: str
    temperature: float

    @property
    def baseline(self) -> bool:
        return self.verifier is None

    def generate_kwargs(self) -> dict:
        if self.shape is None:
            return dict(num_draft_tokens=0, tree=None, paths=1, verifier="block", drafter="model",
                        plan=self.plan)
        return dict(verifier=self.verifier, drafter=self.drafter, num_draft_tokens=self.shape.num_draft_tokens,
                    paths=self.shape.paths, tree=self.shape.tree, plan=self.plan)


def configurations(settings: BenchSettings, n_batch: int, temperature: float,
                   has_draft: bool) -> tuple[list[BenchConfig], list[str]]:
    """The valid speculative configurations at one temperature, and why the others were skipped."""
    valid: list[BenchConfig] = []
    skipped: list[str] = []
    for drafter in settings.drafters:
        for verifier in settings.verifiers:
            for shape in settings.shapes:
                what = f"{verifier}/{drafter}/{shape.label}"
                if verifier == "greedy" and temperature > 0:
                    skipped.append(f"{what} at T={temperature:g}: greedy verification is lossless at T=0 only")
                    continue
                if drafter in ("model", "hybrid") and not has_draft:
                    skipped.append(f"{what}: the {drafter} drafter needs a draft model")
                    continue
                spec = SpecConfig(verifier=verifier, num_draft_tokens=shape.num_draft_tokens,
                                  paths=shape.paths, tree=shape.tree, plan=settings.plan)
                try:
                    spec.validate(drafter, n_batch)
                except ConfigError as exc:
                    skipped.append(f"{what}: {exc}")
                    continue
                valid.append(BenchConfig(verifier, drafter, shape, settings.plan, temperature))
    return valid, skipped


def plan_matrix(settings: BenchSettings, n_batch: int, has_draft: bool) -> tuple[list[BenchConfig], list[str]]:
    """Baseline + valid configurations for every temperature (in run order), and the skip notes."""
    rows: list[BenchConfig] = []
    notes: list[str] = []
    for t in settings.temperatures:
        valid, skipped = configurations(settings, n_batch, t, has_draft)
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
    for r in stream_generate(target, None if config.baseline else draft, prompt, max_tokens=max_tokens,
                             temperature=config.temperature, top_k=settings.top_k, top_p=settings.top_p,
                             min_p=settings.min_p, seed=seed, **config.generate_kwargs()):
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
    rows, notes = plan_matrix(settings, target.n_batch, draft is not None)
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
    """Speedup bars per configuration, grouped by prompt set, one panel per temperature (PNG)."""
    import matplotlib

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
    for ax, t in zip(axes[:, 0], temps):
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


__all__ = ["ALL", "PROMPT_SETS", "SHAPE_SYNTAX", "BenchConfig", "BenchError", "BenchResult", "BenchSettings",
           "DraftShape", "builtin_prompts", "configurations", "load_prompt_file", "load_prompts",
           "parse_shape", "plan_matrix", "plot", "run_bench", "to_json", "to_markdown"]
