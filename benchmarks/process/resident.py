"""Resident-models benchmark: `localspec` calls from a script, each a fresh client process.

Per prompt, alternated, medians over --repeat rounds, T = 0, the default pair and settings:

* first call: no service running (``localspec stop --all`` before it): the call starts one;
* later call: served by the service the earlier calls left (nothing loaded); beside it, alternated,
  a later call of the target alone (``-d none -k 0``, a question of its own), the issue's floor;
* --keep-alive 0: the call in its own process, as every call was before resident models;
* llama.cpp's ``llama-completion`` on the same rendered prompt (``--prompt-cache FILE`` for the
  document question, an equivalent GBNF grammar for the extraction), built natively from the
  llama.cpp that llama-cpp-python vendors (as benchmarks/whole_process.py does);
* ``llama-server`` (same build, started once, the target alone) with a fresh ``curl`` process per
  request on /completion (``cache_prompt``: the server keeps the last prompt's KV, as localspec's
  service does), and the same with its best n-gram speculative mode (``--spec-type``) per prompt.

The ratios are of wall time per generated token (the tools do not all stop at the same token).
A second table: where a later call's time goes (the client's own cost: its wall time minus the
service's time for the call, which its ``--json`` timings report), the client's imports
(``python -X importtime``), and the memory of a resident pair against an in-process run's peak.

    python benchmarks/resident.py
    python benchmarks/resident.py --prompts code,extract --repeat 2 --no-llama
    python benchmarks/resident.py --later-only --no-repeated   # later calls against the target alone only
    python benchmarks/resident.py --client-only --repeat 3     # a later call's client cost (18 calls)
    python benchmarks/resident.py --client-only --repeat 3 --against /tmp/old   # and another checkout's

Progress goes to stderr, the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.host import host_header
from benchmarks.common.llama_tools import LLAMA_NGRAM_TYPES, Server, llama_completion, native_llama_tools
from benchmarks.common.options import progress
from benchmarks.common.prompts import PROMPTS as H2H_PROMPTS, QUESTIONS, document
from benchmarks.common.runs import TARGET_ALONE, Run, localspec_json, run_localspec
from benchmarks.common.schemas import TASKS, gbnf
from benchmarks.common.target import chat_text

CHECKOUT = Path(__file__).resolve().parents[2]  # the localspec every call runs (first on PYTHONPATH)
DOC_CHARS = 7000  # ~1,650 tokens of localspec's engine source
DOC_QUESTION = QUESTIONS[0]


@dataclass(frozen=True)
class Prompt:
    text: str  # what the user asks (after the document, for the document question)
    schema: dict | None = None  # a JSON schema (the extraction)
    document: bool = False  # asked about the benchmark's document (--context)


PROMPTS: dict[str, Prompt] = {
    "code": Prompt(H2H_PROMPTS["code"]),
    "prose": Prompt(H2H_PROMPTS["prose"]),
    "edit": Prompt(H2H_PROMPTS["code-edit"]),
    "summary": Prompt(H2H_PROMPTS["summarise"]),
    "extract": Prompt(TASKS["invoice"].prompt, schema=TASKS["invoice"].schema),
    "document": Prompt(DOC_QUESTION, document=True),
}
GROUNDED = ("edit", "summary", "extract", "document")
def tagged(text: str, tag: str) -> str:
    """The question with a tag of its own: no call asks what an earlier call of localspec asked
    (as a script's calls do), so no saved prompt of an earlier call is restored (the document of
    the document question stays a shared prefix); a round's later call and the servers' requests
    share theirs, so their T = 0 texts are compared."""
    return f"(#{tag}) {text}"


# ---------------------------------------------------------------- localspec


class Localspec:
    """`localspec` calls as a script makes them, in the benchmark's own directories."""

    def __init__(self, root: Path, tokens: int, threads: int | None) -> None:
        self.root = root
        self.tokens = tokens
        self.threads = threads
        self.doc = root / "document.txt"
        self.doc.write_text(document(DOC_CHARS), encoding="utf-8")
        runtime = Path(tempfile.mkdtemp(prefix="lsb-", dir="/tmp"))
        checkout = os.pathsep.join(filter(None, (str(CHECKOUT), os.environ.get("PYTHONPATH"))))
        self.env = dict(os.environ, LOCALSPEC_PROFILE_DIR=str(root / "profiles"), PYTHONPATH=checkout,
                        LOCALSPEC_PROMPT_CACHE=str(root / "prompts"), XDG_RUNTIME_DIR=str(runtime))
        self.runtime = runtime

    def args(self, prompt: Prompt, tag: str, extra: Sequence[str] = ()) -> list[str]:
        out = ["--json", "-n", str(self.tokens), "-t", "0", "--seed", "1", *extra,
               *(["--threads", str(self.threads)] if self.threads else [])]
        if prompt.schema is not None:
            out += ["--json-schema", json.dumps(prompt.schema)]
        if prompt.document:
            out += ["--context", str(self.doc)]
        return [*out, tagged(prompt.text, tag)]

    def call(self, prompt: Prompt, tag: str, keep_alive: str = "5m", importtime: bool = False,
             extra: Sequence[str] = (), env: dict[str, str] | None = None) -> Run:
        """One call from a fresh client process (benchmarks.common.runs), its JSON answer read."""
        return localspec_json(self.args(prompt, tag, extra), cwd=self.root,  # not a checkout: PYTHONPATH decides
                              env=dict(self.env, LOCALSPEC_KEEP_ALIVE=keep_alive, **(env or {})),
                              python_flags=["-X", "importtime"] if importtime else [], timeout=1800)

    def ask(self, text: str, schema: dict | None = None) -> Run:
        """A later call of exactly `text` (the repeated-work sets)."""
        return localspec_json(["--json", "-n", str(self.tokens), "-t", "0", "--seed", "1",
                               *(["--threads", str(self.threads)] if self.threads else []),
                               *(["--json-schema", json.dumps(schema)] if schema is not None else []), text],
                              env=dict(self.env, LOCALSPEC_KEEP_ALIVE="5m"), timeout=1800)

    def chat(self, turns: Sequence[str]) -> Run:
        """A `localspec chat` of these turns, piped (one client process; each reply a call)."""
        return run_localspec(["chat", "-n", str(self.tokens), "-t", "0", "--seed", "1",
                              *(["--threads", str(self.threads)] if self.threads else [])],
                             stdin="\n".join(turns) + "\n", env=dict(self.env, LOCALSPEC_KEEP_ALIVE="5m"))

    def services(self) -> list[dict]:
        return json.loads(run_localspec(["ps", "--json"], env=self.env, cwd=self.root, timeout=60).stdout)

    def stop_all(self) -> None:
        run_localspec(["stop", "--all"], env=self.env, cwd=self.root, timeout=120)

    def peak_rss_in_process(self, prompt: Prompt) -> int:
        """The peak resident memory of a --keep-alive 0 call (bytes): its own process, waited for with
        wait4 for its resource usage (not a timed run)."""
        cmd = [sys.executable, "-m", "localspec", *self.args(prompt, "peak")]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                env=dict(self.env, LOCALSPEC_KEEP_ALIVE="0"))
        _, status, usage = os.wait4(proc.pid, 0)
        return usage.ru_maxrss * 1024

    def close(self) -> None:
        self.stop_all()
        shutil.rmtree(self.runtime, ignore_errors=True)


# ---------------------------------------------------------------- llama.cpp


def rendered(prompt: Prompt, doc: Path, tag: str) -> str:
    """The text llama.cpp's tools decode: the user's message as localspec sends it (the document
    first), in the target's chat template (its default system message included, as localspec's)."""
    text = tagged(prompt.text, tag)
    if prompt.document:
        text = f"{doc.read_text(encoding='utf-8').rstrip()}\n\n{text}"
    return chat_text(text)


def completion(bindir: Path, prompt: Prompt, text: str, tokens: int, threads: int | None, root: Path) -> Run:
    """One llama-completion run (benchmarks.common.llama_tools) with the prompt's grammar or cache."""
    extra: list[str] = []
    if prompt.schema is not None:
        grammar = root / "extract.gbnf"
        grammar.write_text(gbnf(prompt.schema), encoding="utf-8")
        extra += ["--grammar-file", str(grammar)]
    if prompt.document:
        extra += ["--prompt-cache", str(root / "llama-completion.cache")]
    return llama_completion(bindir, text, tokens, threads, extra)


def served(server: Server, prompt: Prompt, doc: Path, tokens: int, tag: str) -> Run:
    """One request of the prompt to llama-server (its grammar, for the extraction)."""
    return server.request(rendered(prompt, doc, tag), tokens,
                          gbnf(prompt.schema) if prompt.schema is not None else None)


# ---------------------------------------------------------------- the tables


def med(samples: Sequence[Run]) -> float:
    return statistics.median(s.wall for s in samples)


def per_token(samples: Sequence[Run]) -> float:
    return statistics.median(s.per_token for s in samples)


def measure(args: argparse.Namespace, ls: Localspec, bindir: Path | None) -> dict[str, dict[str, list[Run]]]:
    """Every system's samples per prompt. Each round: the first call and the --keep-alive 0 call
    of each prompt, each from a state with no service (their order alternates between rounds),
    and llama-completion; then every prompt once more as a later call, in turn, so that the call
    before a later call asked something else (as a script's calls do: nobody asks the same
    question twice). llama-server runs after, restarted each round (its n-gram modes remember
    earlier answers across requests, which a repeated prompt would turn into perfect drafts)."""
    results: dict[str, dict[str, list[Run]]] = {name: {} for name in args.prompts}
    for name in args.prompts:  # the profile and the document's prompt cache one earlier run leaves
        progress(f"warm-up: {name}")
        ls.call(PROMPTS[name], f"warm-{name}", keep_alive="0")
        if bindir is not None and PROMPTS[name].document:
            completion(bindir, PROMPTS[name], rendered(PROMPTS[name], ls.doc, "warm-doc"), args.tokens, args.threads,
                       ls.root)
    for r in range(args.repeat):
        for name in [] if args.later_only else args.prompts:
            prompt, got = PROMPTS[name], results[name]
            progress(f"round {r + 1}/{args.repeat}: {name}, first call and --keep-alive 0")
            for kind in (("first", "keep-alive 0") if r % 2 == 0 else ("keep-alive 0", "first")):
                ls.stop_all()
                got.setdefault(kind, []).append(ls.call(prompt, f"{r}.{kind}", keep_alive="5m" if kind == "first"
                                                        else "0"))
            if bindir is not None:
                got.setdefault("llama-completion", []).append(
                    completion(bindir, prompt, rendered(prompt, ls.doc, f"{r}.completion"), args.tokens, args.threads,
                               ls.root))
        ls.call(PROMPTS[args.prompts[-1]], f"{r}.between")  # a service up (untimed), its last call another question
        for name in args.prompts:
            progress(f"round {r + 1}/{args.repeat}: {name}, a later call and one of the target alone")
            got = results[name]
            for kind in ("later", "later, target alone") if r % 2 == 0 else ("later, target alone", "later"):
                alone = kind != "later"  # its own question: nothing the other call decoded or wrote serves it
                got.setdefault(kind, []).append(ls.call(PROMPTS[name], f"{r}.{'alone' if alone else 'later'}",
                                                        extra=TARGET_ALONE if alone else ()))
            got.setdefault("client", []).append(_client_cost(ls, got["later"][-1]))
    if bindir is not None:
        for spec_type in (None, *LLAMA_NGRAM_TYPES):
            for r in range(args.repeat):
                progress(f"llama-server {spec_type or 'target alone'}, round {r + 1}/{args.repeat}")
                server = Server(bindir, args.threads, spec_type)
                try:
                    if "document" in args.prompts:  # its prompt cache holds the document, as localspec's does
                        served(server, PROMPTS["document"], ls.doc, args.tokens, f"{r}.between")
                    for name in args.prompts:
                        results[name].setdefault(f"server {spec_type or 'alone'}", []).append(
                            served(server, PROMPTS[name], ls.doc, args.tokens, f"{r}.later"))
                finally:
                    server.close()
    return results


def same_text(results: dict[str, dict[str, list[Run]]]) -> dict[str, tuple[int, int]]:
    """Per prompt, of the rounds: how many later calls wrote llama-server alone's T = 0 text (the
    same prompt, the same question)."""
    out = {}
    for name, got in results.items():
        pairs = list(zip(got.get("later", []), got.get("server alone", []), strict=False))  # none without a server
        out[name] = (sum(a.data.get("text") == b.data.get("content") for a, b in pairs), len(pairs))
    return out


def measure_repeated(args: argparse.Namespace, ls: Localspec, bindir: Path | None) -> dict:
    """The repeated-work sets (benchmarks.process.repeated) on each side, alternated by round; the
    service is restarted each round (and warmed with another question), as llama-server is, so no
    round drafts from an earlier round's answers."""
    from benchmarks.process import repeated

    results: dict[str, dict[str, list]] = {name: {} for name in repeated.SETS}
    render = _renderer()
    for r in range(args.repeat):
        tag = f"set{r}"
        ls.stop_all()
        ls.call(PROMPTS["code"], f"{r}.warm-sets")
        for name in repeated.SETS:
            progress(f"repeated work, round {r + 1}/{args.repeat}: {name}, localspec")
            results[name].setdefault("localspec", []).append(repeated.localspec_set(name, ls.ask, ls.chat, tag))
        if bindir is None:
            continue
        for spec_type in (None, *LLAMA_NGRAM_TYPES):
            server = Server(bindir, args.threads, spec_type)
            try:
                served(server, PROMPTS["code"], ls.doc, 8, f"{r}.warm-sets")
                for name in repeated.SETS:
                    progress(f"repeated work, round {r + 1}/{args.repeat}: {name}, llama-server {spec_type or 'alone'}")
                    results[name].setdefault(f"server {spec_type or 'alone'}", []).append(
                        repeated.server_set(name, server, render, args.tokens, tag))
            finally:
                server.close()
    return results


def _renderer() -> Any:
    """Messages as the target's chat template renders them (localspec's renderer)."""
    from localspec.llama.model import Model
    from localspec.prompt import check_messages, render_messages, template_of

    from benchmarks.common.target import default_target

    vocab = Model.vocabulary(default_target())
    return lambda messages: render_messages(vocab, template_of(vocab), check_messages(messages), True, None)


def _client_cost(ls: Localspec, later: Run) -> Run:
    """A later call's wall time minus the service's time for it (its --json timings.service)."""
    return Run(later.wall - float(later.data.get("timings", {}).get("service")), 1)


def speed_table(results: dict[str, dict[str, list[Run]]], with_llama: bool, later_only: bool = False) -> list[str]:
    """Per prompt: the first call, later calls, --keep-alive 0 calls (not with `later_only`); a later
    call against one of the target alone; and (`with_llama`) against llama-completion and llama-server."""
    if later_only:
        return alone_table(results)
    head = ("| prompt | tokens | first call s | later calls s | --keep-alive 0 s | first vs keep-alive 0 "
            "| later vs the target alone (later) |")
    rule = "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    if with_llama:
        head += (" llama-completion s | llama-server s | llama-server n-gram s (mode) | later vs llama-completion |"
                 " later vs llama-server | later vs llama-server n-gram |")
        rule += " ---: | ---: | ---: | ---: | ---: | ---: |"
    lines = [head, rule]
    for name, got in results.items():
        later = got["later"]
        row = (f"| {name} | {statistics.median(s.tokens for s in later):.0f} | {med(got['first']):.2f} | "
               f"{med(later):.2f} | {med(got['keep-alive 0']):.2f} | "
               f"{med(got['first']) / med(got['keep-alive 0']):.2f}× | "
               f"{per_token(got['later, target alone']) / per_token(later):.2f}× |")
        if with_llama:
            ngram = {k: v for k, v in got.items() if k.startswith("server ngram")}
            best = min(ngram, key=lambda k: per_token(ngram[k]))
            row += (f" {med(got['llama-completion']):.2f} | {med(got['server alone']):.2f} | "
                    f"{med(ngram[best]):.2f} ({best.removeprefix('server ')}) | "
                    f"**{per_token(got['llama-completion']) / per_token(later):.2f}×** | "
                    f"**{per_token(got['server alone']) / per_token(later):.2f}×** | "
                    f"{per_token(ngram[best]) / per_token(later):.2f}× |")
        lines.append(row)
    return lines


def alone_table(results: dict[str, dict[str, list[Run]]]) -> list[str]:
    """Later calls against later calls of the target alone (`-d none -k 0`), per prompt."""
    lines = ["| prompt | tokens | later calls s | the target alone s | later vs the target alone |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, got in results.items():
        later, alone = got["later"], got["later, target alone"]
        lines.append(f"| {name} | {statistics.median(s.tokens for s in later):.0f} | {med(later):.2f} | {med(alone):.2f} "
                     f"| **{per_token(alone) / per_token(later):.2f}×** |")
    return lines


def overhead_table(results: dict[str, dict[str, list[Run]]], ls: Localspec, args: argparse.Namespace) -> list[str]:
    clients = [s.wall for got in results.values() for s in got["client"]]
    probe = PROMPTS[args.prompts[0]]
    ls.call(probe, "probe")  # a service for the import trace
    traced = ls.call(probe, "traced", importtime=True)
    imports = [line for line in traced.stderr.splitlines() if line.startswith("import time:")]
    total_us = sum(int(line.split("|")[0].split(":")[1]) for line in imports[1:])
    heavy = sorted({line.rsplit("|", 1)[-1].strip().split(".")[0] for line in imports}
                   & {"numpy", "llama_cpp", "llguidance", "pydantic", "jinja2"})
    (service,) = ls.services()
    peak = ls.peak_rss_in_process(probe)
    return ["| measure | value |", "| --- | ---: |",
            f"| a later call's client cost (wall minus the service's time), median of {len(clients)} | "
            f"{1000 * statistics.median(clients):.0f} ms |",
            f"| the client's imports (`python -X importtime`, self times summed) | {total_us / 1000:.0f} ms |",
            f"| heavy modules the client imports | {', '.join(heavy) or 'none'} |",
            f"| resident pair's memory (`localspec ps`, after {service['calls']} calls) | "
            f"{service['memory_bytes'] / 2**20:.0f} MB |",
            f"| an in-process call's peak memory (`--keep-alive 0`, {args.prompts[0]}) | {peak / 2**20:.0f} MB |"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", default=",".join(PROMPTS), help=f"comma-separated, of {', '.join(PROMPTS)}")
    p.add_argument("--repeat", type=int, default=3, help="alternated rounds (medians)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-llama", action="store_true", help="skip llama-completion and llama-server")
    p.add_argument("--no-repeated", action="store_true", help="skip the repeated-work sets")
    p.add_argument("--later-only", action="store_true",
                   help="only later calls against later calls of the target alone (no first calls, no llama.cpp)")
    p.add_argument("--only-repeated", action="store_true", help="only the repeated-work sets")
    p.add_argument("--client-only", action="store_true",
                   help="only a later call's client cost: each prompt's later call per round (--repeat 3: 18 calls)")
    p.add_argument("--against", type=Path, default=None, metavar="CHECKOUT",
                   help="with --client-only: another checkout's client too, alternated call by call")
    args = p.parse_args(argv)
    args.prompts = [n.strip() for n in args.prompts.split(",") if n.strip()]
    unknown = [n for n in args.prompts if n not in PROMPTS]
    if unknown or not args.prompts:
        p.error(f"unknown prompts {unknown}; use {', '.join(PROMPTS)}")
    if args.repeat < 1 or args.tokens < 1:
        p.error("--repeat and --tokens must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client_only:
        return client_only(args)
    bindir = None if args.no_llama or args.later_only else native_llama_tools()
    with tempfile.TemporaryDirectory(prefix="resident-bench-") as tmp:
        ls = Localspec(Path(tmp), args.tokens, args.threads)
        try:
            lines = [*host_header()]
            if not args.only_repeated:
                results = measure(args, ls, bindir)
                lines += [f"{args.tokens} tokens, T = 0, medians of {args.repeat} alternated rounds; "
                          "ratios of wall time per generated token (higher: localspec faster).", "",
                          *speed_table(results, bindir is not None, args.later_only), ""]
                if bindir is not None:
                    lines += ["The same T = 0 text as llama-server alone (the same prompt, the same question), "
                              "of the rounds: " + ", ".join(f"{n} {a}/{b}" for n, (a, b) in same_text(results).items()),
                              ""]
                if not args.later_only:
                    lines += overhead_table(results, ls, args)
            if not args.no_repeated:
                from benchmarks.process import repeated

                sets = measure_repeated(args, ls, bindir)
                lines += ["", f"Repeated work: medians of {args.repeat} rounds of whole sets, each call a fresh "
                          "process (wall seconds; higher ratios: localspec faster).", "", *repeated.table(sets)]
                progress(repeated.dump(sets))
        finally:
            ls.close()
    print("\n".join(lines))
    return 0


def client_only(args: argparse.Namespace) -> int:
    """--client-only: the client cost table alone (benchmarks.process.resident_client)."""
    from benchmarks.process import resident_client

    with tempfile.TemporaryDirectory(prefix="resident-bench-") as tmp:
        ls = Localspec(Path(tmp), args.tokens, args.threads)
        try:
            lines = [*host_header(), *resident_client.table(args, ls, PROMPTS)]
        finally:
            if args.against is not None:  # its own service, in the same runtime directory
                run_localspec(["stop", "--all"], env=dict(ls.env, PYTHONPATH=str(args.against)), cwd=ls.root,
                              timeout=120)
            ls.close()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
