"""A later call's client cost, alone (``python benchmarks/resident.py --client-only``): the wall
time of a fresh ``localspec`` process whose call the service serves, minus the service's own time
for it (its ``--json`` timings), per prompt and round, and the CPU time the client process used
(which other load on the host inflates far less than its wall time); with ``--against CHECKOUT``,
the same calls by another checkout's client (its root first on ``PYTHONPATH``, its own service),
alternated call by call, so both sides share the host's load. Imports are read from
``python -X importtime``."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common.options import progress
from benchmarks.common.runs import Run

HEAVY = ("numpy", "llama_cpp", "llguidance", "pydantic", "jinja2")


def _cost(run: Run) -> tuple[float, float]:
    """A later call's wall time minus the service's time for it, and its process's CPU time (seconds)."""
    return run.wall - float(run.data["timings"]["service"]), run.cpu


def measure(args: argparse.Namespace, ls: Any, prompts: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Client costs (wall, CPU) by side ("this", and the checkout --against names): every prompt's
    later call per round, the sides alternated (this first in even rounds)."""
    sides = {"this": {}, **({"against": {"PYTHONPATH": str(args.against)}} if args.against else {})}
    for name, env in sides.items():  # each side's service started and its pair loaded (untimed)
        ls.call(prompts[args.prompts[0]], f"warm-{name}", env=env)
    costs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for r in range(args.repeat):
        for prompt in args.prompts:
            progress(f"client cost, round {r + 1}/{args.repeat}: {prompt}")
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                costs[name].append(_cost(ls.call(prompts[prompt], f"{r}.client-{name}", env=sides[name])))
                progress(f"  {name}: {1000 * costs[name][-1][0]:.0f} ms, CPU {1000 * costs[name][-1][1]:.0f} ms")
    return costs


def imports(ls: Any, prompt: Any, env: dict[str, str]) -> tuple[float, int, list[str]]:
    """A served call's imports: their self times summed (ms), their number, the heavy ones."""
    traced = ls.call(prompt, "traced", importtime=True, env=env)
    lines = [line for line in traced.stderr.splitlines() if line.startswith("import time:")][1:]
    names = [line.rsplit("|", 1)[-1].strip() for line in lines]
    total_us = sum(int(line.split("|")[0].split(":")[1]) for line in lines)
    return total_us / 1000, len(names), sorted({n.split(".")[0] for n in names} & set(HEAVY))


def table(args: argparse.Namespace, ls: Any, prompts: dict[str, Any]) -> list[str]:
    costs = measure(args, ls, prompts)
    lines = ["| client | later calls | client cost, median ms | its CPU time, median ms | imports (self times "
             "summed) ms | modules | heavy modules |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    medians = {name: [statistics.median(v[i] for v in values) for i in (0, 1)] for name, values in costs.items()}
    for name, values in costs.items():
        env = {"PYTHONPATH": str(args.against)} if name == "against" else {}
        ms, count, heavy = imports(ls, prompts[args.prompts[0]], env)
        label = "this checkout" if name == "this" else f"{Path(args.against).name} (--against)"
        lines.append(f"| {label} | {len(values)} | {1000 * medians[name][0]:.0f} | {1000 * medians[name][1]:.0f} "
                     f"| {ms:.0f} | {count} | {', '.join(heavy) or 'none'} |")
    if "against" in costs:
        wall, cpu = (medians["against"][i] / medians["this"][i] for i in (0, 1))
        lines += ["", f"The client of --against costs **{wall:.2f}×** this checkout's wall time and **{cpu:.2f}×** "
                  "its CPU time (medians; > 1: this one is cheaper)."]
    return lines
