"""Per-token and prefill parity with ``llama-server``: the target alone, T = 0, the same rendered
prompt on both sides, at about 100, 500 and 2,000 prompt tokens.

* llama-server (built natively from the llama.cpp that llama-cpp-python vendors, started once,
  the target alone), a fresh ``curl`` per request, ``cache_prompt`` off: its own ``timings``
  (``prompt_ms / prompt_n``, ``predicted_ms / predicted_n``);
* localspec, a later call (``-d none -k 0``) served by the resident service from a fresh client
  process, the prompt cache off: its ``--json`` stats (the prefill over the prompt tokens it
  decoded, the decode over the tokens it generated: the first comes from the prefill on both
  sides) and where a step's time goes (the target's pass, the verifier, the drafters and the
  planner, the rest of the step loop), the service's own time for the call and the client's.

Every request has a system message of its own (``Session N``), so nothing an earlier request
decoded serves it (llama-server: ``cache_prompt`` off; localspec: no prefix in common but the
template's first tokens, which its prefill count leaves out). The order alternates by round;
medians.

    python benchmarks/parity.py
    python benchmarks/parity.py --lengths 100,500 --repeat 5 --tokens 64

Progress goes to stderr, the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common.host import host_header
from benchmarks.common.llama_tools import Server, native_llama_tools
from benchmarks.common.options import checked_args, progress
from benchmarks.common.prompts import document
from benchmarks.common.runs import TARGET_ALONE, Run, localspec_json, run_localspec
from benchmarks.common.target import chat_text, default_target

LENGTHS = (100, 500, 2000)  # prompt tokens, about (the document is cut to reach them)
QUESTION = "Summarise what this code does in three sentences."


@dataclass
class Side:
    """One system's samples at one prompt length (milliseconds per token; texts)."""

    prefill: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    steps: list[dict[str, float]] = field(default_factory=list)  # localspec: ms per generated token, by part


def system_of(tag: str) -> str:
    return f"Session {tag}. You are a helpful assistant."


def user_text(chars: int) -> str:
    return f"{document(chars).rstrip()}\n\n{QUESTION}" if chars else QUESTION


def rendered(chars: int, tag: str) -> str:
    """The prompt as both sides decode it: the target's chat template over a system message and
    the user's (a part of the benchmarks' document, then the question)."""
    return chat_text(user_text(chars), system=system_of(tag))


def chars_for(tokens: int) -> int:
    """The document's characters that make the rendered prompt about `tokens` tokens long."""
    from localspec.llama.model import Model

    vocab = Model.vocabulary(default_target())
    try:
        def count(chars: int) -> int:
            return len(vocab.tokenize(rendered(chars, "0"), add_special=False, parse_special=True))

        low, high = 0, 40 * tokens
        if count(0) >= tokens:
            return 0
        while high - low > 8:
            mid = (low + high) // 2
            low, high = (mid, high) if count(mid) < tokens else (low, mid)
        return high
    finally:
        vocab.close()


class Localspec:
    """Later calls of the target alone through a service of the benchmark's own."""

    def __init__(self, root: Path, tokens: int, threads: int | None) -> None:
        self.runtime = Path(tempfile.mkdtemp(prefix="lsp-", dir="/tmp"))
        self.env = dict(os.environ, LOCALSPEC_PROFILE_DIR=str(root / "profiles"), LOCALSPEC_KEEP_ALIVE="10m",
                        XDG_RUNTIME_DIR=str(self.runtime))
        self.tokens = tokens
        self.threads = threads

    def call(self, chars: int, tag: str) -> Run:
        """One later call from a fresh client process, its --json answer read."""
        args = ["--json", *TARGET_ALONE, "-n", str(self.tokens), "-t", "0", "--seed", "1", "--prompt-cache", "off",
                *(["--threads", str(self.threads)] if self.threads else []), "-s", system_of(tag), user_text(chars)]
        return localspec_json(args, env=self.env, timeout=1800)

    def close(self) -> None:
        run_localspec(["stop", "--all"], env=self.env, timeout=120)
        shutil.rmtree(self.runtime, ignore_errors=True)


def step_parts(data: dict, wall: float) -> dict[str, float]:
    """Where a later call's time went, ms per generated token (the decode's parts) or per call."""
    stats, timings = data["stats"], data["timings"]
    n = max(1, data["usage"]["completion_tokens"])
    decode = timings["decode"]
    target, verify, draft = stats["target_seconds"], stats["verify_seconds"], stats["draft_seconds"]
    return {"target pass": 1e3 * target / n, "verifier": 1e3 * verify / n, "drafters and planner": 1e3 * draft / n,
            "rest of the step loop": 1e3 * (decode - target - verify - draft) / n,
            "service, besides prefill and decode (per call)": 1e3 * (timings["service"] - timings["prefill"] - decode),
            "client process (per call)": 1e3 * (wall - timings["service"])}


def measure(args: argparse.Namespace, bindir: Path, root: Path) -> dict[int, dict[str, Side]]:
    results = {n: {"llama-server": Side(), "localspec": Side()} for n in args.lengths}
    sizes = {n: chars_for(n) for n in args.lengths}
    ls = Localspec(root, args.tokens, args.threads)
    server = Server(bindir, args.threads)
    try:
        progress("warm-up: the service loads the target")
        ls.call(sizes[args.lengths[0]], "warm")
        server.request(rendered(sizes[args.lengths[0]], "warm"), args.tokens, cache_prompt=False)
        for r in range(args.repeat):
            for n in args.lengths:
                tag = f"{r}-{n}"
                progress(f"round {r + 1}/{args.repeat}: {n} prompt tokens")
                for side in (("llama-server", "localspec") if r % 2 == 0 else ("localspec", "llama-server")):
                    got = results[n][side]
                    if side == "llama-server":
                        run = server.request(rendered(sizes[n], tag), args.tokens, cache_prompt=False)
                        t = run.data["timings"]
                        got.prefill.append(t["prompt_ms"] / t["prompt_n"])
                        got.decode.append(t["predicted_ms"] / t["predicted_n"])
                        got.texts.append(run.data["content"])
                    else:
                        run = ls.call(sizes[n], tag)
                        data = run.data
                        decoded = data["usage"]["prompt_tokens"] - data["usage"]["prompt_tokens_details"]["cached_tokens"]
                        got.prefill.append(1e3 * data["timings"]["prefill"] / max(1, decoded))
                        got.decode.append(1e3 * data["timings"]["decode"] / max(1, data["usage"]["completion_tokens"]))
                        got.texts.append(data["text"])
                        got.steps.append(step_parts(data, run.wall))
    finally:
        server.close()
        ls.close()
    return results


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


def tables(results: dict[int, dict[str, Side]], args: argparse.Namespace) -> list[str]:
    out = [*host_header(), "",
           f"The target alone, T = 0, up to {args.tokens} tokens, medians of {args.repeat} rounds (alternated). "
           "Speed ratios: localspec's tokens per second over llama-server's (above 1: localspec faster).", "",
           "| prompt tokens | prefill, llama-server (ms/token) | localspec | prefill ratio | decode, llama-server "
           "(ms/token) | localspec | decode ratio | same T = 0 text |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n, sides in results.items():
        srv, ls = sides["llama-server"], sides["localspec"]
        same = sum(a == b for a, b in zip(srv.texts, ls.texts, strict=True))
        out.append(f"| ~{n} | {med(srv.prefill):.2f} | {med(ls.prefill):.2f} | {med(srv.prefill) / med(ls.prefill):.3f}× "
                   f"| {med(srv.decode):.2f} | {med(ls.decode):.2f} | {med(srv.decode) / med(ls.decode):.3f}× "
                   f"| {same}/{len(srv.texts)} |")
    out += ["", "Where a later call's time goes (localspec, medians; ms per generated token unless marked "
                "per call):", "", "| part | " + " | ".join(f"~{n} tokens" for n in results) + " |",
            "| --- |" + " ---: |" * len(results)]
    parts = next(iter(results.values()))["localspec"].steps[0].keys()
    for part in parts:
        out.append(f"| {part} | " + " | ".join(f"{med([s[part] for s in sides['localspec'].steps]):.2f}"
                                             for sides in results.values()) + " |")
    out.append("| llama-server's decode, for comparison | "
               + " | ".join(f"{med(sides['llama-server'].decode):.2f}" for sides in results.values()) + " |")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=lambda s: tuple(int(x) for x in s.split(",")), default=LENGTHS,
                   help="prompt lengths in tokens, about (comma-separated; default %(default)s)")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per request (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads on both sides (default: each tool's own)")
    p.add_argument("--llama-cpp", type=Path, default=None, metavar="BINDIR",
                   help="llama.cpp's tools (default: built natively on first use, cached)")
    args = checked_args(p, argv)
    bindir = args.llama_cpp or native_llama_tools()
    with tempfile.TemporaryDirectory(prefix="localspec-parity-") as root:
        print("\n".join(tables(measure(args, bindir, Path(root)), args)))


if __name__ == "__main__":
    main()
