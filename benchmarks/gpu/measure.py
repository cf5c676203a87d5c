"""The GPU check's measurements and its loading check (benchmarks/gpu/check.py runs them).

On a pair shaped like the default one (benchmarks/gpu/models.py: Qwen 2.5 1.5B and 0.5B
dimensions, random weights, Q4_K_M), fully offloaded: the target's pass-cost curve c(n)/c(1) for
n = 1…16 and the draft's, the draft/target step-cost ratio, each verifier's share of a step at the
default sampling settings, the target alone's in-process decode speed, and what the planner
decides on that cost profile. Then loading robustness: the pair loaded and freed many times in
one process and once in each of several fresh processes (an earlier report: crashes inside
llama_model_load_from_file from a Python process on a CUDA build).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from localspec.api import stream_generate
from localspec.settings.models import ModelOptions
from localspec.decoding.profiles import Profiles
from localspec.llama.model import Model

from benchmarks.common.prompts import PROMPTS
from benchmarks.common.target import cost_curve, prefill_rate
from benchmarks.gpu import models, predict
from benchmarks.gpu.steps import Context, StepFailed, StepSkipped
from benchmarks.gpu.traces import TRACES, traced_run

CURVE = tuple(range(1, 17)) + (24, 32)  # the 1…16, and two larger passes the planner extrapolates to
DEFAULT = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)  # localspec's default sampling
SHARE_CONFIGS = (  # (verifier, shape) at the default sampling; greedy at T = 0, the only temperature it takes
    ("greedy", dict(num_draft_tokens=4)), ("match", dict(num_draft_tokens=4)), ("token", dict(num_draft_tokens=4)),
    ("block", dict(num_draft_tokens=4)), ("gbv", dict(num_draft_tokens=4, paths=3)),
    ("batch", dict(num_draft_tokens=4, paths=3)), ("rrs", dict(tree=(3, 2, 1, 1))), ("rrsw", dict(tree=(3, 2, 1, 1))),
    ("traversal", dict(tree=(3, 2, 1, 1))))
PROMPT = PROMPTS["code"]
SHAPED = dict(ctx_size=4096)


def step_shaped_models(ctx: Context) -> tuple[str, dict]:
    """The default pair's shapes, random weights, Q4_K_M (written and quantized here)."""
    t0 = time.perf_counter()
    target, draft = models.shaped_pair(ctx.work / "models", ctx.scale.shapes)
    secs = time.perf_counter() - t0
    ctx.paths.update({"shaped_target": str(target), "shaped_draft": str(draft)})
    sizes = {p.name: p.stat().st_size for p in (target, draft)}
    return (f"{ctx.scale.shapes} shapes written and quantized to Q4_K_M in {secs:.0f} s ("
            + ", ".join(f"{n} {s / 2**20:.0f} MiB" for n, s in sizes.items()) + ")"), {"seconds": secs, "bytes": sizes}


def shaped_curve(model: Model, rounds: int) -> dict[int, float]:
    """The model's cost curve at the pass sizes of CURVE it can decode."""
    return cost_curve(model, sizes=tuple(n for n in CURVE if n <= model.n_batch), rounds=rounds)


def step_cost_curve(ctx: Context) -> tuple[str, dict]:
    """c(n) of one target pass with every row's logits (a verification pass), n = 1…16, for the
    target and the draft; where their weights went; the long-prefill rate."""
    t0 = time.perf_counter()
    target = ctx.model("shaped_target", **SHAPED)
    t1 = time.perf_counter()
    draft = ctx.model("shaped_draft", **SHAPED)
    t2 = time.perf_counter()
    ct, cd = shaped_curve(target, ctx.scale.curve_rounds), shaped_curve(draft, ctx.scale.curve_rounds)
    prefill = (prefill_rate(target), prefill_rate(draft))
    ratio = cd[1] / ct[1]
    ctx.facts.update(curve_target=ct, curve_draft=cd, prefill_target=prefill[0], prefill_draft=prefill[1],
                     load_target=t1 - t0, load_draft=t2 - t1)
    data = {"target_seconds": ct, "draft_seconds": cd, "target_ratio": {n: c / ct[1] for n, c in ct.items()},
            "draft_ratio": {n: c / cd[1] for n, c in cd.items()}, "draft_over_target": ratio,
            "prefill_per_token": {"target": prefill[0], "draft": prefill[1]},
            "load_seconds": {"target": t1 - t0, "draft": t2 - t1},
            "weight_buffers_mib": {"target": target.weight_buffers, "draft": draft.weight_buffers}}
    on_cpu = [n for n, m in (("target", target), ("draft", draft))
              if sum(v for k, v in m.weight_buffers.items() if not k.upper().startswith("CPU"))
              < 0.5 * sum(m.weight_buffers.values())]
    line = (f"target c(1) {ct[1] * 1e3:.2f} ms, c(8)/c(1) {ct.get(8, 0) / ct[1]:.2f}, c(16)/c(1) "
            f"{ct.get(16, 0) / ct[1]:.2f}; draft c(1) {cd[1] * 1e3:.2f} ms, draft/target {ratio:.2f}")
    if ctx.gpu and on_cpu:
        raise StepFailed(f"the {' and '.join(on_cpu)} weights stayed in CPU buffers with --n-gpu-layers -1", data)
    return line, data


def step_verifier_share(ctx: Context) -> tuple[str, dict]:
    """Each verifier on the shaped pair at the default sampling (greedy at T = 0), plan fixed:
    its share of the step, its seconds per step, tokens per second."""
    target, draft = ctx.model("shaped_target", **SHAPED), ctx.model("shaped_draft", **SHAPED)
    rows = {}
    for verifier, shape in SHARE_CONFIGS:
        sampling = dict(temperature=0.0) if verifier == "greedy" else DEFAULT
        last = None
        for last in stream_generate(target, draft, PROMPT, max_tokens=ctx.scale.share_tokens, seed=1, plan="fixed",
                                    drafter="model", verifier=verifier, **shape, **sampling):
            pass
        s = last.stats
        rows[verifier] = {"shape": shape, "verifier_share": s.verifier_share, "tokens": s.generated_tokens,
                          "steps": s.target_passes, "verify_ms_per_step": 1e3 * s.verify_seconds / max(1, s.target_passes),
                          "draft_ms_per_step": 1e3 * s.draft_seconds / max(1, s.target_passes),
                          "target_ms_per_step": 1e3 * s.target_seconds / max(1, s.target_passes),
                          "tokens_per_second": s.tokens_per_second}
    ctx.facts["verify_ms"] = {v: r["verify_ms_per_step"] for v, r in rows.items()}
    worst = max(rows, key=lambda v: rows[v]["verifier_share"])
    return ("verifier share of a step: " + ", ".join(f"{v} {100 * r['verifier_share']:.1f} %" for v, r in rows.items())
            + f" (largest: {worst})"), rows


def step_decode_speed(ctx: Context) -> tuple[str, dict]:
    """The target alone (and the draft alone) decoding in-process, greedy; the engine's per-token
    overhead over a bare c(1)."""
    target, draft = ctx.model("shaped_target", **SHAPED), ctx.model("shaped_draft", **SHAPED)
    data = {}
    for name, m in (("target", target), ("draft", draft)):
        last = None
        for last in stream_generate(m, None, PROMPT, max_tokens=ctx.scale.decode_tokens, temperature=0.0,
                                    num_draft_tokens=0):
            pass
        s = last.stats
        data[name] = {"tokens": s.generated_tokens, "seconds": s.elapsed_seconds, "tokens_per_second": s.tokens_per_second}
    curve = ctx.facts.get("curve_target")
    if curve:
        per_token = data["target"]["seconds"] / max(1, data["target"]["tokens"])
        data["overhead_ms_per_token"] = ctx.facts["overhead_ms"] = 1e3 * (per_token - curve[1])
    line = (f"target alone {data['target']['tokens_per_second']:.1f} tok/s, draft alone "
            f"{data['draft']['tokens_per_second']:.1f} tok/s")
    if "overhead_ms_per_token" in data:
        line += f"; engine overhead {data['overhead_ms_per_token']:.2f} ms per token over c(1)"
    return line, data


def step_planner(ctx: Context) -> tuple[str, dict]:
    """The planner on the measured GPU profile: its decisions for a grid of acceptance rates, and a
    real `--drafter auto` run with the draft given but not loaded (does the engine load it? what
    depths does it draft?). The shaped models' weights are random, so the real run's draft is
    rejected: it shows the loading decision and the planner backing off, not a speedup."""
    from localspec.llama.lazy import LazyModel

    f = ctx.facts
    if "curve_target" not in f:
        raise StepSkipped("needs the cost curve (step cost_curve)")
    tpath, dpath = ctx.path("shaped_target"), ctx.path("shaped_draft")
    data = predict.planner_decisions(f["curve_target"], f["curve_draft"], target_bytes=tpath.stat().st_size,
                             draft_bytes=dpath.stat().st_size, draft_load=f["load_draft"],
                             prefill_t=f["prefill_target"], prefill_d=f["prefill_draft"])
    target = ctx.model("shaped_target", **SHAPED)
    lazy = LazyModel(dpath, ModelOptions(n_gpu_layers=-1, **SHAPED))
    profiles = Profiles(ctx.work / "planner-profiles")
    runs = []
    try:
        for i in range(2):  # the second run starts from the profile the first one learned
            run = traced_run(target, lazy, target.tokenize(PROMPT), max_tokens=ctx.scale.planner_tokens, seed=i,
                             plan="auto", drafter="auto", profiles=profiles, **DEFAULT)
            depths = [sum(w) for _, w, _ in run["steps"]]
            runs.append({"draft_loaded": lazy.loaded, "steps": len(run["steps"]), "tokens": run["tokens"],
                         "kinds": sorted({k for k, _, _ in run["steps"]}), "draft_nodes_per_step": depths})
    finally:
        lazy.close()
    data["runs"] = runs
    return (f"auto loads the draft: {'yes' if data['loads_draft'] else 'no'} (the engine's run: "
            f"{'loaded' if runs[-1]['draft_loaded'] else 'not loaded'}); depth at α 0.7: "
            f"{data['alpha 0.7']['depth']} ({data['alpha 0.7']['predicted_speedup']:.2f}×), at α 0.9: "
            f"{data['alpha 0.9']['depth']} ({data['alpha 0.9']['predicted_speedup']:.2f}×)"), data


LOAD_CHILD = """
import sys
from localspec.settings.models import ModelOptions
from localspec.llama.model import Model
opts = ModelOptions(ctx_size=512, batch_size=64, n_seq_max=1, n_gpu_layers=-1)
for path in sys.argv[1:]:
    with Model(path, opts) as m:
        m.prefill([max(m.bos, 0)], 0)
print("ok")
"""


def step_loading(ctx: Context) -> tuple[str, dict]:
    """Load, use and free the target and the draft N times in one process, then in M fresh
    processes: no crash, no error (the earlier report's llama_model_load_from_file crash)."""
    names = ("shaped_target", "shaped_draft") if "shaped_target" in ctx.paths else ("q4_k_m_target", "q4_k_m_draft")
    paths = [str(ctx.path(n)) for n in names]
    ctx.close_models()  # nothing of ours holds device memory meanwhile
    opts = ModelOptions(ctx_size=512, batch_size=64, n_seq_max=1, n_gpu_layers=-1)
    reserve = 20.0  # seconds kept for the steps after this one
    times, done_in = [], 0
    for _ in range(ctx.scale.loads_in_process):
        if ctx.left() < reserve:
            break
        t0 = time.perf_counter()
        for path in paths:
            with Model(path, opts) as m:
                m.prefill([max(m.bos, 0)], 0)
        times.append(time.perf_counter() - t0)
        done_in += 1
    outcomes = []
    for _ in range(ctx.scale.load_processes):
        if ctx.left() < reserve:
            break
        out = subprocess.run([sys.executable, "-c", LOAD_CHILD, *paths], capture_output=True, text=True, timeout=300,
                             stdin=subprocess.DEVNULL)
        rc = out.returncode
        outcomes.append("ok" if rc == 0 and out.stdout.strip().endswith("ok") else
                        f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}: {out.stderr.strip()[-300:]}")
    data = {"models": [Path(p).name for p in paths], "in_process": done_in, "in_process_asked": ctx.scale.loads_in_process,
            "seconds_per_pair": times, "processes": outcomes, "processes_asked": ctx.scale.load_processes}
    bad = [o for o in outcomes if o != "ok"]
    if bad:
        raise StepFailed(f"{len(bad)} of {len(outcomes)} fresh processes failed: {bad[0]}", data)
    line = (f"{done_in}/{ctx.scale.loads_in_process} loads in one process, {len(outcomes)}/{ctx.scale.load_processes} "
            f"fresh processes, no crash ({', '.join(data['models'])}; "
            f"{sum(times) / max(1, len(times)):.2f} s per pair)")
    if done_in < ctx.scale.loads_in_process or len(outcomes) < ctx.scale.load_processes:
        data["partial"] = True
        line += "; cut short by the time budget"
    return line, data


def step_prediction(ctx: Context) -> tuple[str, dict]:
    """The default pair's GPU speedups predicted from this run's costs and the acceptance traces
    recorded on a CPU (benchmarks/gpu/predict.py), as markdown in the report."""
    f = ctx.facts
    if "curve_target" not in f:
        raise StepSkipped("needs the cost curve (step cost_curve)")
    if not TRACES.exists():
        raise StepSkipped(f"no acceptance traces in {TRACES} (gpu_predict.py --record-traces makes them)")
    traces = json.loads(TRACES.read_text())
    where = "this GPU" if ctx.gpu else "this CPU (a dry run)"
    costs = predict.Costs(f["curve_target"], f["curve_draft"], max(0.0, f.get("overhead_ms", 0.0)) / 1e3,
                              {v: ms / 1e3 for v, ms in f.get("verify_ms", {}).items()}, f.get("prefill_target"),
                              source=f"measured by benchmarks/gpu_check.py on {where} (shaped models)")
    rows = predict.predict(traces, costs)
    ngram = predict.ngram_auto(traces, costs)
    planner = predict.planner_rows(traces, costs, ctx.path("shaped_target").stat().st_size,
                                   ctx.path("shaped_draft").stat().st_size, f.get("load_draft", 1.0))
    text = predict.markdown(traces, costs, rows, ngram, planner)
    best = max(rows, key=lambda r: r["speedup"])
    return (f"{len(rows)} configurations predicted; best {best['config']} T={best['temperature']:g} "
            f"{best['speedup']:.2f}×"), {"markdown": text, "rows": rows, "ngram_auto": ngram, "planner": planner}
