"""``localspec ps`` and ``localspec stop``: the resident services that keep models loaded."""

from __future__ import annotations

import json

import click

from localspec.cli.options import user_errors
from localspec.errors import ConfigError


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the services as a JSON array.")
@user_errors
def ps(as_json: bool) -> None:
    """List the models kept loaded by resident services.

    A `localspec` call that loads models leaves them loaded in a background
    service for --keep-alive (default 5m); later calls with the same models
    and options are served by it without loading anything.

    \b
    localspec ps
    localspec ps --json | jq '.[].model'
    """
    from localspec.resident import control

    rows = control.rows()
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    for line in control.describe_rows(rows):
        click.echo(line)


@click.command()
@click.argument("model", required=False)
@click.option("--all", "stop_all", is_flag=True, help="Stop every resident service.")
@user_errors
def stop(model: str | None, stop_all: bool) -> None:
    """Unload resident models: the service of MODEL (a registry name, a
    GGUF path or file name), or --all. With one service running, MODEL
    may be left out. A call it is running stops within one step.

    \b
    localspec stop --all
    localspec stop qwen2.5-coder-1.5b-instruct-q4_k_m
    """
    from localspec.resident import control

    services = control.services()
    if model is not None and stop_all:
        raise ConfigError("give MODEL or --all, not both", "all")
    if model is None and not stop_all and len(services) > 1:
        names = ", ".join(sorted({control.model_name(s) for _, s in services}))
        raise ConfigError(f"{len(services)} services run ({names}); name a MODEL or use --all", "model")
    chosen = [(r, s) for r, s in services if model is None or control.matches(r, s, model)]
    if model is not None and not chosen:
        running = ", ".join(sorted({control.model_name(s) for _, s in services})) or "none"
        raise ConfigError(f"no resident service holds {model!r} (running: {running}); localspec ps lists them",
                          "model")
    for record, state in chosen:
        if control.stop_service(record, reason="localspec stop"):
            click.echo(f"stopped {control.model_name(state)} (pid {state.get('pid')})", err=True)
    if not chosen:
        click.echo("no resident models", err=True)
