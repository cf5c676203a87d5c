"""``localspec profiles``: the per-machine cost profiles (list, reset)."""

from __future__ import annotations

import json
import logging
from typing import Any

import click

log = logging.getLogger(__name__)


def describe(profile: Any) -> list[str]:
    """A profile in a few lines: what it is for and what it measured."""
    from localspec.decoding.acceptance import Acceptance
    from localspec.decoding.costs import implausible_costs

    ident = profile.identity
    costs = ", ".join(f"c({n})={s * 1e3:.1f}" for n, s in sorted(profile.costs.items())) or "none yet"
    lines = [f"{profile.name}  ({ident.get('threads')} threads, {ident.get('cache_type')} KV, "
             f"{ident.get('n_gpu_layers')} GPU layers, key {profile.key})",
             f"  step costs ms: {costs}"]
    for reason in implausible_costs(profile.costs).values():
        lines.append(f"  thrown out, measured again at the next run: {reason}")
    if profile.prefill:
        lines.append(f"  prefill: {profile.prefill * 1e3:.2f} ms/token")
    if profile.load:
        lines.append(f"  load: {profile.load:.2f} s")
    for kind, (at_risk, rejected) in sorted(profile.acceptance.items()):
        if at_risk and at_risk[0] > 0:
            acc = Acceptance(at_risk, rejected)
            lines.append(f"  drafts {kind}: first token accepted {acc.alpha:.0%}, E[tokens per step] at depth "
                         f"4/16/32: {acc.expected(4, 0):.1f}/{acc.expected(16, 0):.1f}/{acc.expected(32, 0):.1f} "
                         f"({at_risk[0]:.0f} drafts, decayed)")
    return lines


@click.group()
def profiles() -> None:
    """Per-machine cost profiles: what steps cost and how often drafts are accepted.

    localspec learns them from its own work (the prompt's prefill and every
    step) and starts every run from them; they live in <cache>/profiles
    ($LOCALSPEC_CACHE_DIR, else ~/.cache/localspec). Reset them after
    changing hardware settings you want measured afresh.

    \b
    localspec profiles list
    localspec profiles list --json
    localspec profiles reset
    """


@profiles.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def list_profiles(as_json: bool) -> None:
    """The profiles on disk, newest first."""
    from localspec.decoding.profiles import Profiles

    store = Profiles()
    found = store.on_disk()
    if as_json:
        click.echo(json.dumps({"directory": str(store.directory), "profiles": [p.to_json() for p in found]},
                              indent=2))
        return
    click.echo(f"profiles in {store.directory}: {len(found)}")
    for profile in found:
        click.echo("\n".join(describe(profile)))


@profiles.command("reset")
def reset_profiles() -> None:
    """Delete every profile (the next run measures afresh); other files in the
    directory stay."""
    from localspec.decoding.profiles import Profiles

    store = Profiles()
    click.echo(f"removed {store.reset()} profile(s) from {store.directory}")

