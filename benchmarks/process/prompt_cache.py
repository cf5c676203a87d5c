"""Prompt-cache benchmark: questions about one document, each a fresh process, as scripts run them.

A ~2,000-token document (the start of localspec's engine source) and three different questions
about it, asked in turn, each a fresh ``localspec --context DOC "question"`` process at T = 0:
with the prompt cache (the first question fills it, the later ones restore the document), the
same with ``--prompt-cache off``, the target alone (``-d none -k 0``) both ways, and llama.cpp's
``llama-completion --prompt-cache FILE`` on the same rendered prompts in the same order. A second
table: a 5-turn chat saved with /save, then one more question in a new process with --resume,
with and without the cache. Medians over --repeat rounds (each round starts from an empty cache).

    python benchmarks/prompt_cache.py
    python benchmarks/prompt_cache.py --repeat 1 --no-llama-completion

Progress goes to stderr, the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.host import host_header
from benchmarks.common.llama_tools import llama_completion, native_llama_tools
from benchmarks.common.options import checked_args, progress
from benchmarks.common.prompts import QUESTIONS, RESUMED, SAVED_CHAT_TURNS as CHAT_TURNS, document
from benchmarks.common.runs import TARGET_ALONE, Run, chat as chat_run, localspec, profile_env
from benchmarks.common.target import chat_text


def ask(args: argparse.Namespace, doc: Path, question: str, root: Path, cache: str, extra: Sequence[str] = ()) -> Run:
    return localspec(["-n", str(args.tokens), "-t", "0", "--seed", "1", "--context", str(doc),
                      "--prompt-cache", cache, *extra], question, root / "profiles", args.threads)


def questions_table(args: argparse.Namespace, root: Path, doc: Path, bindir: Path | None) -> list[str]:
    configs = {"default, prompt cache": ([], True), "default, --prompt-cache off": ([], False),
               "target alone, prompt cache": (list(TARGET_ALONE), True),
               "target alone, --prompt-cache off": (list(TARGET_ALONE), False)}
    runs: dict[str, list[list[Run]]] = {name: [[] for _ in QUESTIONS] for name in configs}
    llama: list[list[float]] = [[] for _ in QUESTIONS]
    text = doc.read_text(encoding="utf-8")
    for r in range(args.repeat):
        for name, (extra, cached) in configs.items():
            cache_dir = root / "cache"
            shutil.rmtree(cache_dir, ignore_errors=True)
            for i, q in enumerate(QUESTIONS):
                progress(f"round {r + 1}/{args.repeat}: {name}, question {i + 1}")
                runs[name][i].append(ask(args, doc, q, root, str(cache_dir) if cached else "off", extra))
        if bindir is not None:
            session = root / "llama.session"
            session.unlink(missing_ok=True)
            for i, q in enumerate(QUESTIONS):
                progress(f"round {r + 1}/{args.repeat}: llama-completion --prompt-cache, question {i + 1}")
                prompt = chat_text(text.rstrip() + "\n\n" + q)
                llama[i].append(llama_completion(bindir, prompt, args.tokens, args.threads,
                                                 ["--prompt-cache", str(session)]).wall)
    med = statistics.median
    lines = ["| run | question 1 s | question 2 s | question 3 s | later / first | cached tokens (q2) | "
             "restore ms per 1,000 tokens | save ms (q1) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, per_q in runs.items():
        walls = [med(x.wall for x in q) for q in per_q]
        cached = med(x.data["usage"]["prompt_tokens_details"]["cached_tokens"] for x in per_q[1])
        restore = med(x.timings.get("prompt_cache_restore", 0.0) for x in per_q[1])
        save = med(x.timings.get("prompt_cache_save", 0.0) for x in per_q[0])
        per_1000 = f"{1e3 * restore / cached * 1000:.0f}" if cached else "—"
        lines.append(f"| {name} | {walls[0]:.2f} | {walls[1]:.2f} | {walls[2]:.2f} | "
                     f"**{(walls[1] + walls[2]) / 2 / walls[0]:.2f}×** | {cached:.0f} | {per_1000} | {save * 1e3:.0f} |")
    if bindir is not None:
        walls = [med(q) for q in llama]
        lines.append(f"| llama-completion --prompt-cache | {walls[0]:.2f} | {walls[1]:.2f} | {walls[2]:.2f} | "
                     f"**{(walls[1] + walls[2]) / 2 / walls[0]:.2f}×** | | | |")
    first = {name: med(x.wall for x in per_q[0]) for name, per_q in runs.items()}
    lines += ["", f"A first question with an empty cache against --prompt-cache off (the save's cost): "
              f"default {first['default, --prompt-cache off'] / first['default, prompt cache']:.2f}×, "
              f"target alone {first['target alone, --prompt-cache off'] / first['target alone, prompt cache']:.2f}×."]
    if bindir is not None:
        later = [med(x.wall for x in runs["default, prompt cache"][i]) for i in (1, 2)]
        lines.append(f"Later questions, default with the prompt cache against llama-completion --prompt-cache: "
                     f"{statistics.mean(med(q) for q in llama[1:]) / statistics.mean(later):.2f}×.")
    return lines


def chat(args: argparse.Namespace, root: Path, cache: str, turns: Sequence[str], resume: str | None) -> float:
    """Wall seconds of a fresh `localspec chat` answering `turns` (saved chats in the benchmark's own home)."""
    chat_args = ["--keep-alive", "0", "-t", "0", "-n", str(args.tokens), "--prompt-cache", cache,
                 *(["--threads", str(args.threads)] if args.threads else []), *(["--resume", resume] if resume else [])]
    return chat_run(chat_args, turns, profile_env(root / "profiles", LOCALSPEC_CACHE_DIR=str(root / "home")))


def chat_table(args: argparse.Namespace, root: Path) -> list[str]:
    """A 5-turn chat saved with /save, then one more question in a new process with --resume."""
    from localspec.llama import registry

    home = root / "home"  # the saved chat goes here, not into the user's cache; the models stay where they are
    home.mkdir(exist_ok=True)
    if not (home / "models").exists():
        (home / "models").symlink_to(registry.cache_dir(), target_is_directory=True)
    resumed: dict[str, list[float]] = {"prompt cache": [], "--prompt-cache off": []}
    for r in range(args.repeat):
        for name in resumed:
            cache = str(root / "chat-cache") if name == "prompt cache" else "off"
            shutil.rmtree(root / "chat-cache", ignore_errors=True)
            progress(f"round {r + 1}/{args.repeat}: 5-turn chat, {name}")
            chat(args, root, cache, [*CHAT_TURNS, "/save bench"], None)
            progress(f"round {r + 1}/{args.repeat}: resumed chat, {name}")
            resumed[name].append(chat(args, root, cache, [RESUMED], "bench"))
    med = statistics.median
    on, off = med(resumed["prompt cache"]), med(resumed["--prompt-cache off"])
    return ["| resumed chat (5 turns, then 1 question in a new process) | prompt cache s | --prompt-cache off s | "
            "off / cache |", "| --- | ---: | ---: | ---: |",
            f"| {RESUMED} | {on:.2f} | {off:.2f} | **{off / on:.2f}×** |"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--tokens", type=int, default=32, help="max tokens per answer (default 32)")
    p.add_argument("--chars", type=int, default=8600, help="document characters (default 8600: ~2,000 tokens)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--no-llama-completion", action="store_true", help="skip llama.cpp's llama-completion")
    p.add_argument("--skip-chat", action="store_true", help="no resumed-chat table")
    return checked_args(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    bindir = None if args.no_llama_completion else native_llama_tools()
    with tempfile.TemporaryDirectory(prefix="localspec-prompt-cache-") as tmp:
        root = Path(tmp)
        doc = root / "document.py"
        doc.write_text(document(args.chars), encoding="utf-8")
        print("\n".join(host_header()))
        print("\n".join(questions_table(args, root, doc, bindir)))
        if not args.skip_chat:
            print()
            print("\n".join(chat_table(args, root)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
