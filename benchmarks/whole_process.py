"""Whole-process benchmark: localspec as users run it, against the target alone run the same way.

Every run is a fresh ``localspec`` process (start-up, model loads, profile, prefill and decode
included), alternated with the target alone (``-d none -k 0``); the table gives medians over
`--repeat` pairs. Default settings run cold (an empty cost profile: the first run on a machine)
and warm (the profile earlier runs left). At T = 0 both sides produce the same text, so the ratio
is of wall times; at T > 0 texts differ in length, so the ratio is of wall time per generated
token (and the decode's tokens per second is shown beside it). A second table splits a warm
default run's time into its components, a third gives the n-gram drafter's ceiling per prompt
(what perfect planning with the context lookup could reach), a fourth times a 5-turn chat.

    python benchmarks/whole_process.py                          # every prompt, T = 0 and 0.8
    python benchmarks/whole_process.py --prompts code-edit --repeat 5 --temperatures 0
    python benchmarks/whole_process.py --skip-chat --tokens 64
    python benchmarks/whole_process.py --temperatures 0 --llama-completion   # and llama.cpp's own tool

Progress goes to stderr, the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_to_head import (GROUNDED, PROMPTS as H2H_PROMPTS, add_prompts_option, build_llama_tools,  # noqa: E402
                          check_prompts, host_header, llama_cpp_version, native_llama_tools)

PROMPTS = dict(H2H_PROMPTS)
PROMPTS["rename"] = ("Rename the variable `tmp` to `total` in this code and show the whole code:\n\n"
                     "def mean(numbers):\n    tmp = 0\n    for n in numbers:\n        tmp += n\n"
                     "    return tmp / len(numbers) if numbers else 0.0\n")
GROUNDED_PROMPTS = (*GROUNDED, "rename")
TREE_ALTERNATIVES = 3  # first-token alternatives of the ceiling's tree of candidates
TARGET_ALONE = ("-d", "none", "-k", "0")
CHAT_TURNS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Add type hints to it and show the whole function.",
    "Rename the loop variable to `step` and show the whole function again.",
    "Add a docstring and show the whole function.",
    "Write a pytest test for it.",
)


@dataclass
class Run:
    wall: float  # seconds, spawn to exit
    tokens: int
    decode_tps: float
    timings: dict
    data: dict  # the whole --json result


IN_PROCESS = ("--keep-alive", "0")  # each call loads its models itself (resident models: the section below)


def localspec(args: Sequence[str], prompt: str, profile_dir: Path, threads: int | None) -> Run:
    """One fresh `localspec --json` process, its models loaded by itself (--keep-alive 0)."""
    cmd = [sys.executable, "-m", "localspec", "--json", *IN_PROCESS, *(["--threads", str(threads)] if threads else []),
           *args, prompt]
    env = dict(os.environ, LOCALSPEC_PROFILE_DIR=str(profile_dir))
    spawned = time.time()
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=900)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:8])} ... failed:\n{out.stderr[-2000:]}")
    data = json.loads(out.stdout)
    timings = dict(data["timings"], import_=data["timings"]["command_started"] - spawned)
    return Run(wall, data["usage"]["completion_tokens"], data["stats"]["tokens_per_second"], timings, data)


def chat(args: Sequence[str], profile_dir: Path, threads: int | None, tokens: int) -> float:
    """Wall seconds of a fresh `localspec chat` answering CHAT_TURNS, piped."""
    cmd = [sys.executable, "-m", "localspec", "chat", *IN_PROCESS, "-t", "0", "-n", str(tokens),
           *(["--threads", str(threads)] if threads else []), *args]
    env = dict(os.environ, LOCALSPEC_PROFILE_DIR=str(profile_dir))
    t0 = time.perf_counter()
    out = subprocess.run(cmd, input="\n".join(CHAT_TURNS) + "\n", capture_output=True, text=True, env=env,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"chat failed:\n{out.stderr[-2000:]}")
    return time.perf_counter() - t0


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ratio(default: Sequence[Run], alone: Sequence[Run], temperature: float) -> float:
    """Speed of the default against the target alone: wall time (T = 0), or wall time per
    generated token (T > 0), medians."""
    if temperature == 0:
        return statistics.median(r.wall for r in alone) / statistics.median(r.wall for r in default)
    return (statistics.median(r.wall / max(r.tokens, 1) for r in alone)
            / statistics.median(r.wall / max(r.tokens, 1) for r in default))


def measure(args: argparse.Namespace, root: Path) -> tuple[list[str], dict[str, list[Run]], dict[str, list[Run]]]:
    """The main table, and the warm default's and the target alone's runs per prompt at the first
    temperature."""
    rows: list[str] = []
    warm_runs: dict[str, list[Run]] = {}
    alone_runs: dict[str, list[Run]] = {}
    alone_dir = root / "alone"
    for temperature in args.temperatures:
        warm_dir = root / f"warm-{temperature:g}"
        common = ["-n", str(args.tokens), "-t", f"{temperature:g}", "--seed", "1"]
        for name in args.prompts:  # the warm profile: what earlier runs of these prompts left
            progress(f"warm-up T={temperature:g} {name}")
            localspec(common, PROMPTS[name], warm_dir, args.threads)
        for name in args.prompts:
            cold, warm, alone = [], [], []
            for r in range(args.repeat):
                progress(f"T={temperature:g} {name} pair {r + 1}/{args.repeat}")
                cold.append(localspec(common, PROMPTS[name], root / f"cold-{temperature:g}-{name}-{r}", args.threads))
                alone.append(localspec([*common, *TARGET_ALONE], PROMPTS[name], alone_dir, args.threads))
                warm.append(localspec(common, PROMPTS[name], warm_dir, args.threads))
                alone.append(localspec([*common, *TARGET_ALONE], PROMPTS[name], alone_dir, args.threads))
            if temperature == args.temperatures[0]:  # the components table: the first temperature's runs
                warm_runs[name], alone_runs[name] = warm, alone
            med = statistics.median
            rows.append(
                f"| {name}{' (grounded)' if name in GROUNDED_PROMPTS else ''} | {temperature:g} | "
                f"{med(r.wall for r in alone):.2f} | {med(r.wall for r in cold):.2f} | {med(r.wall for r in warm):.2f} | "
                f"**{ratio(cold, alone, temperature):.2f}×** | **{ratio(warm, alone, temperature):.2f}×** | "
                f"{med(r.tokens for r in warm):.0f} | {med(r.decode_tps for r in alone):.1f} / "
                f"{med(r.decode_tps for r in warm):.1f} |")
    header = ["| prompt | T | target alone s | default cold s | default warm s | cold vs alone | warm vs alone | "
              "tokens | decode tok/s alone / warm |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    return header + rows, warm_runs, alone_runs


def components(runs: Sequence[Run]) -> list[str]:
    keys = [("import", "import_"), ("target load", "target_load"), ("draft load", "draft_load"),
            ("profile read/write", "profile_io"), ("prefill", "prefill"), ("decode", "decode")]
    lines = ["| component (warm default runs, median) | ms |", "| --- | ---: |"]
    for label, key in keys:
        values = [r.timings.get(key) or 0.0 for r in runs]
        lines.append(f"| {label} | {statistics.median(values) * 1e3:.0f} |")
    rest = [r.wall - sum((r.timings.get(k) or 0.0) for _, k in keys) for r in runs]
    lines.append(f"| everything else (exit, detokenizing, output) | {statistics.median(rest) * 1e3:.0f} |")
    lines.append(f"| whole process | {statistics.median(r.wall for r in runs) * 1e3:.0f} |")
    return lines


def ceiling_table(args: argparse.Namespace, alone_runs: dict[str, list[Run]]) -> list[str]:
    """Per prompt at T = 0: the n-gram drafter's ceiling on the target alone's output (head_to_head's
    oracle: every step drafts exactly the tokens the context lookup gets right, all accepted, costs
    from a cost curve measured now), and the whole-process ratio that decode ceiling would give
    (the target alone's other components unchanged); beside it, the same oracle for a tree of the
    proposal and first-token alternatives (an upper bound: it drafts only the branch that is right)."""
    from head_to_head import cost_curve, greedy_answer, ngram_ceiling

    from localspec.llama import registry
    from localspec.api import load_model
    from localspec.decoding.costs import CostTable

    progress("n-gram ceiling: cost curve and target-alone outputs")
    reg = registry.load_registry()
    lines = ["| prompt | output tokens | decode ceiling, n-gram lookup (k ≤ 31) | whole process at that ceiling "
             f"| decode ceiling, a tree of the proposal + {TREE_ALTERNATIVES} alternatives |",
             "| --- | ---: | ---: | ---: | ---: |"]
    options = {"threads": args.threads} if args.threads else {}
    with load_model(reg.pairs[reg.default_pair].target, **options) as target:
        cost = CostTable(cost_curve(target))
        for name in args.prompts:
            prompt, output = greedy_answer(target, PROMPTS[name], args.tokens)
            chain = ngram_ceiling(prompt, output, cost)
            tree = ngram_ceiling(prompt, output, cost, alternatives=TREE_ALTERNATIVES)
            wall = statistics.median(r.wall for r in alone_runs[name])
            decode = statistics.median(r.timings["decode"] for r in alone_runs[name])
            lines.append(f"| {name} | {len(output)} | {chain:.2f}× | {wall / (wall - decode + decode / chain):.2f}× "
                         f"| {tree:.2f}× |")
    return lines


def chat_table(args: argparse.Namespace, root: Path) -> list[str]:
    default, alone = [], []
    for r in range(args.repeat):
        progress(f"5-turn chat, pair {r + 1}/{args.repeat}")
        default.append(chat([], root / "warm-0", args.threads, args.tokens))
        alone.append(chat(list(TARGET_ALONE), root / "alone", args.threads, args.tokens))
    d, a = statistics.median(default), statistics.median(alone)
    return ["| 5-turn chat, T = 0 | target alone s | default s | default vs alone |", "| --- | ---: | ---: | ---: |",
            f"| {len(CHAT_TURNS)} turns, up to {args.tokens} tokens each | {a:.2f} | {d:.2f} | **{a / d:.2f}×** |"]


LLAMA_NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")  # llama.cpp's draft-free speculative modes


def llama_ngram(bindir: Path, prompt: str, spec_type: str, tokens: int, threads: int | None) -> tuple[float, float]:
    """(whole-process seconds, decode tokens/s) of one llama-speculative-simple run at T = 0 with
    one of llama.cpp's n-gram modes (up to 32 drafts; no draft model is loaded)."""
    from localspec.llama import registry

    target = registry.resolve(registry.load_registry().pairs[registry.load_registry().default_pair].target)
    cmd = [str(bindir / "llama-speculative-simple"), "-m", str(target), "-p", prompt, "-n", str(tokens), "-c", "4096",
           "--temp", "0", "--seed", "1", "--spec-type", spec_type, "--spec-draft-n-max", "32",
           *(["-t", str(threads)] if threads else [])]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    found = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out.stdout + out.stderr)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"llama-speculative-simple --spec-type {spec_type} failed:\n{(out.stdout + out.stderr)[-1500:]}")
    return wall, int(found.group(1)) / float(found.group(2))


def llama_table(args: argparse.Namespace, root: Path, warm: dict[str, list[Run]]) -> list[str]:
    """localspec's default against llama.cpp's n-gram modes on the grounded prompts (T = 0).
    llama.cpp's tools take the prompt as plain text (no chat template), localspec its chat
    template: the decode rates compare the drafters, the wall times what each tool costs."""
    bindir = build_llama_tools(Path.home() / ".cache" / "localspec-bench", llama_cpp_version(), os.cpu_count() or 1)
    lines = ["| prompt | system | decode tok/s | whole process s |", "| --- | --- | ---: | ---: |"]
    for name in [n for n in args.prompts if n in GROUNDED_PROMPTS and n in warm]:
        runs = warm[name]
        lines.append(f"| {name} | localspec default (warm) | {statistics.median(r.decode_tps for r in runs):.1f} | "
                     f"{statistics.median(r.wall for r in runs):.2f} |")
        for spec_type in LLAMA_NGRAM_TYPES:
            progress(f"llama.cpp {spec_type} on {name}")
            try:
                got = [llama_ngram(bindir, PROMPTS[name], spec_type, args.tokens, args.threads)
                       for _ in range(args.repeat)]
            except RuntimeError as exc:
                lines.append(f"| {name} | llama.cpp {spec_type} | failed: {str(exc).splitlines()[0]} | |")
                continue
            lines.append(f"| {name} | llama.cpp {spec_type} | {statistics.median(g[1] for g in got):.1f} | "
                         f"{statistics.median(g[0] for g in got):.2f} |")
    return lines


def default_target() -> Path:
    from localspec.llama import registry

    reg = registry.load_registry()
    return Path(registry.resolve(reg.pairs[reg.default_pair].target))


def chat_text(prompt: str) -> str:
    """The text localspec decodes from for a prompt: the target's chat template, rendered."""
    from localspec.llama.model import Model
    from localspec.prompt import check_messages, render_messages, template_of

    vocab = Model.vocabulary(default_target())
    try:
        return render_messages(vocab, template_of(vocab), check_messages([{"role": "user", "content": prompt}]),
                               True, None)
    finally:
        vocab.close()


def completion_flags() -> list[str]:
    """The llama-completion flags of this comparison: plain text in (the rendered chat prompt, no
    escapes, no conversation mode), greedy, and --no-repack where llama.cpp's own choice of CPU
    buffer types includes AMX (which crashes on some Xeons: the flag that makes it run there)."""
    from localspec.llama import buffer_types

    crashing = buffer_types.crashing_buffer_types()
    return ["-no-cnv", "--no-escape", "--temp", "0", "--seed", "1", "-c", "4096", *(["-nr"] if crashing else [])]


def llama_completion(bindir: Path, text: str, tokens: int, threads: int | None,
                     extra: Sequence[str] = ()) -> tuple[float, int]:
    """(whole-process seconds, generated tokens) of one llama-completion run (`extra`: more flags)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        cmd = [str(bindir / "llama-completion"), "-m", str(default_target()), "-f", f.name, "-n", str(tokens),
               *completion_flags(), *extra, *(["-t", str(threads)] if threads else [])]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
    found = re.search(r"eval time =\s+[\d.]+ ms /\s+(\d+) runs", out.stderr)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"llama-completion failed (exit {out.returncode}):\n{out.stderr[-1500:]}")
    return wall, int(found.group(1)) + 1  # the eval runs follow the first token, sampled from the prefill


def completion_table(args: argparse.Namespace, root: Path) -> list[str]:
    """Whole process against llama.cpp's own llama-completion (native build, the same vendored
    commit), alternated with localspec's default (warm profile) and the target alone, T = 0."""
    bindir = native_llama_tools()
    common = ["-n", str(args.tokens), "-t", "0", "--seed", "1"]
    lines = [f"llama-completion flags: `{' '.join(completion_flags())}`, on the rendered chat prompt; "
             "the ratio is of wall time per generated token.", "",
             "| prompt | llama-completion s | tokens | target alone s | default warm s | tokens | "
             "alone vs llama-completion | default vs llama-completion |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    med = statistics.median
    warm_up = not (root / "warm-0").exists()  # --only-extra: no main table left a warm profile
    for name in args.prompts:
        text = chat_text(PROMPTS[name])
        if warm_up:  # the profile one earlier run of the prompt leaves
            localspec(common, PROMPTS[name], root / "warm-0", args.threads)
        llama, default, alone = [], [], []
        for r in range(args.repeat):
            progress(f"llama-completion vs localspec: {name} {r + 1}/{args.repeat}")
            llama.append(llama_completion(bindir, text, args.tokens, args.threads))
            default.append(localspec(common, PROMPTS[name], root / "warm-0", args.threads))
            alone.append(localspec([*common, *TARGET_ALONE], PROMPTS[name], root / "alone", args.threads))
        per_llama = med(w / n for w, n in llama)
        lines.append(f"| {name} | {med(w for w, _ in llama):.2f} | {med(n for _, n in llama):.0f} | "
                     f"{med(r.wall for r in alone):.2f} | {med(r.wall for r in default):.2f} | "
                     f"{med(r.tokens for r in default):.0f} | "
                     f"{per_llama / med(r.wall / max(r.tokens, 1) for r in alone):.2f}× | "
                     f"**{per_llama / med(r.wall / max(r.tokens, 1) for r in default):.2f}×** |")
    return lines


def resident_table(args: argparse.Namespace, root: Path) -> list[str]:
    """Calls served by a resident service (the default: `--keep-alive 5m`, later calls) against
    calls in their own process (`--keep-alive 0`), the default settings and the target alone,
    T = 0, alternated: what keeping the models loaded is worth to a script making many calls
    (benchmarks/resident.py compares with llama.cpp's tools)."""
    from resident import Localspec, Prompt

    (root / "resident").mkdir()
    ls = Localspec(root / "resident", args.tokens, args.threads)
    med = statistics.median
    lines = ["| prompt | default, own process s | target alone, own process s | default, resident s | "
             "target alone, resident s | resident default vs own-process target alone |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    try:
        for name in args.prompts:
            prompt = Prompt(PROMPTS[name])
            own, own_alone, res, res_alone = [], [], [], []
            ls.call(prompt)  # the services (the pair's, the target's alone), and the profile an earlier run leaves
            ls.call(prompt, extra=TARGET_ALONE)
            for r in range(args.repeat):
                progress(f"resident: {name} {r + 1}/{args.repeat}")
                own.append(ls.call(prompt, keep_alive="0"))
                own_alone.append(ls.call(prompt, keep_alive="0", extra=TARGET_ALONE))
                res.append(ls.call(prompt))
                res_alone.append(ls.call(prompt, extra=TARGET_ALONE))
            walls = [med(s.wall for s in x) for x in (own, own_alone, res, res_alone)]
            lines.append(f"| {name} | {walls[0]:.2f} | {walls[1]:.2f} | {walls[2]:.2f} | {walls[3]:.2f} | "
                         f"**{med(s.per_token for s in own_alone) / med(s.per_token for s in res):.2f}×** |")
    finally:
        ls.close()
    return lines


def kernels_table(args: argparse.Namespace, root: Path) -> list[str]:
    """The target alone, whole process, under each CPU kernel configuration this build can load
    (alternated, T = 0): what the configuration auto picks is worth to a user, start-up included."""
    from localspec.llama import buffer_types

    configs = [c for c in ("llama", "repack", "plain")
               if c != "repack" or buffer_types.REPACK_BUFFER in buffer_types.extra_buffer_types()]
    if buffer_types.crashing_buffer_types():
        configs.remove("llama")  # it would crash the run
    common = ["-n", str(args.tokens), "-t", "0", "--seed", "1", *TARGET_ALONE]
    lines = ["| prompt | " + " | ".join(f"--cpu-kernels {c} s (decode tok/s)" for c in configs)
             + " | " + " | ".join(f"{c} vs plain" for c in configs if c != "plain") + " |",
             "| --- | " + " | ".join("---:" for _ in configs) + " | "
             + " | ".join("---:" for c in configs if c != "plain") + " |"]
    med = statistics.median
    for name in args.prompts:
        runs: dict[str, list[Run]] = {c: [] for c in configs}
        for r in range(args.repeat):
            for c in configs:
                progress(f"--cpu-kernels {c}: {name} {r + 1}/{args.repeat}")
                runs[c].append(localspec([*common, "--cpu-kernels", c], PROMPTS[name], root / "alone", args.threads))
        walls = {c: med(x.wall for x in runs[c]) for c in configs}
        lines.append(f"| {name} | " + " | ".join(f"{walls[c]:.2f} ({med(x.decode_tps for x in runs[c]):.1f})"
                                                  for c in configs)
                     + " | " + " | ".join(f"{walls['plain'] / walls[c]:.2f}×" for c in configs if c != "plain") + " |")
    return lines


def task_options(p: argparse.ArgumentParser, tasks: Sequence[str], tokens: int, per: str = "run") -> None:
    """--tasks (a comma list of `tasks`), --repeat, --tokens and --threads: the options of the
    benchmarks that alternate fresh processes over named tasks (see checked_args)."""
    p.add_argument("--tasks", type=lambda s: s.split(","), default=list(tasks),
                   help=f"comma list of tasks (default all: {','.join(tasks)})")
    p.add_argument("--repeat", type=int, default=3, help="alternated runs per cell (default 3)")
    p.add_argument("--tokens", type=int, default=tokens, help=f"max tokens per {per} (default {tokens})")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")


def checked_args(p: argparse.ArgumentParser, argv: Sequence[str] | None,
                 tasks: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed arguments; a usage error for an unknown task (with `tasks`) or a --repeat or
    --tokens below 1."""
    args = p.parse_args(argv)
    unknown = [t for t in args.tasks if t not in tasks] if tasks is not None else []
    if unknown:
        p.error(f"unknown task(s) {', '.join(unknown)} in --tasks; choose from {', '.join(tasks or ())}")
    if args.repeat < 1 or args.tokens < 1:
        p.error("--repeat and --tokens must be >= 1")
    return args


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_prompts_option(p, PROMPTS)
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.8])
    p.add_argument("--repeat", type=int, default=3, help="alternated pairs per cell (default 3)")
    p.add_argument("--tokens", type=int, default=128, help="max tokens per run (default 128)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--skip-chat", action="store_true", help="no 5-turn chat table")
    p.add_argument("--skip-ceiling", action="store_true",
                   help="no n-gram ceiling table (computed when the first temperature is 0)")
    p.add_argument("--cpu-kernels-table", action="store_true",
                   help="also time the target alone under each --cpu-kernels configuration")
    p.add_argument("--only-extra", action="store_true",
                   help="skip the main tables: only the --cpu-kernels / --llama-completion / --resident ones")
    p.add_argument("--resident", action="store_true",
                   help="also: calls served by a resident service against calls in their own process")
    p.add_argument("--llama-completion", action="store_true",
                   help="also time llama.cpp's own llama-completion on the same prompts, whole process "
                        "(builds it natively once, a few minutes)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also run llama.cpp's n-gram modes (builds llama-speculative-simple once, a few minutes)")
    args = p.parse_args(argv)
    check_prompts(p, args.prompts, PROMPTS)
    if args.repeat < 1 or args.tokens < 1:
        p.error("--repeat and --tokens must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="localspec-whole-") as tmp:
        root = Path(tmp)
        print("\n".join(host_header()))
        if args.cpu_kernels_table:
            print("\n".join(kernels_table(args, root)))
            print()
        if args.only_extra:
            if args.llama_completion and 0.0 in args.temperatures:
                print("\n".join(completion_table(args, root)))
            if args.resident:
                print("\n".join(resident_table(args, root)))
            return 0
        table, warm_runs, alone_runs = measure(args, root)
        print("\n".join(table))
        print()
        print("\n".join(components([r for runs in warm_runs.values() for r in runs])))
        if not args.skip_ceiling and args.temperatures[0] == 0:
            print()
            print("\n".join(ceiling_table(args, alone_runs)))
        if not args.skip_chat:
            print()
            print("\n".join(chat_table(args, root)))
        if args.llama_cpp:
            print()
            print("\n".join(llama_table(args, root, warm_runs)))
        if args.llama_completion and 0.0 in args.temperatures:
            print()
            print("\n".join(completion_table(args, root)))
        if args.resident:
            print()
            print("\n".join(resident_table(args, root)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
