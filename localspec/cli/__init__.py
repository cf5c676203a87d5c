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

from localspec import __version__, environment
from localspec.cli import bench, cache, chat, check, generate, info, models, profiles, resident, rpc_server, serve
from localspec.cli.generate import DefaultGroup
from localspec.cli.options import user_errors
from localspec.cli.resources import Resources

log = logging.getLogger(__name__)


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
    click.get_current_context().ensure_object(Resources)  # a resident service passes its own
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    for line in environment.unknown():
        log.warning("%s", line)
    environment.check()  # every LOCALSPEC_* value localspec reads: a bad one is this command's usage error


def _user_errors(command: click.Command) -> None:
    """Every command (and the root's callback) reports localspec's errors as one line with their
    exit status (user_errors), never a traceback, whether or not it wrapped itself."""
    if command.callback is not None:
        command.callback = user_errors(command.callback)
    for sub in getattr(command, "commands", {}).values():
        _user_errors(sub)


for _command in (generate.generate, bench.bench, cache.cache, chat.chat, check.check, info.info, models.models,
                 profiles.profiles, resident.ps, resident.stop, rpc_server.rpc_server, serve.serve):
    cli.add_command(_command)
_user_errors(cli)


def main() -> None:
    cli(prog_name="localspec")
