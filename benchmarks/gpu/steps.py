"""The GPU check's framework and first correctness steps (benchmarks/gpu/check.py runs them;
features.py has the feature steps, measure.py the measurements).

Each step is a function of a :class:`Context` that returns ``(summary line, data)``, raises
:class:`StepFailed` (the check found a fault: the message says which) or :class:`StepSkipped`
(it could not run here: why). Every model is loaded with all layers offloaded
(``n_gpu_layers=-1``, target and draft); on a CPU build (the ``--cpu`` dry run) that is a no-op
and the same code runs. Models are tiny (the test suite's: localspec.llama.tiny_pairs) and written
by the first step.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from localspec.api import stream_generate
from localspec.settings.models import ModelOptions
from localspec.llama.model import Model
from localspec.prompt import prompt_tokens
from localspec.llama.tiny_model import QUANTIZABLE, quantize
from localspec.llama.tiny_pairs import QUANTIZATIONS, TOOLS_VOCAB, make_pair, write_tiny_model
from localspec.verify.stats import chi2_sf

from benchmarks.common.runs import run_localspec

NEAR_TIE = {"f32": 1e-3, "q4_k_m": 0.02}  # logits: batch-shape noise (tests/greedy.py, tests/test_quantized.py)
EXACT = dict(cache_type="f32", flash_attn="off")  # tests/conftest.py's exact settings (threads: all)
PROMPT = "def add(a, b): return a"
NGRAM_PROMPT = "def add(a, b): return a + b. def add(a, b): return a + b. def add(a, b): return"
# every verifier with every drafter and shape it accepts (tests/test_engine.py's CONFIGS)
GREEDY_CONFIGS = [
    ("greedy", "model", dict(num_draft_tokens=4)), ("match", "model", dict(num_draft_tokens=4)),
    ("token", "model", dict(num_draft_tokens=4)), ("block", "model", dict(num_draft_tokens=4)),
    ("block", "model", dict(num_draft_tokens=8)), ("gbv", "model", dict(num_draft_tokens=4, paths=3)),
    ("batch", "model", dict(num_draft_tokens=4, paths=3)), ("rrs", "model", dict(tree=(3, 2, 1))),
    ("rrsw", "model", dict(tree=(3, 2, 1))), ("traversal", "model", dict(tree=(3, 2, 1))),
    ("greedy", "model", dict(tree=(2, 2))), ("match", "model", dict(tree=(2, 2))),
    ("block", "ngram", dict(num_draft_tokens=4)), ("token", "ngram", dict(num_draft_tokens=4)),
    ("match", "ngram", dict(num_draft_tokens=4)), ("greedy", "ngram", dict(num_draft_tokens=4)),
    ("block", "hybrid", dict(num_draft_tokens=4)), ("traversal", "hybrid", dict(tree=(2, 2))),
    ("gbv", "hybrid", dict(num_draft_tokens=3, paths=2)),
]
# the two-sample test at T = 1 (tests/test_engine.py's DIST_CONFIGS)
DIST_CONFIGS = [
    ("match", "model", dict(num_draft_tokens=3)), ("token", "model", dict(num_draft_tokens=3)),
    ("block", "model", dict(num_draft_tokens=3)), ("gbv", "model", dict(num_draft_tokens=3, paths=2)),
    ("batch", "model", dict(num_draft_tokens=3, paths=2)), ("rrs", "model", dict(tree=(2, 2))),
    ("rrsw", "model", dict(tree=(2, 2))), ("traversal", "model", dict(tree=(2, 2))),
    ("block", "hybrid", dict(num_draft_tokens=3)), ("block", "model", dict(num_draft_tokens=3, plan="auto")),
]
T1 = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
ALPHA = 1e-3  # each two-sample test's false-positive rate
N_FIRST, N_BINS = 3, 53


@dataclass(frozen=True)
class Scale:
    """How much each step does: "full" on the GPU, "quick" for the CPU dry run (CI)."""

    greedy_tokens: int
    greedy_models: tuple[str, ...]
    spec_samples: int
    plain_samples: int
    dist_configs: int  # how many of DIST_CONFIGS
    seeds: int  # constrained and tool-call generations
    loads_in_process: int
    load_processes: int
    curve_rounds: int
    decode_tokens: int
    share_tokens: int
    planner_tokens: int
    shapes: str  # benchmarks.gpu.models.SHAPES key


SCALES = {
    "full": Scale(40, ("f32", "q4_k_m"), 700, 2100, len(DIST_CONFIGS), 4, 20, 10, 5, 128, 64, 128, "default"),
    "quick": Scale(8, ("q4_k_m",), 80, 240, 1, 2, 2, 1, 2, 8, 4, 8, "small"),
}


class StepFailed(Exception):
    """The check found a fault; `data` holds what was measured."""

    def __init__(self, message: str, data: dict | None = None) -> None:
        super().__init__(message)
        self.data = data or {}


class StepSkipped(Exception):
    """The step could not run here (why)."""


@dataclass
class Context:
    """What the steps share: settings, the work folder, the models written, models kept loaded."""

    work: Path
    scale: Scale
    gpu: bool  # a GPU run: GPU-only expectations hold (offload supported, weights on the device)
    deadline: float  # time.time() at which the run's budget ends
    paths: dict[str, str] = field(default_factory=dict)  # model name -> file (the models steps write)
    facts: dict[str, Any] = field(default_factory=dict)  # measured values later steps use
    loaded: dict[tuple, Model] = field(default_factory=dict)

    def path(self, name: str) -> Path:
        if name not in self.paths:
            raise StepSkipped(f"model {name!r} was not written (an earlier step failed or was skipped)")
        return Path(self.paths[name])

    def model(self, name: str, **options: Any) -> Model:
        """A model of `paths`, fully offloaded, loaded once per runner process and options."""
        key = (name, tuple(sorted(options.items())))
        if key not in self.loaded:
            # one CPU thread on a CPU build (as the tests: llama.cpp's spinning threads crawl on a busy
            # machine); on a GPU the CPU does little, and gets llama.cpp's default
            opts = dict(ctx_size=2048, batch_size=256, n_gpu_layers=-1, threads=None if self.gpu else 1)
            opts.update(options)
            self.loaded[key] = Model(self.path(name), ModelOptions(**opts))
        return self.loaded[key]

    def close_models(self) -> None:
        for m in self.loaded.values():
            m.close()
        self.loaded.clear()

    def left(self) -> float:
        return self.deadline - time.time()


Step = Callable[[Context], "tuple[str, dict]"]


# ---------------------------------------------------------------- models


def step_tiny_models(ctx: Context) -> tuple[str, dict]:
    """The tiny pairs of the test suite: F32, far draft, Q4_K_M (llama.cpp's quantizer), tool-calling vocab."""
    from localspec.llama import backend

    backend.init()  # the quantizer's log goes to logging, not to stderr
    d = ctx.work / "models"
    t0 = time.perf_counter()
    target, draft = make_pair(d, seed=0, noise=0.05)
    far = write_tiny_model(d / "tiny-draft-far.gguf", seed=0, noise=0.5)
    qt = write_tiny_model(d / "q-target-f32.gguf", seed=1, **QUANTIZABLE)
    qd = write_tiny_model(d / "q-draft-f32.gguf", seed=1, noise=0.05, **QUANTIZABLE)
    ftype = QUANTIZATIONS["q4_k_m"]
    q = (quantize(qt, d / "q-target-q4_k_m.gguf", ftype), quantize(qd, d / "q-draft-q4_k_m.gguf", ftype))
    tools = (write_tiny_model(d / "tools-target.gguf", seed=2, vocab=TOOLS_VOCAB),
             write_tiny_model(d / "tools-draft.gguf", seed=2, noise=0.05, vocab=TOOLS_VOCAB))
    ctx.paths.update({"f32_target": str(target), "f32_draft": str(draft), "far_draft": str(far),
                      "q4_k_m_target": str(q[0]), "q4_k_m_draft": str(q[1]),
                      "tools_target": str(tools[0]), "tools_draft": str(tools[1])})
    secs = time.perf_counter() - t0
    return f"7 tiny models written and quantized in {secs:.1f} s", {"seconds": secs, "paths": dict(ctx.paths)}


# ---------------------------------------------------------------- info


def step_info(ctx: Context) -> tuple[str, dict]:
    """`localspec info --json` with a model loaded fully offloaded: the devices and where its weights went."""
    model = ctx.path("q4_k_m_target")
    try:
        out = run_localspec(["info", "--json", "-m", str(model), "--n-gpu-layers", "-1"],
                            env={**os.environ, "LOCALSPEC_KEEP_ALIVE": "0"}, timeout=300)
    except RuntimeError as exc:
        raise StepFailed(f"localspec info: {str(exc).strip()[-500:]}") from None
    info = json.loads(out.stdout)
    lc = info["llama_cpp"]
    devices = lc.get("devices") if isinstance(lc.get("devices"), list) else []
    buffers = (info.get("cpu_kernels") or {}).get("model", {}).get("weight_buffers_mib", {})
    data = {"gpu_offload": lc.get("gpu_offload"), "system_info": lc.get("system_info"), "devices": devices,
            "weight_buffers_mib": buffers, "verifier": info["verifier"].get("self_test")}
    gpus = [d for d in devices if d.get("type") in ("gpu", "igpu")]
    on_device = sum(mib for name, mib in buffers.items() if not name.upper().startswith("CPU"))
    line = (f"GPU offload {'supported' if lc.get('gpu_offload') else 'not in this build'}; devices: "
            + (", ".join(f"{d['name']} ({d['description']})" for d in devices) or "none")
            + "; weights: " + (", ".join(f"{n} {v:.1f} MiB" for n, v in sorted(buffers.items())) or "?"))
    if ctx.gpu:
        if not lc.get("gpu_offload") or not gpus:
            raise StepFailed("this llama.cpp build has no GPU backend or sees no GPU: " + line, data)
        if on_device < 0.5 * sum(buffers.values()):
            raise StepFailed("with --n-gpu-layers -1 most weights stayed in CPU buffers: " + line, data)
    return line, data


# ---------------------------------------------------------------- greedy equality


def tokens_of(target: Model, draft: Model | None, prompt: str, **kw: Any) -> list[int]:
    kw.setdefault("plan", "fixed")
    return [r.token for r in stream_generate(target, draft, prompt, **kw) if r.token is not None]


def logit_gaps(target: Model, context: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """How far below the target's best logit after `context` each token's logit lies."""
    target.clear()
    target.prefill(list(context), 0)
    row = np.array(target.logits_array(1)[0], dtype=np.float64)
    target.clear()
    return [float(row.max() - row[t]) for t in tokens]


def greedy_difference(target: Model, prompt: str, got: Sequence[int], want: Sequence[int],
                      tol: float) -> tuple[str, float | None]:
    """("equal" | "near-tie" | the fault, the larger gap at the first difference)."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return ("equal", None) if len(got) == len(want) else (f"one output stops early ({len(got)} vs {len(want)})", None)
    gap = max(logit_gaps(target, prompt_tokens(target, prompt) + list(want[:i]), (got[i], want[i])))
    return ("near-tie" if gap <= tol else f"differs at token {i}, {gap:.3g} logits below the best"), gap


def step_greedy(ctx: Context) -> tuple[str, dict]:
    """T = 0: every verifier with every drafter reproduces the target alone's greedy output (up to near-ties)."""
    data: dict[str, Any] = {}
    faults = []
    for kind in ctx.scale.greedy_models:
        opts = EXACT if kind == "f32" else {}
        target, draft = ctx.model(f"{kind}_target", **opts), ctx.model(f"{kind}_draft", **opts)
        counts: Counter = Counter()
        gaps = []
        for prompt in (PROMPT, NGRAM_PROMPT):
            plain = tokens_of(target, None, prompt, temperature=0, max_tokens=ctx.scale.greedy_tokens)
            for verifier, drafter, shape in GREEDY_CONFIGS:
                spec = tokens_of(target, draft, prompt, temperature=0, max_tokens=ctx.scale.greedy_tokens,
                                 verifier=verifier, drafter=drafter, **shape)
                verdict, gap = greedy_difference(target, prompt, spec, plain, NEAR_TIE[kind])
                counts[verdict if verdict in ("equal", "near-tie") else "fault"] += 1
                if gap is not None:
                    gaps.append(gap)
                if verdict not in ("equal", "near-tie"):
                    faults.append(f"{kind} {verifier}/{drafter} {shape}: {verdict}")
        data[kind] = {"runs": sum(counts.values()), **counts, "largest_gap": max(gaps, default=0.0)}
    line = "; ".join(f"{k}: {v.get('equal', 0)} equal, {v.get('near-tie', 0)} near-ties of {v['runs']}"
                     for k, v in data.items())
    if faults:
        raise StepFailed(f"{len(faults)} greedy run(s) diverged: " + "; ".join(faults[:4]), data)
    return line, data


# ---------------------------------------------------------------- losslessness at T > 0


def first_tokens(target: Model, draft: Model | None, seed: int, prompt: str = "ab", **kw: Any) -> tuple[int, ...]:
    kw.setdefault("plan", "fixed")
    return tuple(r.token for r in stream_generate(target, draft, prompt, max_tokens=N_FIRST, seed=seed, **T1, **kw))


def two_sample_p(a: Sequence[tuple[int, ...]], b: Sequence[tuple[int, ...]]) -> float:
    """Pearson's chi-square test of homogeneity of a fixed function of the first tokens (the first
    token exactly, a hash of the rest), rare categories pooled (tests/test_engine.py's, without SciPy)."""
    def bins(samples: Sequence[tuple[int, ...]]) -> Counter:
        return Counter((s[0], hash(s[1:]) % N_BINS) for s in samples)

    ca, cb = bins(a), bins(b)
    keys = sorted(set(ca) | set(cb))
    table = np.array([[ca[k] for k in keys], [cb[k] for k in keys]], dtype=float)
    expected = table.sum(0) * table.sum(1, keepdims=True) / table.sum()
    small = expected.min(0) < 5
    if small.any():
        table = np.column_stack([table[:, ~small], table[:, small].sum(1)])
        expected = table.sum(0) * table.sum(1, keepdims=True) / table.sum()
    if table.shape[1] < 2:
        return 1.0
    stat = float(((table - expected) ** 2 / expected).sum())
    return chi2_sf(stat, table.shape[1] - 1)


def step_lossless(ctx: Context) -> tuple[str, dict]:
    """T = 1: each verifier's first tokens follow the target alone's law (two-sample chi-square, as
    tests/test_engine.py), and the same test rejects a lossy verifier (lenience 0.9)."""
    target, far = ctx.model("f32_target", **EXACT), ctx.model("far_draft", **EXACT)
    s = ctx.scale
    plain = [first_tokens(target, None, 10**6 + i) for i in range(s.plain_samples)]
    data: dict[str, Any] = {"spec_samples": s.spec_samples, "plain_samples": s.plain_samples, "alpha": ALPHA}
    faults = []
    for verifier, drafter, shape in DIST_CONFIGS[:s.dist_configs]:
        spec = [first_tokens(target, far, i, verifier=verifier, drafter=drafter, **shape) for i in range(s.spec_samples)]
        p = two_sample_p(spec, plain)
        data[f"{verifier}/{drafter}/{shape}"] = p
        if p <= ALPHA:
            faults.append(f"{verifier}/{drafter} {shape} (p = {p:.2g})")
    lossy = [first_tokens(target, far, i, verifier="token", num_draft_tokens=3, lenience=0.9)
             for i in range(s.spec_samples)]
    data["negative control p"] = control = two_sample_p(lossy, plain)
    if faults:
        raise StepFailed("first-token law differs from the target's: " + ", ".join(faults), data)
    if control > ALPHA:
        raise StepFailed(f"the test has no power: a lossy verifier passed (p = {control:.2g})", data)
    worst = min(v for k, v in data.items() if "/" in k)
    return (f"{s.dist_configs} configurations pass at α = {ALPHA:g} (lowest p {worst:.3f}); a lossy verifier is "
            f"rejected (p = {control:.1e})"), data
