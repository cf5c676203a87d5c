"""The command-line options the benchmarks share (--prompts; --tasks, --repeat, --tokens and
--threads of those that alternate fresh processes over named tasks) and their progress lines."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection, Sequence


def add_prompts_option(p: argparse.ArgumentParser, prompts: dict[str, str]) -> None:
    """--prompts: a comma list of names from `prompts` (default all; check them with check_prompts)."""
    p.add_argument("--prompts", type=lambda s: s.split(","), default=list(prompts),
                   help=f"comma list of the prompts to run (default all: {','.join(prompts)})")


def check_prompts(p: argparse.ArgumentParser, names: Sequence[str], prompts: dict[str, str]) -> None:
    """Exit with a usage error naming any of `names` that is not a prompt."""
    unknown = [name for name in names if name not in prompts]
    if unknown:
        p.error(f"unknown prompt(s) {', '.join(unknown)} in --prompts; choose from {', '.join(prompts)}")


def task_options(p: argparse.ArgumentParser, tasks: Collection[str], tokens: int, per: str = "run") -> None:
    """--tasks (a comma list of `tasks`), --repeat, --tokens and --threads: the options of the
    benchmarks that alternate fresh processes over named tasks (see checked_args)."""
    p.add_argument("--tasks", type=lambda s: s.split(","), default=list(tasks),
                   help=f"comma list of tasks (default all: {','.join(tasks)})")
    p.add_argument("--repeat", type=int, default=3, help="alternated runs per cell (default 3)")
    p.add_argument("--tokens", type=int, default=tokens, help=f"max tokens per {per} (default {tokens})")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")


def checked_args(p: argparse.ArgumentParser, argv: Sequence[str] | None,
                 tasks: Collection[str] | None = None) -> argparse.Namespace:
    """The parsed arguments; a usage error for an unknown task (with `tasks`) or a --repeat or
    --tokens below 1."""
    args = p.parse_args(argv)
    unknown = [t for t in args.tasks if t not in tasks] if tasks is not None else []
    if unknown:
        p.error(f"unknown task(s) {', '.join(unknown)} in --tasks; choose from {', '.join(tasks or ())}")
    if args.repeat < 1 or args.tokens < 1:
        p.error("--repeat and --tokens must be >= 1")
    return args


def progress(message: str) -> None:
    """A progress line on stderr (the tables go to stdout)."""
    print(message, file=sys.stderr, flush=True)
