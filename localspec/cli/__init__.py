"""The ``localspec`` command line: the root group and its commands.

The root command generates: ``localspec "prompt"`` equals ``localspec generate "prompt"``
(:mod:`localspec.cli.generate`). Each subcommand has its module here, imported when it runs
(a generating call imports no other command's code); they share the option groups and helpers
of :mod:`localspec.cli.options`. Imports go one way: this package's ``__init__`` → the command
modules → ``options``; no module here imports ``localspec.cli`` itself.
"""

from __future__ import annotations

import logging
import sys

import click

from localspec import __version__
from localspec.cli import generate
from localspec.cli.generate import DefaultGroup
from localspec.cli.options import user_errors
from localspec.settings import environment

log = logging.getLogger(__name__)

COMMANDS = {  # every command but generate, imported when it runs
    "bench": "localspec.cli.bench:bench", "cache": "localspec.cli.cache:cache", "chat": "localspec.cli.chat:chat",
    "check": "localspec.cli.check:check", "info": "localspec.cli.info:info", "models": "localspec.cli.models:models",
    "profiles": "localspec.cli.profiles:profiles", "ps": "localspec.cli.resident:ps",
    "stop": "localspec.cli.resident:stop", "rpc-server": "localspec.cli.rpc_server:rpc_server",
    "serve": "localspec.cli.serve:serve",
}


def with_user_errors(command: click.Command) -> None:
    """Every command (and each subcommand of a group) reports localspec's errors as one line with
    their exit status (user_errors), never a traceback, whether or not it wrapped itself."""
    if command.callback is not None and not getattr(command.callback, "_user_errors", False):
        command.callback = user_errors(command.callback)
        vars(command.callback)["_user_errors"] = True  # marked as wrapped (a function's attributes are its vars)
    for sub in getattr(command, "commands", {}).values():
        with_user_errors(sub)


class Root(DefaultGroup):
    lazy = COMMANDS

    def on_load(self, command: click.Command) -> None:
        with_user_errors(command)


@click.group(cls=Root, context_settings={"help_option_names": ["-h", "--help"]})
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
    for line in environment.unknown():
        log.warning("%s", line)
    environment.check()  # every LOCALSPEC_* value localspec reads: a bad one is this command's usage error


cli.add_command(generate.generate)
with_user_errors(cli)


def main() -> None:
    """The ``localspec`` entry point."""
    environment.quiet_blas()
    cli(prog_name="localspec")
