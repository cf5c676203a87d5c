"""``localspec cache``: the prompt cache (list, clear)."""

from __future__ import annotations

import json
import time

import click

from localspec.cli.options import prompt_cache_option, user_errors


def _cache(prompt_cache: str | None):  # -> PromptCache | None
    from localspec.llama.prompt_cache import PromptCache

    store = PromptCache.from_setting(prompt_cache)
    if store is not None:
        store.check()  # a directory that is not the user's is refused, the default one too
    return store


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


@click.group()
def cache() -> None:
    """The prompt cache: saved KV state of earlier prompts, so that a prompt
    sharing a prefix with one of them prefills only the rest.

    It lives in <cache>/prompts ($LOCALSPEC_PROMPT_CACHE, else under
    ~/.cache/localspec), holds your prompts (its files are readable by you
    alone) and keeps at most $LOCALSPEC_PROMPT_CACHE_LIMIT bytes (default 4G),
    dropping the least recently used entries first. It reads, touches and
    removes only files it wrote, in private subdirectories it made: links
    and other users' files are left alone.

    \b
    localspec cache list
    localspec cache list --json
    localspec cache clear
    """


@cache.command("list")
@prompt_cache_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@user_errors
def list_cache(prompt_cache: str | None, as_json: bool) -> None:
    """The saved prefixes, most recently used first."""
    store = _cache(prompt_cache)
    if store is None:
        click.echo(json.dumps({"enabled": False}) if as_json else "the prompt cache is off")
        return
    entries = sorted(store.entries(tidy=False), key=lambda e: -e.used)  # reads only: removes nothing
    if as_json:
        click.echo(json.dumps({"enabled": True, "dir": str(store.root), "bytes": sum(e.size for e in entries),
                               "limit": store.limit,
                               "entries": [{"file": str(e.path), "model": e.options.get("file"),
                                            "tokens": len(e.tokens), "bytes": e.size, "used": e.used}
                                           for e in entries]}))
        return
    click.echo(f"{len(entries)} entries, {_mb(sum(e.size for e in entries))} of {_mb(store.limit)} in {store.root}")
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.used))
        click.echo(f"  {used}  {len(e.tokens):6d} tokens  {_mb(e.size):>9}  {e.options.get('file')} "
                   f"({e.options.get('cache_type')} KV)")


@cache.command("clear")
@prompt_cache_option
@user_errors
def clear_cache(prompt_cache: str | None) -> None:
    """Remove every saved prefix."""
    store = _cache(prompt_cache)
    if store is None:
        click.echo("the prompt cache is off: nothing to clear")
        return
    click.echo(f"removed {store.clear()} entries from {store.root}")
