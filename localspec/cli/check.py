"""``localspec check``: run the losslessness checks and show them pass (or fail)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import click

from localspec.cli.options import Flags, model_options, user_errors
from localspec.errors import CheckFailed, exit_code
from localspec.loading import load_pair
from localspec.settings.models import PairOptions

log = logging.getLogger(__name__)


def _echo(result: Any) -> None:
    from localspec.bench.checks import format_line

    click.echo(format_line(result))
    sys.stdout.flush()


@click.command()
@click.option("--toy-only", is_flag=True, help="Run the toy-distribution checks only (no models are loaded).")
@model_options
@click.option("--samples", type=click.IntRange(10), default=None,
              help="Speculative steps of the model-pair test (default 200: about 50 s for the default "
                   "1.5B/0.5B pair on 2 CPU cores; more steps, more power).")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=1e-3, show_default=True,
              help="Significance level of each chi-square test: the probability that a correct verifier fails it.")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Seed of the Monte Carlo checks.")
@click.option("--lenience", type=click.FloatRange(0), default=0.0, hidden=True,
              help="Make the model-pair test LOSSY (verifier token with this lenience) to see it fail.")
@user_errors
def check(toy_only: bool, model: str | None, draft: str | None, samples: int | None, alpha: float, seed: int,
          lenience: float, **options: Any) -> None:
    """Check that speculative decoding is lossless; exit status 1 if any check fails.

    \b
    Toy checks (seconds, tiny vocabularies):
      exact       each lossless verifier's one-step output distribution,
                  computed exactly, equals the target's (to 1e-9)
      chi-square  the C verifier's outputs over 4000 seeded steps against
                  that distribution (Pearson test at --alpha)
      control     a deliberately lossy rule (token, lenience 0.5) must be
                  detected by both, so you can see the checks can fail
      masked      the same with token masks (constrained decoding: a toy
                  grammar masks every row) against constrained sampling;
                  its control (masks not given to the verifier) must fail
    Model pair (skipped with --toy-only): the first token of N full
    speculative steps (draft + verification, default settings) against the
    target's exact next-token distribution under the default sampling
    settings (those of `localspec --help`), chi-square at --alpha.

    \b
    localspec check --toy-only
    localspec check                                  # + the default pair (fetched on first use)
    localspec check -m target.gguf -d draft.gguf --samples 1000
    localspec check --alpha 1e-4 --seed 7
    """
    from localspec.bench import checks

    started = time.perf_counter()
    click.echo("toy distributions:")
    results = checks.toy_suite(alpha, seed, progress=_echo)
    if not toy_only:
        click.echo("model pair:")
        result = _pair(model, draft, Flags.current().load(), samples or checks.PAIR_SAMPLES, alpha, seed, lenience)
        _echo(result)
        results.append(result)
    failed = [r for r in results if not r.passed]
    click.echo("")
    click.echo(checks.false_positive_note(results, alpha))
    elapsed = time.perf_counter() - started
    if failed:
        click.echo(f"{len(failed)} of {len(results)} checks FAILED: {', '.join(r.name for r in failed)} "
                   f"({elapsed:.1f} s)")
        sys.exit(exit_code(CheckFailed))
    click.echo(f"all {len(results)} checks passed, the negative controls detected ({elapsed:.1f} s)")


def _pair(model: str | None, draft: str | None, options: PairOptions, samples: int, alpha: float, seed: int,
          lenience: float) -> Any:
    from localspec.bench.checks import pair_check

    loaded = load_pair(model, draft, options)
    try:
        if loaded.draft is None:
            raise click.ClickException("the model-pair check needs a draft model: give -d/--draft "
                                       "(or use --toy-only)")
        return pair_check(loaded.target, loaded.draft, samples=samples, alpha=alpha, seed=seed,
                          lenience=lenience, progress=True)
    finally:
        loaded.close()

