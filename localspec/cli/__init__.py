"""The ``localspec`` command line: the root group and its commands.

The root command generates: ``localspec "prompt"`` equals ``localspec generate "prompt"``
(:mod:`localspec.cli.generate`). Each subcommand has its module here; they share the option
groups and helpers of :mod:`localspec.cli.options`. Imports go one way: this package's
``__init__`` → the command modules → ``options``; no module here imports ``localspec.cli`` itself.
"""

from __future__ import annotations

import logging
import sys

import click

from localspec import __version__
from localspec.cli import bench, cache, chat, check, generate, info, models, profiles, rpc_server, serve
from localspec.cli.generate import DefaultGroup


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="localspec")
@click.option("-v", "--verbose", count=True, help="Log diagnostics to stderr (-vv: debug).")
def cli(verbose: int) -> None:
    """Fast, lossless speculative decoding on llama.cpp.

    \b
    localspec "Write a quicksort in Python"        # generate (default pair, fetched on first use)
    localspec chat                                 # talk to the model
    localspec serve                                # OpenAI-compatible server
    localspec bench                                # verifiers x draft shapes, side by side
    localspec check                                # see the losslessness checks pass
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")


for _command in (generate.generate, bench.bench, cache.cache, chat.chat, check.check, info.info, models.models,
                 profiles.profiles, rpc_server.rpc_server, serve.serve):
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="localspec")
