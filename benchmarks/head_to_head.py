#!/usr/bin/env python3
"""Head to head: localspec against llama.cpp's own speculative decoding, on the default pair.

    python benchmarks/head_to_head.py                       # builds llama.cpp tools once (~5 min)
    python benchmarks/head_to_head.py --repeat 2 --out docs/head-to-head.md   # the committed report
    python benchmarks/head_to_head.py --skip-throughput --skip-memory        # verifier comparison only
    python benchmarks/head_to_head.py --llama-bin ~/llama.cpp/build/bin

One run measures, on the same prompts (chat-templated code, prose, code-edit, summarise) with
the same sampling settings and threads: the target alone (localspec, draft=None: the baseline),
llama.cpp's ``llama-speculative-simple`` with the draft model and with ngram-mod, built from the
llama.cpp source that the installed llama-cpp-python vendors, and localspec with each verifier
and drafter. It prints markdown tables (tok/s, speedup against the target alone, block
efficiency, acceptance, verifier share of step time), a what-if table of predicted speedups for
cheaper drafts, a paired verifier comparison at T = 1, γ = 8 (every verifier on the same drafts
at the same contexts, with bootstrap intervals: benchmarks/efficiency.py), and peak memory at an 8k
context per load mode and KV cache type.
Progress goes to stderr, tables to stdout (and to --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Sequence

import numpy as np

from localspec.llama import registry
from localspec.api import load_model, stream_generate
from localspec.prompt import check_messages, prompt_tokens, render_messages, template_of
from localspec.decoding.lookup import ContextLookup
from localspec.decoding.costs import CostTable

from efficiency import default_groups, paired_ratio, paired_scores, target_contexts  # benchmarks/

log = logging.getLogger("head_to_head")

PROMPTS = {
    "code": "Write a Python function that checks whether a number is prime, with a docstring.",
    "prose": "Write a short story (about 150 words) about a lighthouse keeper who finds a message in a bottle.",
    "code-edit": ("Add type hints to this function and return the whole function, unchanged otherwise:\n\n"
                  "def mean(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n"
                  "    if not numbers:\n        return 0.0\n    return total / len(numbers)\n\n"
                  "def median(numbers):\n    ordered = sorted(numbers)\n    mid = len(ordered) // 2\n"
                  "    if len(ordered) % 2:\n        return ordered[mid]\n"
                  "    return (ordered[mid - 1] + ordered[mid]) / 2\n"),
    "summarise": ("Repeat the key sentences of this paragraph as a bulleted list, keeping their wording:\n\n"
                  "Speculative decoding speeds up text generation by letting a small draft model propose "
                  "several tokens, which the large target model then checks in a single forward pass. "
                  "Tokens the target agrees with are kept; the first disagreement is replaced by a token "
                  "drawn from a corrected distribution, so the output is distributed exactly as if the "
                  "target had generated it alone. The speedup depends on how often the draft is right "
                  "and on how much cheaper the draft is than the target."),
}
GROUNDED = ("code-edit", "summarise")  # input-grounded prompts: the answer repeats the prompt
SAMPLING = dict(top_k=40, top_p=0.95, min_p=0.05)  # llama.cpp's defaults, used on both sides
K = 4


@dataclass(frozen=True)
class Row:
    prompt: str
    temperature: float
    system: str  # "localspec" or "llama.cpp"
    drafter: str
    verifier: str
    plan: str
    tokens: int
    seconds: float
    block_efficiency: float | None
    acceptance: float | None
    verifier_share: float | None

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# ---------------------------------------------------------------- llama.cpp tools


def llama_cpp_version() -> str:
    return metadata.version("llama-cpp-python")


LLAMA_TOOLS = ("llama-speculative-simple", "llama-completion", "llama-server")


def expected_tokens(alpha: float, depth: int) -> float:
    """E[tokens per step] for a chain of `depth` drafts with per-level acceptance α."""
    if alpha >= 1.0:
        return depth + 1.0
    return (1.0 - alpha ** (depth + 1)) / (1.0 - alpha)


def host_header() -> list[str]:
    """The host every figure belongs to: CPU model, llama.cpp's feature line, its extra buffer types."""
    from localspec.llama import buffer_types
    from localspec.llama.host import machine

    m = machine()
    extra = ", ".join(buffer_types.extra_buffer_types()) or "none"
    return [f"Host: **{m['cpu']}**, {m['cores']} cores; llama-cpp-python {m['llama_cpp']}; "
            f"llama.cpp `{m['build'].strip().rstrip('|').strip()}`; CPU extra buffer types: {extra}.", ""]


def native_llama_tools() -> Path:
    """llama.cpp's tools built natively (the CPU kernels localspec runs), once, in the bench cache."""
    return build_llama_tools(Path.home() / ".cache" / "localspec-bench", llama_cpp_version(), os.cpu_count() or 1,
                             native=True)


def build_llama_tools(cache: Path, version: str, jobs: int, native: bool = False) -> Path:
    """llama.cpp's llama-speculative-simple, llama-completion and llama-server, built from the llama.cpp that
    llama-cpp-python==version vendors: portable by default, `native` as llama-cpp-python's own
    default build is (-march=native: the same CPU kernels localspec runs)."""
    flags = os.environ.get("CMAKE_ARGS", "-DGGML_NATIVE=on" if native else "-DGGML_NATIVE=off").split()
    src_root = cache / f"llama.cpp-{version}"
    build = src_root / ("build-native" if native else "build")
    bindir = build / "bin"
    if all((bindir / tool).exists() for tool in LLAMA_TOOLS):
        return bindir
    if not (src_root / "src").exists():
        _fetch_llama_source(src_root, version)
    log.warning("building %s (%s; a few minutes)", ", ".join(LLAMA_TOOLS), " ".join(flags))
    subprocess.run(["cmake", "-S", str(src_root / "src"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", *flags], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", *LLAMA_TOOLS, "-j", str(jobs)],
                   check=True, stdout=subprocess.DEVNULL)
    return bindir


def _fetch_llama_source(src_root: Path, version: str) -> None:
    """The llama.cpp source that llama-cpp-python==version vendors, into src_root/src."""
    src_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log.warning("downloading the llama-cpp-python %s source (pip download)", version)
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}",
                        "--no-binary", ":all:", "--no-deps", "-d", tmp, "-q"], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12
            tar.extractall(tmp, **safe)
        vendored = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        src = src_root / "src"
        if src.exists():
            shutil.rmtree(src)
        shutil.copytree(vendored, src)


def run_llama_speculative(bindir: Path, target: Path, draft: Path, prompt_text: str, spec_type: str,
                          temperature: float, tokens: int, threads: int, seed: int) -> dict:
    """One llama-speculative-simple run; its decode speed and draft statistics."""
    cmd = [str(bindir / "llama-speculative-simple"), "-m", str(target), "-p", prompt_text, "-n", str(tokens),
           "-c", "4096", "-t", str(threads), "--temp", str(temperature), "--top-k", str(SAMPLING["top_k"]),
           "--top-p", str(SAMPLING["top_p"]), "--min-p", str(SAMPLING["min_p"]), "--seed", str(seed),
           "--spec-type", spec_type, "--spec-draft-n-max", str(K)]
    if spec_type.startswith("draft"):
        cmd += ["-md", str(draft), "-td", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    log_text = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log_text)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"llama-speculative-simple failed ({out.returncode}):\n{log_text[-2000:]}")
    drafted = int(re.search(r"n_drafted\s*=\s*(\d+)", log_text).group(1))
    accepted = int(re.search(r"n_accept\s*=\s*(\d+)", log_text).group(1))
    return dict(tokens=int(m.group(1)), seconds=float(m.group(2)), drafted=drafted, accepted=accepted)


# ---------------------------------------------------------------- localspec runs


def run_localspec(target, draft, prompt_tokens: list[int], temperature: float, tokens: int, seed: int,
                  **spec) -> dict:
    last, output = None, []
    for last in stream_generate(target, draft, prompt_tokens, max_tokens=tokens, temperature=temperature,
                                seed=seed, **SAMPLING, **spec):
        if last.token is not None:
            output.append(last.token)
    s = last.stats
    return dict(tokens=s.generated_tokens, seconds=s.elapsed_seconds, passes=s.target_passes,
                drafted=s.drafted_tokens, accepted=s.accepted_tokens, verify_share=s.verifier_share,
                output=output)


def chat_tokens(target, prompt: str) -> list[int]:
    """The prompt as one chat-templated user message, tokenized as stream_generate would."""
    return prompt_tokens(target, [{"role": "user", "content": prompt}])


def greedy_answer(target, prompt: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt tokens, the target alone's greedy answer) for `prompt` as one chat message: the
    output any lossless speculation at T = 0 reproduces."""
    tokens = chat_tokens(target, prompt)
    output = [r.token for r in stream_generate(target, None, tokens, temperature=0, max_tokens=max_tokens,
                                               num_draft_tokens=0)]
    return list(tokens), output


LOCALSPEC_CONFIGS = [  # (drafter, verifier, plan, uses the draft model)
    ("model", "match", "fixed"),
    ("model", "token", "fixed"),
    ("model", "block", "fixed"),
    ("model", "block", "auto"),
    ("ngram", "block", "fixed"),
    ("ngram", "block", "auto"),
    ("hybrid", "block", "fixed"),
    ("hybrid", "block", "auto"),
]


def localspec_configs(prompt: str, ngram_k: int) -> list[tuple[str, str, str, int]]:
    """(drafter, verifier, plan label, draft length) of localspec's runs on one prompt: the fixed set at
    k = K, plus n-gram and hybrid drafts planned up to ngram_k tokens on the input-grounded prompts."""
    configs = [(drafter, verifier, plan, K) for drafter, verifier, plan in LOCALSPEC_CONFIGS]
    if ngram_k and prompt in GROUNDED:
        configs += [(drafter, "block", f"auto k{ngram_k}", ngram_k) for drafter in ("ngram", "hybrid")]
    return configs


def measure_all(args, target, draft, target_path: Path, draft_path: Path,
                bindir: Path | None) -> tuple[list[Row], dict[tuple[str, float], tuple[list[int], list[int]]]]:
    """Every throughput row (repeats merged), and per (prompt, T) the prompt tokens and the target-only
    run's output tokens."""
    rows: list[Row] = []
    outputs: dict[tuple[str, float], tuple[list[int], list[int]]] = {}
    prompts = {name: PROMPTS[name] for name in args.prompts}
    total = sum(len(args.temperatures) * args.repeat * (1 + len(localspec_configs(name, args.ngram_k))
                                                        + (2 if bindir else 0)) for name in prompts)
    done = 0
    for name, prompt in prompts.items():
        text = render_messages(target, template_of(target), check_messages([{"role": "user", "content": prompt}]),
                               True, None)
        ptoks = chat_tokens(target, prompt)
        for t, rep in ((t, rep) for t in args.temperatures for rep in range(args.repeat)):
            def progress(what: str) -> None:
                nonlocal done
                done += 1
                print(f"\r[{done}/{total}] {name} T={t:g} #{rep + 1} {what:<40}", end="", file=sys.stderr,
                      flush=True)

            progress("target only")
            r = run_localspec(target, None, ptoks, t, args.tokens, args.seed, num_draft_tokens=0)
            rows.append(Row(name, t, "localspec", "-", "target only", "-", r["tokens"], r["seconds"], 1.0,
                            None, r["verify_share"]))
            outputs.setdefault((name, t), (ptoks, r["output"]))
            for drafter, verifier, plan, k in localspec_configs(name, args.ngram_k):
                progress(f"localspec {drafter} {verifier} {plan}")
                r = run_localspec(target, None if drafter == "ngram" else draft, ptoks, t, args.tokens, args.seed,
                                  verifier=verifier, num_draft_tokens=k, drafter=drafter, plan=plan.split()[0])
                rows.append(Row(name, t, "localspec", drafter, verifier, plan, r["tokens"], r["seconds"],
                                r["tokens"] / r["passes"], r["accepted"] / r["drafted"] if r["drafted"] else None,
                                r["verify_share"]))
            if bindir is None:
                continue
            for spec_type, drafter in (("draft-simple", "model"), ("ngram-mod", "ngram")):
                progress(f"llama.cpp {spec_type}")
                r = run_llama_speculative(bindir, target_path, draft_path, text, spec_type, t, args.tokens,
                                          args.threads, args.seed)
                steps = r["tokens"] - r["accepted"]  # each step commits its accepted tokens + one
                rows.append(Row(name, t, "llama.cpp", drafter, "match", "fixed", r["tokens"], r["seconds"],
                                r["tokens"] / steps if steps > 0 else None,
                                r["accepted"] / r["drafted"] if r["drafted"] else None, None))
    print("", file=sys.stderr)
    return merge_repeats(rows), outputs


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def merge_repeats(rows: Sequence[Row]) -> list[Row]:
    """One row per configuration: tokens and seconds summed over the repeats (so tok/s is their
    total rate), the other columns averaged; first-seen order."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault((r.prompt, r.temperature, r.system, r.drafter, r.verifier, r.plan), []).append(r)
    return [Row(*key, sum(r.tokens for r in rs), sum(r.seconds for r in rs),
                _mean([r.block_efficiency for r in rs]), _mean([r.acceptance for r in rs]),
                _mean([r.verifier_share for r in rs])) for key, rs in groups.items()]


# ---------------------------------------------------------------- verifier comparison (T = 1, γ = 8)

RATIO_TARGETS = [  # (numerator, denominator, issue target)
    ("block k8", "token k8", 1.05),
    ("gbv K=3 k8", "block k8", 1.15),
    ("traversal tree 3x2x1x1x1x1x1x1", "rrsw tree 3x2x1x1x1x1x1x1", 1.02),
]


def verifier_efficiency(args, target, draft) -> tuple[dict[str, np.ndarray], int]:
    """Paired block efficiencies at T = 1, γ = 8 (efficiency.py): every verifier on the same
    drafts at the same contexts (prefixes of text the target sampled alone from each prompt)."""
    prompts = [chat_tokens(target, PROMPTS[name]) for name in args.prompts]
    log.info("sampling efficiency contexts")
    contexts = target_contexts(target, prompts, args.efficiency_tokens, range(args.efficiency_seeds),
                               args.efficiency_stride)
    groups = default_groups(gamma=8, paths=3, trees=((3, 2, 1, 1, 1, 1, 1, 1),))
    return paired_scores(target, draft, contexts, groups, draws=args.efficiency_draws, seed=args.seed,
                         progress=True), len(contexts)


def efficiency_report(scores: dict[str, np.ndarray], n_contexts: int, args) -> list[str]:
    lines = ["| verifier | block efficiency (tokens per target pass) |", "| --- | ---: |"]
    lines += [f"| {label} | {v.mean():.3f} |" for label, v in scores.items()]
    lines += ["", "| ratio | measured | 95 % interval | target | status |", "| --- | ---: | ---: | ---: | --- |"]
    for num, den, goal in RATIO_TARGETS:
        r = paired_ratio(scores[num], scores[den], seed=args.seed)
        status = ("met" if r.low >= goal else "met at the estimate (interval reaches below)" if r.value >= goal
                  else "below at the estimate (interval reaches it)" if r.high >= goal else "missed")
        lines.append(f"| {num} / {den} | {r.value:.3f} | {r.low:.3f}–{r.high:.3f} | ≥ {goal} | {status} |")
    lines += ["", f"{n_contexts} contexts ({len(args.prompts)} prompts × {args.efficiency_seeds} target sample(s) × 1 in "
              f"{args.efficiency_stride} of {args.efficiency_tokens} tokens), one draft per context and shape "
              f"(token and block verify path 0 of the 3 i.i.d. paths GBV verifies), {args.efficiency_draws} "
              "verifier draws per draft; T = 1 without truncation, as in the papers."]
    return lines


# ---------------------------------------------------------------- cost curve and n-gram ceiling

CURVE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 32)  # tokens per target decode
NGRAM_HORIZON = 31  # longest n-gram draft the ceiling considers (decodes of up to 32 tokens)


def time_decode(model, n: int, seq: int) -> float:
    """Seconds for one decode of n dummy tokens (all logits) in scratch KV sequence `seq`."""
    tokens = [model.bos if model.bos >= 0 else 0] * n
    t0 = time.perf_counter()
    model.decode(tokens, range(n), [(seq,)] * n, outputs="all")
    secs = time.perf_counter() - t0
    model.seq_rm(seq, -1, -1)
    return secs


def cost_curve(target, sizes: Sequence[int] = CURVE_SIZES, rounds: int = 5) -> dict[int, float]:
    """Seconds per target decode of n tokens with every row's logits (a verification pass): the
    median of `rounds` interleaved rounds in a scratch KV sequence, after one warm-up decode (a
    median, not the best: the runs pay typical costs, and a best-of for the 30 ms single-token decode
    is luckier than for the 300 ms batches)."""
    seq = target.options.n_seq_max - 1
    time_decode(target, 1, seq)
    times: dict[int, list[float]] = {n: [] for n in sizes if n <= target.n_batch}
    for _ in range(rounds):
        for n in times:
            times[n].append(time_decode(target, n, seq))
    return {n: float(np.median(ts)) for n, ts in times.items()}


def first_token_alternatives(lookup: ContextLookup, exclude: int | None, limit: int,
                             horizon: int) -> list[tuple[int, ...]]:
    """Other continuations the context offers (what a tree of candidates would add to the
    lookup's proposal): walking from the longest earlier-occurring suffix to shorter ones (suffix
    links), each token that followed an earlier occurrence and is not `exclude` or found already,
    with what followed its first occurrence; at most `limit`."""
    sam, seen, out = lookup.sam, {exclude}, []
    state = sam.link[sam.last] if sam.last else -1
    while state > 0 and len(out) < limit:
        for token, child in sam.next[state].items():
            if token not in seen and len(out) < limit:
                seen.add(token)
                start = sam.first_end[child]
                out.append(tuple(lookup.tokens[start: start + horizon]))
        state = sam.link[state]
    return out


def _run(proposed: Sequence[int], actual: Sequence[int]) -> int:
    """How many proposed tokens equal the actual ones, in a row from the first."""
    run = 0
    for p, a in zip(proposed, actual):
        if p != a:
            break
        run += 1
    return run


def ngram_runs(prompt: Sequence[int], output: Sequence[int], horizon: int = NGRAM_HORIZON,
               alternatives: int = 0) -> list[int]:
    """For each output position i: how many of output[i], output[i+1], ... localspec's context
    lookup proposes correctly in a row from the context prompt + output[:i]; with `alternatives`
    > 0, the best of its proposal and that many first-token alternatives (a tree of candidates
    whose right branch is known in advance)."""
    lookup = ContextLookup()
    context = list(prompt)
    runs = []
    for i, token in enumerate(output):
        proposal = lookup.propose(context, horizon)
        candidates = [proposal.tokens] if proposal else []
        if alternatives:
            first = proposal.tokens[0] if proposal else None
            candidates += first_token_alternatives(lookup, first, alternatives, horizon)
        runs.append(max((_run(c, output[i:]) for c in candidates), default=0))
        context.append(token)
    return runs


def oracle_seconds(runs: Sequence[int], cost, max_depth: int) -> float:
    """Least target time that produces the output when every step drafts j <= min(run, max_depth)
    tokens the lookup got right and all of them are accepted (j + 1 tokens for c(j + 1); n-gram
    drafts cost nothing): an upper bound on the speed of any planner with this drafter."""
    n = len(runs)
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = min(cost(j + 1) + best[min(n, i + j + 1)] for j in range(min(runs[i], max_depth) + 1))
    return best[0]


def ngram_ceiling(prompt: Sequence[int], output: Sequence[int], cost, alternatives: int = 0) -> float:
    """The n-gram drafter's decode ceiling on `output`: the target alone's time for it over
    oracle_seconds of the lookup's runs (with `alternatives`: of a tree, see ngram_runs)."""
    runs = ngram_runs(prompt, output, alternatives=alternatives)
    return len(output) * cost(1) / oracle_seconds(runs, cost, NGRAM_HORIZON)


def cost_curve_report(curve: dict[int, float]) -> list[str]:
    c1 = curve[1]
    lines = ["## What one target pass costs (the cost model)", "",
             "One decode of n tokens with every row's logits, as a verification pass makes; median of 5, "
             "measured after the runs above. The last column is the speedup of a drafter that is "
             "always right and free: the ceiling of any speculation with n - 1 drafts on this machine.", "",
             "| tokens per target pass n | c(n) | c(n) / c(1) | tok/s if every draft is accepted | vs target alone |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for n in sorted(curve):
        lines.append(f"| {n} | {curve[n] * 1e3:.1f} ms | {curve[n] / c1:.2f} | {n / curve[n]:.1f} | "
                     f"{n * c1 / curve[n]:.2f}× |")
    return lines


def ngram_ceiling_report(outputs: dict[tuple[str, float], tuple[list[int], list[int]]], curve: dict[int, float],
                         rows: Sequence[Row]) -> list[str]:
    """Per input-grounded prompt and temperature: the n-gram drafter's ceiling on the target-only
    run's output with the measured cost curve, beside the best measured n-gram/hybrid speedup."""
    cost = CostTable(dict(curve))  # the planner's interpolation between measured sizes

    def tps(prompt: str, t: float, drafter: str) -> list[float]:
        return [r.tps for r in rows if (r.prompt, r.temperature, r.system, r.drafter) == (prompt, t, "localspec", drafter)]

    lines = ["## N-gram ceiling on the input-grounded prompts", "",
             "On the target-only run's output: the share of positions where prompt lookup's first "
             "proposal is right, and the best speedup any planner could reach with this drafter "
             "(every step drafts only tokens the lookup gets right, all accepted, n-gram drafts free, "
             "costs from the curve above).", "",
             f"| prompt | T | output tokens | lookup's next token right | ceiling, k ≤ {K} | ceiling, k ≤ {NGRAM_HORIZON} | "
             "measured best (n-gram or hybrid) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (prompt, t), (ptoks, output) in sorted(outputs.items()):
        if prompt not in GROUNDED or not output:
            continue
        runs = ngram_runs(ptoks, output)
        plain = len(output) * cost(1)
        base = max(tps(prompt, t, "-"), default=None)
        measured = tps(prompt, t, "ngram") + tps(prompt, t, "hybrid")
        best = f"{max(measured) / base:.2f}×" if base and measured else "—"
        lines.append(f"| {prompt} | {t:g} | {len(output)} | {sum(r > 0 for r in runs) / len(runs):.0%} | "
                     f"{plain / oracle_seconds(runs, cost, K):.2f}× | "
                     f"{plain / oracle_seconds(runs, cost, NGRAM_HORIZON):.2f}× | {best} |")
    return lines


# ---------------------------------------------------------------- memory at 8k context

MEMORY_CONFIGS = [("read", "f16"), ("mmap", "f16"), ("read", "q8_0")]  # (load_mode, cache_type); first = default


def peak_rss_8k(target_path: Path, draft_path: Path, threads: int, load_mode: str, cache_type: str) -> dict:
    """Peak RSS of a fresh process that loads the pair at an 8k context and generates: the kernel's
    high-water mark of the process's own memory (VmHWM), which, unlike ru_maxrss, does not count
    the benchmark's pages the child shared between fork and exec."""
    options = f"ctx_size=8192, threads={threads}, load_mode={load_mode!r}, cache_type={cache_type!r}"
    code = (
        "import re\n"
        "from localspec.api import load_model, generate\n"
        f"t = load_model({str(target_path)!r}, {options})\n"
        f"d = load_model({str(draft_path)!r}, {options})\n"
        "generate(t, d, 'def fib(n):', max_tokens=32, temperature=0.8, seed=0)\n"
        "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL, check=True)
    rss = int(out.stdout.strip().splitlines()[-1]) * 1024
    files = target_path.stat().st_size + draft_path.stat().st_size
    return dict(rss=rss, files=files, overhead=rss - files)


def memory_report(target_path: Path, draft_path: Path, threads: int) -> list[str]:
    lines = ["| load mode | KV cache | peak RSS | model files | overhead (target ≤ 300 MB) |",
             "| --- | --- | ---: | ---: | ---: |"]
    for load_mode, cache_type in MEMORY_CONFIGS:
        print(f"\rmemory at 8k: {load_mode} {cache_type:<10}", end="", file=sys.stderr, flush=True)
        m = peak_rss_8k(target_path, draft_path, threads, load_mode, cache_type)
        default = " (default)" if (load_mode, cache_type) == MEMORY_CONFIGS[0] else ""
        lines.append(f"| {load_mode}{default} | {cache_type} | {m['rss'] / 1e6:,.0f} MB | {m['files'] / 1e6:,.0f} MB | "
                     f"{m['overhead'] / 1e6:,.0f} MB |")
    print("", file=sys.stderr)
    return lines


# ---------------------------------------------------------------- reports


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def main_table(rows: Sequence[Row]) -> str:
    base = {(r.prompt, r.temperature): r.tps for r in rows if r.verifier == "target only"}
    lines = ["| prompt | T | system | drafter | verifier | plan | tok/s | speedup | block eff. | acceptance | verifier % |",
             "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        b = base.get((r.prompt, r.temperature), 0.0)
        lines.append(f"| {r.prompt} | {r.temperature:g} | {r.system} | {r.drafter} | {r.verifier} | {r.plan} | "
                     f"{r.tps:.1f} | {r.tps / b if b else 0:.2f}× | {_f(r.block_efficiency, '.2f')} | "
                     f"{_f(None if r.acceptance is None else 100 * r.acceptance, '.0f')}{'' if r.acceptance is None else ' %'} | "
                     f"{_f(None if r.verifier_share is None else 100 * r.verifier_share, '.2f')} |")
    return "\n".join(lines)


def ratios(rows: Sequence[Row]) -> str:
    """The issue's targets as measured ratios."""
    def tps(prompt: str, t: float, system: str, drafter: str, verifier: str, plan: str) -> float | None:
        for r in rows:
            if (r.prompt, r.temperature, r.system, r.drafter, r.verifier, r.plan) == (prompt, t, system, drafter,
                                                                                      verifier, plan):
                return r.tps
        return None

    lines = ["| check | prompt | T | ratio |", "| --- | --- | --- | ---: |"]
    temps = sorted({r.temperature for r in rows})
    for p in dict.fromkeys(r.prompt for r in rows):
        for t in temps:
            base = tps(p, t, "localspec", "-", "target only", "-")
            auto = tps(p, t, "localspec", "model", "block", "auto")
            if base and auto:
                lines.append(f"| default (auto) / target only (≥ 0.97) | {p} | {t:g} | {auto / base:.2f}× |")
            lc = tps(p, t, "llama.cpp", "model", "match", "fixed")
            for verifier in ("match", "block"):
                ours = tps(p, t, "localspec", "model", verifier, "fixed")
                if lc and ours:
                    goal = "1.1" if t == 0 else "1.3"
                    lines.append(f"| localspec {verifier} k{K} / llama.cpp draft k{K} (≥ {goal}) | {p} | {t:g} | "
                                 f"{ours / lc:.2f}× |")
            if p in GROUNDED and base:
                for drafter in ("ngram", "hybrid"):
                    best = max((r.tps for r in rows if (r.prompt, r.temperature, r.system, r.drafter, r.verifier)
                                == (p, t, "localspec", drafter, "block")), default=None)
                    if best:
                        lines.append(f"| {drafter} / target only (≥ 1.5) | {p} | {t:g} | {best / base:.2f}× |")
                lcn = tps(p, t, "llama.cpp", "ngram", "match", "fixed")
                if lcn:
                    lines.append(f"| llama.cpp ngram-mod / target only | {p} | {t:g} | {lcn / base:.2f}× |")
    return "\n".join(lines)


def what_if(rows: Sequence[Row]) -> str:
    """Predicted speedup for draft/target cost ratios c when verifying γ+1 tokens costs one target
    step (the memory-bound regime of 7B–70B targets on GPUs): max over γ of E[tokens]/(γ·c + 1),
    with α the measured acceptance of the model drafter (block, k=4, plan fixed)."""
    alphas = {}
    for r in rows:
        if (r.system, r.drafter, r.verifier, r.plan) == ("localspec", "model", "block", "fixed") and r.acceptance:
            alphas[(r.prompt, r.temperature)] = r.acceptance
    keys = sorted(alphas)
    head = "| c = draft/target cost | " + " | ".join(f"{p} T={t:g} (α={alphas[(p, t)]:.2f})" for p, t in keys) + " |"
    lines = [head, "| --- |" + " ---: |" * len(keys)]
    for c in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6):
        cells = []
        for key in keys:
            best = max(((expected_tokens(alphas[key], g) / (g * c + 1), g) for g in range(1, 17)))
            cells.append(f"{best[0]:.2f}× (γ={best[1]})")
        lines.append(f"| {c:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}, llama-cpp-python {llama_cpp_version()}")


# ---------------------------------------------------------------- main


def add_prompts_option(p: argparse.ArgumentParser, prompts: dict[str, str]) -> None:
    """--prompts: a comma list of names from `prompts` (default all; check them with check_prompts)."""
    p.add_argument("--prompts", type=lambda s: s.split(","), default=list(prompts),
                   help=f"comma list of the prompts to run (default all: {','.join(prompts)})")


def check_prompts(p: argparse.ArgumentParser, names: Sequence[str], prompts: dict[str, str]) -> None:
    """Exit with a usage error naming any of `names` that is not a prompt."""
    unknown = [name for name in names if name not in prompts]
    if unknown:
        p.error(f"unknown prompt(s) {', '.join(unknown)} in --prompts; choose from {', '.join(prompts)}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per run (default 128)")
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.8],
                   help="comma list (default 0,0.8)")
    p.add_argument("--repeat", type=int, default=1,
                   help="time every run this many times, interleaved, and report the totals (default 1)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both tools")
    p.add_argument("--seed", type=int, default=1)
    add_prompts_option(p, PROMPTS)
    p.add_argument("--ngram-k", type=int, default=0,
                   help="also run n-gram and hybrid drafts planned (auto) up to this many tokens on the "
                        "input-grounded prompts (default 0: only k = 4)")
    p.add_argument("--llama-bin", type=Path, default=None,
                   help="directory with llama-speculative-simple (default: build it from the vendored source)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's runs")
    p.add_argument("--efficiency-tokens", type=int, default=96,
                   help="tokens the target samples per prompt for the T=1, γ=8 comparison's contexts")
    p.add_argument("--efficiency-stride", type=int, default=2, help="every Nth of those tokens is a context")
    p.add_argument("--efficiency-seeds", type=int, default=1, help="target samples per prompt")
    p.add_argument("--efficiency-draws", type=int, default=64, help="verifier draws per draft")
    p.add_argument("--skip-throughput", action="store_true", help="skip the tok/s tables (and llama.cpp)")
    p.add_argument("--skip-efficiency", action="store_true", help="skip the T=1, γ=8 verifier comparison")
    p.add_argument("--skip-memory", action="store_true", help="skip the RSS measurements")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    p.add_argument("--json", type=Path, default=None, help="write the raw rows as JSON here")
    args = p.parse_args(argv)
    check_prompts(p, args.prompts, PROMPTS)
    if args.ngram_k < 0:
        p.error(f"--ngram-k must be 0 (off) or a draft length, got {args.ngram_k}")
    for name in ("tokens", "repeat", "threads", "efficiency_tokens", "efficiency_stride", "efficiency_seeds",
                 "efficiency_draws"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def throughput_report(rows: Sequence[Row]) -> list[str]:
    return ["## Throughput", "", main_table(rows), "", "## Targets as ratios", "", ratios(rows), "",
            "## What if the draft were cheaper", "",
            "Predicted speedup = max over γ of E[tokens per step] / (γ·c + 1): verifying γ+1 tokens costs one "
            "target step (memory-bound GPUs), α = the acceptance measured above (model drafter, block, k=4).",
            "", what_if(rows)]


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    reg = registry.load_registry()
    pair = reg.pairs[reg.default_pair]
    target_path, draft_path = registry.resolve(pair.target), registry.resolve(pair.draft)
    bindir = None
    if not (args.no_llama_cpp or args.skip_throughput):
        bindir = args.llama_bin or build_llama_tools(registry.cache_dir().parent, llama_cpp_version(),
                                                     args.threads)
    started = time.time()
    report = [f"Machine: {machine()}.",
              f"Pair: {pair.target} (target) + {pair.draft} (draft); {args.tokens} tokens per run, "
              f"seed {args.seed}, threads {args.threads}, top-k {SAMPLING['top_k']}, top-p {SAMPLING['top_p']}, "
              f"min-p {SAMPLING['min_p']}, draft length {K}.", ""]
    rows: list[Row] = []
    if not (args.skip_throughput and args.skip_efficiency):
        target = load_model(target_path, threads=args.threads)
        draft = load_model(draft_path, threads=args.threads)
        try:
            if not args.skip_throughput:
                rows, outputs = measure_all(args, target, draft, target_path, draft_path, bindir)
                print("target cost curve ...", file=sys.stderr, flush=True)
                curve = cost_curve(target)
                report += throughput_report(rows)
                report += [""] + cost_curve_report(curve) + [""] + ngram_ceiling_report(outputs, curve, rows)
            if not args.skip_efficiency:
                scores, n_contexts = verifier_efficiency(args, target, draft)
                report += ["", "## Block efficiency at T = 1, γ = 8 (paired: same contexts, same drafts)", ""]
                report += efficiency_report(scores, n_contexts, args)
        finally:
            target.close()
            draft.close()
    if not args.skip_memory:
        report += ["", "## Memory at an 8k context", ""] + memory_report(target_path, draft_path, args.threads)
    report += ["", f"_Measured in {time.time() - started:.0f} s with `python benchmarks/head_to_head.py"
               f"{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`._"]
    text = "\n".join(report)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
