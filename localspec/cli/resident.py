"""``localspec ps`` and ``localspec stop``: the models the resident service keeps loaded."""

from __future__ import annotations

import json

import click

from localspec.cli.options import user_errors
from localspec.errors import ConfigError


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the loaded models as a JSON array.")
@user_errors
def ps(as_json: bool) -> None:
    """List the models the resident service keeps loaded.

    A `localspec` call leaves its models loaded in a background service for
    --keep-alive (default 5m); later calls with the same models and options
    are served by it without loading anything. The service holds several pairs
    (LOCALSPEC_MAX_LOADED, default 3) and unloads the idle one used least
    recently when another needs the room.

    \b
    localspec ps
    localspec ps --json | jq '.[].model'
    """
    from localspec.core.status import rows, table
    from localspec.resident import control

    statuses = [state for _, state in control.services()]
    if as_json:
        click.echo(json.dumps(rows(statuses), indent=1))
        return
    for line in table(statuses):
        click.echo(line)


@click.command()
@click.argument("model", required=False)
@click.option("--all", "stop_all", is_flag=True, help="Unload every model and end the resident service.")
@user_errors
def stop(model: str | None, stop_all: bool) -> None:
    """Unload resident models: MODEL (a registry name, a GGUF path, file
    name or stem), or --all. With one model loaded, MODEL may be left out.
    A call using it stops within one step.

    \b
    localspec stop --all
    localspec stop qwen2.5-coder-1.5b-instruct-q4_k_m
    """
    from localspec.resident import control

    if model is not None and stop_all:
        raise ConfigError("give MODEL or --all, not both", "all")
    services = control.services()
    pairs = [(path, pair) for path, state in services for pair in state.pairs]
    if model is None and not stop_all and len(pairs) > 1:
        names = ", ".join(sorted({pair.name for _, pair in pairs}))
        raise ConfigError(f"{len(pairs)} models are loaded ({names}); name a MODEL or use --all", "model")
    chosen = [(path, pair) for path, pair in pairs if model is None or pair.matches(model)]
    if model is not None and not chosen:
        running = ", ".join(sorted({pair.name for _, pair in pairs})) or "none"
        raise ConfigError(f"no resident model is {model!r} (loaded: {running}); localspec ps lists them", "model")
    everything = stop_all or model is None
    for path, state in services:
        targets = None if everything else [pair.target for p, pair in chosen if p == path]
        if targets == []:
            continue
        for pair in control.stop(path, targets):
            click.echo(f"stopped {pair.name} (pid {state.pid})", err=True)
    if not chosen and not services:
        click.echo("no resident models", err=True)
