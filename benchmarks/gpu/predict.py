#!/usr/bin/env python3
"""Predicted GPU speedups of the default pair: a measured GPU cost curve × acceptance traces recorded on the CPU.

    python benchmarks/gpu_predict.py --record-traces benchmarks/data/acceptance_traces.json   # here, once (CPU)
    python benchmarks/gpu_predict.py --check-json gpu-out/gpu_check.json                     # after a GPU run
    python benchmarks/gpu_predict.py --curve 2:1.05,4:1.1,8:1.2,16:1.5 --draft-ratio 0.6     # any curve

Which tokens a step accepts does not depend on the hardware: with a fixed seed and a fixed draft
shape (plan "fixed") the real pair accepts the same drafts on a GPU as on this CPU, up to the
last bits of the logits. So a trace recorded here (for every step: what was drafted, by which
drafter, in how many levels of what width, and how many tokens were accepted) replayed with the
costs a GPU measured (benchmarks/gpu_check.py: the target's c(n) for n = 1…16, the draft's, the
per-token overhead of the engine and each verifier's time per step) predicts the GPU decode time:

    step = c_target(nodes + 1) + Σ draft decodes c_draft(width) + overhead + verifier time

against the target alone's c_target(1) + overhead per token. The n-gram drafter planned by the
real planner (`--drafter auto` without a draft model) is replayed on the T = 0 answers as
benchmarks/planner_replay.py does (benchmarks.replay). The planner's draft-model decisions on the
curve (is loading the draft worth it; how deep it drafts at the traces' acceptance) come last. Everything printed is
labelled a prediction: timing on the GPU itself is what benchmarks/gpu_check.py measures.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

from localspec.settings.generation import GenerationConfig
from localspec.decoding.acceptance import LEVELS
from localspec.decoding.costs import CostTable
from localspec.decoding.planner import Planner
from localspec.decoding.profiles import Profiles

from benchmarks.gpu.traces import TRACES, record_main
from benchmarks.replay.answers import parse_curve
from benchmarks.replay.planners import fresh_profile, planner_for
from benchmarks.replay.steps import replay

log = logging.getLogger("gpu_predict")

ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)  # per-level acceptance rates the planner's decisions are shown for

ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)  # per-level acceptance rates the planner's decisions are shown for


class Costs:
    """Seconds per target pass of n tokens and per draft decode of n tokens (the planner's
    interpolation between measured sizes), the engine's overhead per step and each verifier's
    time per step; `source` says where they come from."""

    def __init__(self, target: dict[int, float], draft: dict[int, float], overhead: float = 0.0,
                 verify: dict[str, float] | None = None, prefill: float | None = None, source: str = "") -> None:
        if 1 not in target or 1 not in draft:
            raise ValueError("a cost curve needs c(1) of the target and of the draft")
        self.target_curve, self.draft_curve = dict(target), dict(draft)
        self.target = CostTable(dict(target), lambda: prefill)
        self.draft = CostTable(dict(draft), lambda: prefill)
        self.overhead, self.verify, self.prefill, self.source = overhead, dict(verify or {}), prefill, source

    def step(self, step: Sequence, verifier: str) -> float:
        """Predicted seconds of one recorded step: the target pass over the root and every draft
        node, the draft model's decodes (the root, then every level but the leaves: leaves are
        never decoded), the engine's overhead and the verifier's time."""
        kind, widths, _ = step
        seconds = self.target(sum(widths) + 1) + self.overhead + self.verify.get(verifier, 0.0)
        if kind == "model" and widths:
            seconds += sum(self.draft(w) for w in [1, *widths[:-1]])
        return seconds

    @property
    def per_token_alone(self) -> float:
        """The target alone: one pass of one token and the engine's overhead per generated token."""
        return self.target(1) + self.overhead


def costs_from_check(state: dict) -> Costs:
    """The costs a GPU check measured (benchmarks/gpu_check.py's gpu_check.json)."""
    steps = {s["name"]: s for s in state["steps"]}

    def data(name: str) -> dict | None:
        s = steps.get(name)
        return s.get("data") if s and s.get("status") in ("ok", "partial") else None

    curve = data("cost_curve")
    if curve is None:
        raise ValueError("the check recorded no cost curve (its cost_curve step did not succeed)")
    target = {int(n): float(v) for n, v in curve["target_seconds"].items()}
    draft = {int(n): float(v) for n, v in curve["draft_seconds"].items()}
    speed, share = data("decode_speed") or {}, data("verifier_share") or {}
    overhead = max(0.0, speed.get("overhead_ms_per_token", 0.0) / 1e3)
    verify = {v: r["verify_ms_per_step"] / 1e3 for v, r in share.items()}
    gpus = state.get("machine", {}).get("gpus") or ["no GPU"]
    return Costs(target, draft, overhead, verify, curve.get("prefill_per_token", {}).get("target"),
                 source=f"measured by benchmarks/gpu_check.py ({state.get('mode')}) on {gpus[0]}")


def costs_from_ratios(curve: dict[int, float], draft_ratio: float) -> Costs:
    """Costs in units of the target's c(1): the given c(n)/c(1), a draft whose c(n) is
    draft_ratio times the target's; no overhead."""
    return Costs(curve, {n: draft_ratio * c for n, c in curve.items()},
                 source=f"the curve given (c(n)/c(1)) and draft/target {draft_ratio:g}; no overhead counted")


def acceptance_alpha(runs: Sequence[dict]) -> float | None:
    """Per-level acceptance of model drafts: 1 - rejections / levels reached (pooled over levels)."""
    reached = rejected = 0
    for run in runs:
        for kind, widths, accepted in run["steps"]:
            if kind == "model" and widths:
                depth = len(widths)
                reached += min(accepted + 1, depth)
                rejected += accepted < depth
    return 1 - rejected / reached if reached else None


def predict(traces: dict, costs: Costs) -> list[dict]:
    """Per (configuration, temperature), over the prompts: tokens, steps, CPU acceptance and the
    predicted GPU speedup over the target alone."""
    groups: dict[tuple, list[dict]] = {}
    for run in traces["runs"]:
        groups.setdefault((run["config"], run["temperature"]), []).append(run)
    rows = []
    for (config, t), runs in groups.items():
        tokens = sum(r["tokens"] for r in runs)
        steps = sum(len(r["steps"]) for r in runs)
        seconds = sum(costs.step(s, r["verifier"]) for r in runs for s in r["steps"])
        drafted = sum(sum(w) for r in runs for _, w, _ in r["steps"])
        accepted = sum(a for r in runs for _, _, a in r["steps"])
        rows.append({"config": config, "temperature": t, "drafter": runs[0]["drafter"], "verifier": runs[0]["verifier"],
                     "prompts": len(runs), "tokens": tokens, "steps": steps, "tokens_per_step": tokens / steps,
                     "acceptance": accepted / drafted if drafted else None,
                     "speedup": tokens * costs.per_token_alone / seconds})
    return rows


def ngram_auto(traces: dict, costs: Costs) -> list[dict]:
    """`--drafter auto` without a draft model (n-gram lookups planned by the real planner) on the
    T = 0 answers, replayed with these costs (benchmarks.replay)."""
    curve = {n: c + costs.overhead for n, c in costs.target_curve.items()}
    prefill = costs.prefill or curve[1] / 10

    def cost(n: int) -> float:
        return costs.target(n) + costs.overhead

    out, seen = [], set()
    for run in traces["runs"]:
        if run["temperature"] != 0 or run["prompt"] in seen or run["verifier"] != "block":
            continue
        seen.add(run["prompt"])
        got = replay(planner_for(fresh_profile(curve, prefill, warm_costs=True)), run["prompt_tokens"], run["output"],
                     cost, traces["max_tokens"])
        out.append({"prompt": run["prompt"], "tokens": len(run["output"]), "steps": got.steps,
                    "speedup": len(run["output"]) * cost(1) / got.seconds})
    return out


def planner_decisions(curve_t: dict[int, float], curve_d: dict[int, float], *, target_bytes: int, draft_bytes: int,
                      draft_load: float, prefill_t: float | None, prefill_d: float | None, prompt_tokens: int = 200,
                      remaining: int = 256, alphas: tuple[float, ...] = ALPHAS) -> dict:
    """What localspec's planner decides on this cost profile: whether `--drafter auto` loads the
    draft model (its best case, everything accepted, repays the load and the prompt's prefill over
    `remaining` tokens), and the draft depth it picks once per-level acceptance α is well known,
    with the predicted speedup of that depth over the target alone."""
    profiles = Profiles.in_memory()
    t_id, d_id = {"model": "target"}, {"model": "draft"}
    tp, dp = profiles.get(t_id), profiles.get(d_id)
    tp.costs, tp.prefill = dict(curve_t), prefill_t
    dp.costs, dp.prefill, dp.load = {1: curve_d[1]}, prefill_d, draft_load
    for alpha in alphas:  # well known: as if 10,000 drafts reached every level and a share 1 - α was rejected there
        tp.acceptance[f"model:a{alpha}"] = [[1e4] * LEVELS, [1e4 * (1 - alpha)] * LEVELS]
    target = SimpleNamespace(identity=t_id, file_bytes=target_bytes)
    drafter = SimpleNamespace(source=SimpleNamespace(identity=d_id, file_bytes=draft_bytes, load_seconds=None))
    shape = GenerationConfig().shape
    planner = Planner(target, shape, profiles=profiles)  # it reads the costs and acceptance from the profile
    out: dict[str, Any] = {"loads_draft": planner.worth_loading(drafter, prompt_tokens, remaining),
                           "prompt_tokens": prompt_tokens, "remaining": remaining, "max_depth": shape.depth}
    for alpha in alphas:
        depth, rate = planner.choose(drafter, f"model:a{alpha}", shape.depth)  # what it would draft (asks, changes nothing)
        out[f"alpha {alpha:g}"] = {"depth": depth, "predicted_speedup": rate * curve_t[1] if depth else 1.0}
    return out


def planner_rows(traces: dict, costs: Costs, target_bytes: int, draft_bytes: int, draft_load: float) -> dict:
    """The planner's draft-model decisions on these costs at the real pair's CPU-measured acceptance."""
    alphas = {}
    for label, t in (("greedy k4", 0.0), ("block k4", 0.8)):
        a = acceptance_alpha([r for r in traces["runs"] if r["config"] == label and r["temperature"] == t])
        if a is not None:
            alphas[f"{label} T={t:g}"] = round(a, 3)
    decisions = planner_decisions(costs.target_curve, costs.draft_curve, target_bytes=target_bytes,
                                  draft_bytes=draft_bytes, draft_load=draft_load, prefill_t=costs.prefill,
                                  prefill_d=None, alphas=tuple(sorted(set(alphas.values()))))
    return {"alphas": alphas, **decisions}


def markdown(traces: dict, costs: Costs, rows: list[dict], ngram: list[dict], planner: dict | None) -> str:
    c = costs.target_curve
    lines = ["**Prediction, not a measurement**: step costs " + costs.source + ", applied to acceptance traces of "
             f"the default pair recorded on a CPU ({traces['recorded_on']['cpu']}, llama-cpp-python "
             f"{traces['recorded_on']['llama_cpp']}; {traces['max_tokens']} tokens per prompt, prompts: "
             + ", ".join(sorted({r['prompt'] for r in traces['runs']})) + ").",
             "", "Cost curve used, c(n)/c(1): " + ", ".join(f"{n}: {c[n] / c[1]:.2f}" for n in sorted(c))
             + f"; draft c(1)/target c(1) = {costs.draft_curve[1] / c[1]:.3f}; overhead per step "
             f"{1e3 * costs.overhead:.2f} ms.", "",
             "| drafter | verifier, shape | T | acceptance (CPU) | tokens per step | predicted speedup |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (r["drafter"] != "model", r["temperature"], r["config"])):
        acc = "—" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f} %"
        lines.append(f"| {r['drafter']} | {r['config'].split(' ', 1)[-1] if r['drafter'] != 'model' else r['config']} | "
                     f"{r['temperature']:g} | {acc} | {r['tokens_per_step']:.2f} | {r['speedup']:.2f}× |")
    if ngram:
        lines += ["", "`--drafter auto` without a draft model (the planner replayed on the T = 0 answers):", "",
                  "| prompt | tokens | steps | predicted speedup |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {r['prompt']} | {r['tokens']} | {r['steps']} | {r['speedup']:.2f}× |" for r in ngram]
    if planner:
        lines += ["", f"The planner with these costs: `--drafter auto` loads the draft model for a "
                  f"{planner['prompt_tokens']}-token prompt and {planner['remaining']} tokens to go: "
                  f"**{'yes' if planner['loads_draft'] else 'no'}**; at the pair's acceptance "
                  + "; ".join(f"{k} (α = {a:g}): depth {planner[f'alpha {a:g}']['depth']}, "
                              f"{planner[f'alpha {a:g}']['predicted_speedup']:.2f}×" for k, a in planner["alphas"].items())
                  + "."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=TRACES,
                   help="acceptance traces of the default pair (default benchmarks/data/acceptance_traces.json)")
    p.add_argument("--record-traces", type=Path, metavar="OUT", help="record the traces here, on this CPU, and stop")
    p.add_argument("--tokens", type=int, default=64, help="with --record-traces: tokens per prompt (default 64)")
    p.add_argument("--threads", type=int, default=None, help="with --record-traces: CPU threads")
    p.add_argument("--check-json", type=Path, help="the gpu_check.json of a GPU run: its measured costs")
    p.add_argument("--curve", type=parse_curve, help="instead: c(n)/c(1) as N:RATIO,... (e.g. 2:1.02,8:1.2,16:1.6)")
    p.add_argument("--draft-ratio", type=float, default=None, help="with --curve: draft c(1) / target c(1)")
    p.add_argument("--out", type=Path, help="also write the markdown here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.record_traces:
        return record_main(args.record_traces, args.tokens, 1, args.threads)
    if (args.check_json is None) == (args.curve is None):
        p.error("give one of --check-json (a GPU check's costs) and --curve (with --draft-ratio)")
    if args.curve is not None and not (args.draft_ratio and args.draft_ratio > 0):
        p.error("--curve needs --draft-ratio (the draft's c(1) over the target's, > 0)")
    try:
        traces = json.loads(args.traces.read_text())
    except (OSError, ValueError) as exc:
        p.error(f"--traces: cannot read {args.traces}: {exc}")
    if args.check_json is not None:
        try:
            state = json.loads(args.check_json.read_text())
            costs = costs_from_check(state)
        except (OSError, ValueError, KeyError) as exc:
            p.error(f"--check-json: {args.check_json}: {exc}")
        planner = planner_rows(traces, costs, *_pair_facts(state))
    else:
        costs = costs_from_ratios(args.curve, args.draft_ratio)
        planner = None
    text = markdown(traces, costs, predict(traces, costs), ngram_auto(traces, costs), planner)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


def _pair_facts(state: dict) -> tuple[int, int, float]:
    """(target bytes, draft bytes, draft load seconds) of the shaped pair the check measured."""
    steps = {s["name"]: s.get("data") or {} for s in state["steps"]}
    sizes = list(steps.get("shaped_models", {}).get("bytes", {}).values()) or [1_117_000_000, 491_000_000]
    load = steps.get("cost_curve", {}).get("load_seconds", {}).get("draft", 1.0)
    return int(sizes[0]), int(sizes[1]), float(load)


if __name__ == "__main__":
    sys.exit(main())
