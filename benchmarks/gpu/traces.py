"""Acceptance traces of the default pair, recorded on this CPU: for every step of a generation, what
was drafted, by which drafter, in how many levels of what width, and how many tokens were
accepted. Which tokens a step accepts does not depend on the hardware (fixed seed, fixed draft
shape), so benchmarks.gpu.predict replays them with the costs a GPU measured.

    python benchmarks/gpu_predict.py --record-traces benchmarks/data/acceptance_traces.json   # here, once (CPU)
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from benchmarks.common.prompts import HEAD_TO_HEAD_NAMES, PROMPTS
from benchmarks.common.target import chat_tokens

TRACES = Path(__file__).resolve().parents[1] / "data" / "acceptance_traces.json"  # the recorded traces
TRACE_PROMPTS = HEAD_TO_HEAD_NAMES  # head_to_head's prompts
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
    from localspec.settings.generation import GenerationConfig
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

