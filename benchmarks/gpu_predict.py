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
benchmarks/planner_replay.py does. The planner's draft-model decisions on the curve (is loading
the draft worth it; how deep it drafts at the traces' acceptance) come last. Everything printed is
labelled a prediction: timing on the GPU itself is what benchmarks/gpu_check.py measures.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_replay import parse_curve  # noqa: E402

log = logging.getLogger("gpu_predict")

TRACE_PROMPTS = ("code", "prose", "code-edit", "summarise")  # head_to_head's prompts
DEFAULT_SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)  # the CLI's defaults
GREEDY = dict(temperature=0.0)
# (label, drafter, verifier, shape keywords, temperatures): every verifier with the draft model at
# the default sampling (greedy: at T = 0, the only temperature it takes), and the other drafters
TRACE_CONFIGS: tuple[tuple[str, str, str, dict, tuple[float, ...]], ...] = (
    ("greedy k4", "model", "greedy", dict(num_draft_tokens=4), (0.0,)),
    ("match k4", "model", "match", dict(num_draft_tokens=4), (0.0, 0.8)),
    ("token k4", "model", "token", dict(num_draft_tokens=4), (0.8,)),
    ("block k4", "model", "block", dict(num_draft_tokens=4), (0.0, 0.8)),
    ("block k8", "model", "block", dict(num_draft_tokens=8), (0.8,)),
    ("gbv p3k4", "model", "gbv", dict(num_draft_tokens=4, paths=3), (0.8,)),
    ("batch p3k4", "model", "batch", dict(num_draft_tokens=4, paths=3), (0.8,)),
    ("rrs t3x2x1x1", "model", "rrs", dict(tree=(3, 2, 1, 1)), (0.8,)),
    ("rrsw t3x2x1x1", "model", "rrsw", dict(tree=(3, 2, 1, 1)), (0.8,)),
    ("traversal t3x2x1x1", "model", "traversal", dict(tree=(3, 2, 1, 1)), (0.8,)),
    ("ngram block k4", "ngram", "block", dict(num_draft_tokens=4), (0.0, 0.8)),
    ("hybrid block k4", "hybrid", "block", dict(num_draft_tokens=4), (0.0, 0.8)),
)


# ---------------------------------------------------------------- recording (here, on the CPU)


def _kind(draft: Any) -> str:
    """"model", "ngram", "forced": a draft's acceptance kind without its detail."""
    kind = getattr(draft, "kind", None) or ""
    return kind.split(":", 1)[0] or "-"


def traced_run(target: Any, draft: Any, prompt: Sequence[int], *, max_tokens: int, seed: int, plan: str = "fixed",
               profiles: Any = None, **settings: Any) -> dict:
    """One generation with per-step records: [kind, level widths, accepted] (kind "model", "ngram",
    "forced" or "-" for a step that drafted nothing), and the tokens it wrote. `profiles`: the cost
    profiles to plan with (default: empty, in memory)."""
    from localspec.api import Generation
    from localspec.config import GenerationConfig
    from localspec.decoding.profiles import Profiles

    config = GenerationConfig.from_options(max_tokens=max_tokens, seed=seed, plan=plan, **settings)
    g = Generation(target, draft, list(prompt), config, profiles or Profiles.in_memory(), "off")
    policy, steps = g.engine.policy, []
    observe = policy.observe_step

    def observed(draft_: Any, n_accepted: int, target_seconds: float, new: Sequence[int]) -> None:
        widths = Counter(draft_.tree.depths)
        steps.append([_kind(draft_) if draft_.n else "-", [widths[d] for d in range(1, max(widths, default=0) + 1)],
                      n_accepted])
        observe(draft_, n_accepted, target_seconds, new)

    policy.observe_step = observed  # an instance wrapper: the policy sees every step, with its draft
    output = [r.token for r in g if r.token is not None]
    return {"tokens": len(output), "output": output, "steps": steps}


def record_traces(target: Any, draft: Any, prompts: dict[str, list[int]], max_tokens: int, seed: int,
                  configs: Sequence[tuple] = TRACE_CONFIGS, progress: bool = True, done: Sequence[dict] = (),
                  save: Any = None) -> list[dict]:
    """A trace per (prompt, configuration, temperature); `done`: runs recorded before (kept, not
    run again); `save(runs)` is called after each run (a long recording resumes where it stopped)."""
    runs = list(done)
    have = {(r["prompt"], r["config"], r["temperature"]) for r in runs}
    total = sum(len(c[4]) for c in configs) * len(prompts)
    for name, tokens in prompts.items():
        for label, drafter, verifier, shape, temperatures in configs:
            for t in temperatures:
                if (name, label, t) in have:
                    continue
                sampling = GREEDY if t == 0 else DEFAULT_SAMPLING
                t0 = time.perf_counter()
                run = traced_run(target, None if drafter == "ngram" else draft, tokens, max_tokens=max_tokens,
                                 seed=seed, drafter=drafter, verifier=verifier, **shape, **sampling)
                runs.append({"prompt": name, "prompt_tokens": list(tokens), "config": label, "drafter": drafter,
                             "verifier": verifier, "shape": {k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in shape.items()},
                             "temperature": t, **run})
                if progress:
                    print(f"[{len(runs)}/{total}] {name} {label} T={t:g}: {run['tokens']} tokens in "
                          f"{len(run['steps'])} steps ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
                if save is not None:
                    save(runs)
    return runs


def record_main(out: Path, max_tokens: int, seed: int, threads: int | None) -> int:
    """Record the default pair's traces into `out` (written after every run; an interrupted
    recording with the same settings resumes)."""
    from head_to_head import PROMPTS, chat_tokens
    from localspec.api import load_model
    from localspec.llama import registry
    from localspec.llama.host import machine

    reg = registry.load_registry()
    pair = reg.pairs[reg.default_pair]
    settings = {"pair": {"target": pair.target, "draft": pair.draft}, "max_tokens": max_tokens, "seed": seed}
    done = []
    if out.exists():
        old = json.loads(out.read_text())
        if all(old.get(k) == v for k, v in settings.items()):
            done = old["runs"]
    options = {"threads": threads} if threads else {}
    m = machine()
    header = {**settings, "recorded_on": {"cpu": m["cpu"], "cores": m["cores"], "llama_cpp": m["llama_cpp"]}}
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(runs: list[dict]) -> None:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps({**header, "runs": runs}, separators=(",", ":")) + "\n")
        tmp.replace(out)

    with load_model(pair.target, **options) as target, load_model(pair.draft, **options) as draft:
        prompts = {name: chat_tokens(target, PROMPTS[name]) for name in TRACE_PROMPTS}
        runs = record_traces(target, draft, prompts, max_tokens, seed, done=done, save=save)
    save(runs)
    print(f"{len(runs)} traces in {out}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- prediction (from a cost curve)


class Costs:
    """Seconds per target pass of n tokens and per draft decode of n tokens (the planner's
    interpolation between measured sizes), the engine's overhead per step and each verifier's
    time per step; `source` says where they come from."""

    def __init__(self, target: dict[int, float], draft: dict[int, float], overhead: float = 0.0,
                 verify: dict[str, float] | None = None, prefill: float | None = None, source: str = "") -> None:
        from localspec.decoding.costs import CostTable

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
    T = 0 answers, replayed with these costs (benchmarks/planner_replay.py)."""
    from planner_replay import fresh_profile, planner_for, replay

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


def planner_rows(traces: dict, costs: Costs, target_bytes: int, draft_bytes: int, draft_load: float) -> dict:
    """The planner's draft-model decisions on these costs at the real pair's CPU-measured acceptance."""
    from gpu_measure import planner_decisions

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
    p.add_argument("--traces", type=Path, default=Path(__file__).resolve().parent / "data" / "acceptance_traces.json",
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
