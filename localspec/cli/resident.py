"""``localspec ps`` and ``localspec stop``: the resident services that keep models loaded."""

from __future__ import annotations

import json
import os
from typing import Any

import click

from localspec.cli.options import format_duration, user_errors
from localspec.errors import ConfigError


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _model_name(state: dict[str, Any]) -> str:
    """A registry name as it is, a file by its name."""
    name = state.get("target_name") or state.get("target") or "?"
    return os.path.basename(name) if name.lower().endswith(".gguf") else name


def resident_rows() -> list[dict[str, Any]]:
    """Every live resident service as `localspec ps --json` shows it."""
    from localspec.resident import control

    rows = []
    for record, state in control.services():
        rows.append({"id": record.id, "pid": state.get("pid"), "model": _model_name(state),
                     "target": state.get("target"), "draft": state.get("draft"),
                     "draft_loaded": bool(state.get("draft_loaded")), "memory_bytes": state.get("memory", 0),
                     "idle_seconds": round(float(state.get("idle") or 0), 1),
                     "left_seconds": None if state.get("left") is None else round(float(state["left"]), 1),
                     "keep_alive_seconds": state.get("keep_alive"), "busy": bool(state.get("busy")),
                     "waiting": state.get("waiting", 0), "requests": state.get("served", 0)})
    return rows


def describe_rows(rows: list[dict[str, Any]]) -> list[str]:
    """`localspec ps`'s table (also in `localspec info`)."""
    if not rows:
        return ["no resident models (a call keeps its models loaded for --keep-alive, default 5m)"]
    lines = [f"{'MODEL':<28} {'DRAFT':<22} {'MEMORY':>9} {'IDLE':>7} {'LEFT':>7} {'CALLS':>5}  PID"]
    for r in rows:
        draft = os.path.basename(r["draft"] or "-") + ("" if r["draft_loaded"] or not r["draft"] else " (not loaded)")
        left = "busy" if r["busy"] else format_duration(round(r["left_seconds"] or 0))
        lines.append(f"{r['model'][:28]:<28} {draft[:22]:<22} {_size(r['memory_bytes'] or 0):>9} "
                     f"{format_duration(round(r['idle_seconds'])):>7} {left:>7} {r['requests']:>5}  {r['pid']}")
    return lines


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
    rows = resident_rows()
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    for line in describe_rows(rows):
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
        names = ", ".join(sorted({_model_name(s) for _, s in services}))
        raise ConfigError(f"{len(services)} services run ({names}); name a MODEL or use --all", "model")
    chosen = [(r, s) for r, s in services if model is None or control.matches(r, s, model)]
    if model is not None and not chosen:
        running = ", ".join(sorted({_model_name(s) for _, s in services})) or "none"
        raise ConfigError(f"no resident service holds {model!r} (running: {running}); localspec ps lists them",
                          "model")
    for record, state in chosen:
        if control.stop_service(record, reason="localspec stop"):
            click.echo(f"stopped {_model_name(state)} (pid {state.get('pid')})", err=True)
    if not chosen:
        click.echo("no resident models", err=True)
