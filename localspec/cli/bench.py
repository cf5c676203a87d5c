"""``localspec bench``: verifiers x draft shapes x temperatures, side by side with target-only decoding."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from localspec.cli.options import Flags, model_options, user_errors
from localspec.errors import ConfigError
from localspec.loading import load_pair
from localspec.settings.generation import DRAFTERS, PLANS, VERIFIERS
from localspec.settings.sampling import DEFAULT_SAMPLING, SamplingParams
from localspec.settings.shape import Shape

log = logging.getLogger(__name__)


def _items(value: str, param: str) -> list[str]:
    items = [x.strip() for x in value.split(",")]
    if not value.strip() or any(not x for x in items):
        raise click.BadParameter(f"{value!r} is not a comma-separated list (an item is empty)", param_hint=param)
    return list(dict.fromkeys(items))


def _choices(allowed: Sequence[str], param: str) -> Callable[[click.Context, click.Parameter, str], tuple]:
    def callback(ctx: click.Context, _: click.Parameter, value: str) -> tuple[str, ...]:
        items = _items(value, param)
        for item in items:
            if item not in allowed:
                raise click.BadParameter(f"unknown item {item!r}; choose from {', '.join(allowed)}",
                                         param_hint=param)
        return tuple(items)
    return callback


def _shapes(ctx: click.Context, _: click.Parameter, value: str) -> tuple:
    shapes = []
    for item in _items(value, "--shapes"):
        try:
            shape = Shape.parse(item)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--shapes") from None
        if shape.depth < 1:
            raise click.BadParameter(f"{item!r}: a draft needs at least one token (the target-only baseline "
                                     "is always included)", param_hint="--shapes")
        shapes.append(shape)
    return tuple(shapes)


def _temperatures(ctx: click.Context, _: click.Parameter, value: str) -> tuple[float, ...]:
    out = []
    for item in _items(value, "--temperatures"):
        try:
            t = float(item)
        except ValueError:
            raise click.BadParameter(f"item {item!r} is not a number", param_hint="--temperatures") from None
        if not t >= 0 or t == float("inf"):
            raise click.BadParameter(f"item {item!r} must be a finite number >= 0", param_hint="--temperatures")
        out.append(t)
    return tuple(dict.fromkeys(out))


def _prompts(ctx: click.Context, _: click.Parameter, value: str) -> dict:
    from localspec.bench.prompts import load_prompts

    try:
        return load_prompts(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--prompts") from None


@click.command()
@model_options
@click.option("--verifiers", default="match,token,block", show_default=True,
              callback=_choices(VERIFIERS, "--verifiers"),
              help=f"Comma list of verification rules ({', '.join(VERIFIERS)}).")
@click.option("--shapes", default="k4", show_default=True, callback=_shapes,
              help="Comma list of draft shapes: kN = a chain of N draft tokens; pKkN = K paths of N tokens "
                   "(gbv, batch); tAxBx.. = a tree with A children at depth 1, B at depth 2, ... "
                   "(rrs, rrsw, traversal). E.g. k4,k8,p3k4,t3x2x1.")
@click.option("--drafters", default="model", show_default=True, callback=_choices(DRAFTERS, "--drafters"),
              help=f"Comma list of drafters ({', '.join(DRAFTERS)}).")
@click.option("--temperatures", default="0,0.8", show_default=True, callback=_temperatures,
              help="Comma list of sampling temperatures (0: greedy).")
@click.option("--prompts", "prompt_sets", default="code", show_default=True, callback=_prompts,
              metavar="SET|FILE",
              help="Prompt sets: code, prose, code-edit (the answer repeats the prompt), a comma list "
                   "of them, all, or a file (one prompt per line, or a JSON list of strings).")
@click.option("-n", "--max-tokens", type=click.IntRange(1), default=64, show_default=True,
              help="Tokens to generate per prompt.")
@click.option("--plan", type=click.Choice(PLANS), default="fixed", show_default=True,
              help="fixed: always draft the full shape (measures the shape itself); auto: let the planner "
                   "choose each step's depth.")
@click.option("--repeat", type=click.IntRange(1), default=1, show_default=True,
              help="Run every prompt this many times (different seeds) per row.")
@click.option("--top-k", type=int, default=DEFAULT_SAMPLING.top_k, show_default=True, help="Top-k (0: off).")
@click.option("--top-p", type=float, default=DEFAULT_SAMPLING.top_p, show_default=True, help="Top-p (1: off).")
@click.option("--min-p", type=float, default=DEFAULT_SAMPLING.min_p, show_default=True, help="Min-p (0: off).")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="Base seed: prompt i of repeat r uses seed + 1000*r + i in every row.")
@click.option("--chat/--raw", "chat", default=True, show_default=True,
              help="Wrap each prompt in the model's chat template (when it has one).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("localspec-bench"),
              show_default=True, help="Directory for bench.json and bench.png (created if needed).")
@user_errors
def bench(model: str | None, draft: str | None, verifiers: tuple[str, ...], shapes: tuple, drafters: tuple[str, ...],
          temperatures: tuple[float, ...], prompt_sets: dict, max_tokens: int, plan: str, repeat: int,
          top_k: int, top_p: float, min_p: float, seed: int, chat: bool, out: Path, **options: Any) -> None:
    """Benchmark verifiers x draft shapes x temperatures against the target alone.

    Every row runs the same prompts with the same seeds; each prompt set and
    temperature gets its own target-only baseline row, measured in the same
    run, and speedup is tok/s against that row. tok/s counts generated tokens
    over generation time (prompt processing excluded). The markdown table
    goes to stdout; bench.json and bench.png to --out (paths on stderr).
    Combinations a verifier cannot take (a tree for block, greedy at T>0)
    are skipped with a note.

    \b
    localspec bench
    localspec bench --prompts all --verifiers block,traversal --shapes k4,t3x2x1
    localspec bench --verifiers block,gbv --shapes k4,p3k4 --temperatures 0.8
    localspec bench --drafters ngram -d none --prompts code-edit
    localspec bench -m target.gguf -d draft.gguf --prompts my-prompts.txt -n 128 --repeat 3
    """
    from localspec.bench.runs import BenchSettings, limits, plot, run_bench, run_matrix, to_json, to_markdown

    settings = BenchSettings(verifiers=verifiers, shapes=shapes, drafters=drafters, temperatures=temperatures,
                             plan=plan, max_tokens=max_tokens, repeat=repeat, seed=seed,
                             sampling=SamplingParams(DEFAULT_SAMPLING.temperature, top_k, top_p, min_p), chat=chat)
    _check_plotting()
    loaded = load_pair(model, draft, Flags.current().load(), need_draft=any(d != "ngram" for d in drafters))
    try:
        _, notes = run_matrix(settings, limits(loaded.target), loaded.draft is not None)
        for note in notes:
            click.echo(f"skipped {note}", err=True)
        results = run_bench(loaded.target, loaded.draft, prompt_sets, settings)
    finally:
        loaded.close()
    click.echo(to_markdown(results))
    names = {"target": loaded.target_name,
             "draft": str(loaded.draft.path) if loaded.draft is not None else None}
    _write(out, results, settings, names, to_json, plot)


def _check_plotting() -> None:
    """bench.png needs matplotlib: say so before anything runs."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        click.echo("note: bench.png needs matplotlib (pip install 'localspec[plot]'); writing bench.json only",
                   err=True)


def _write(out: Path, results: list, settings: Any, names: dict, to_json: Callable, plot: Callable) -> None:
    """bench.json and (with matplotlib) bench.png under `out`; their paths on stderr."""
    import importlib.util

    try:
        out.mkdir(parents=True, exist_ok=True)
        json_path = out / "bench.json"
        json_path.write_text(to_json(results, settings, names) + "\n", encoding="utf-8")
        click.echo(f"wrote {json_path}", err=True)
        if importlib.util.find_spec("matplotlib") is not None:
            click.echo(f"wrote {plot(results, out / 'bench.png')}", err=True)
    except OSError as exc:
        raise click.ClickException(f"cannot write the results to {out}: {exc}") from None

