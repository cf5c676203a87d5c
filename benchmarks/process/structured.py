"""Structured-output benchmark: constrained generation as users run it, whole process.

Each task is a prompt and a JSON schema (extraction of fields from an email and from an invoice,
records from a table, classification into an enum with a reason, a code task answering in a JSON
object, and a story in one long string field for the constraint's own cost). Every run is a
fresh process at T = 0, alternated: localspec's default settings (warm: the profile a first run
of the task left), the target alone with the same constraint (``-d none -k 0``), and llama.cpp's
own ``llama-completion`` on the same rendered prompt (built natively from the llama.cpp that
llama-cpp-python vendors, as benchmarks/whole_process.py does) with a GBNF grammar equivalent to
the schema in localspec's compact layout (:func:`gbnf`; its ``--json-schema`` allows whitespace
localspec's layout forbids, so the outputs would differ in length). The ratios are of wall time,
and against llama-completion also of wall time per generated token.

Columns (medians over --repeat runs):

* tokens: of localspec's answer; valid: it parses as JSON and the grammar accepts it complete;
* forced %: tokens the grammar forces (llguidance's fast-forward tokens at that point);
  copied %: other tokens that continue a 2-token match of the context (prompt and output so far);
  ceiling: tokens per target pass if every forced or copied token were drafted and accepted
  (tokens / the others);
* decode tok/s of the default and of the target alone; whole-process seconds and ratios;
* constraint ms/token: time in the grammar (masks for drafting and verifying, forced tokens,
  following the output) per generated token, in the default run and in the target alone's, and
  that as a share of the target alone's time per token.

    python benchmarks/structured.py                       # every task, 3 repeats
    python benchmarks/structured.py --tasks email,invoice --repeat 5
    python benchmarks/structured.py --no-llama-completion

Progress goes to stderr, the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common.host import host_header
from benchmarks.common.llama_tools import llama_completion, native_llama_tools
from benchmarks.common.options import checked_args, progress, task_options
from benchmarks.common.runs import TARGET_ALONE, Run, localspec
from benchmarks.common.schemas import TASKS, Task, gbnf
from benchmarks.common.target import chat_text, default_target


@dataclass(frozen=True)
class Shares:
    tokens: int
    forced: int
    copied: int
    valid: bool

    @property
    def ceiling(self) -> float:
        """Tokens per target pass if every forced or copied token were drafted and accepted."""
        return self.tokens / max(1, self.tokens - self.forced - self.copied)


def shares(task: Task, text: str) -> Shares:
    """Forced and copied tokens of an answer, and whether it is valid (parses as JSON; the grammar
    accepts it complete), replayed through the grammar on the target's vocabulary."""
    from localspec.decoding.grammar.follower import GrammarFollower
    from localspec.llama.model import Model
    from localspec.settings.constraints import Constraint

    vocab = Model.vocabulary(default_target())
    try:
        context = vocab.tokenize(chat_text(task.prompt), add_special=False, parse_special=True)
        answer = vocab.tokenize(text, add_special=False)
        follower = GrammarFollower.for_model(Constraint.json_schema(task.schema), vocab)
        follower.reset(context)
        forced = copied = 0
        for token in answer:
            if follower.forced()[:1] == [token]:
                forced += 1
            elif _continues_match(context, token):
                copied += 1
            follower.commit([token])
            context.append(token)
        valid = follower.accepts_end() and _parses(text)
        return Shares(len(answer), forced, copied, valid)
    finally:
        vocab.close()


def _continues_match(context: list[int], token: int) -> bool:
    """Whether the context's last two tokens occurred earlier followed by `token`."""
    if len(context) < 2:
        return False
    a, b = context[-2], context[-1]
    return any(context[i] == a and context[i + 1] == b and context[i + 2] == token for i in range(len(context) - 2))


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def run_task(name: str, task: Task, args: argparse.Namespace, root: Path, bindir: Path | None) -> list[str]:
    """One task's row: the default (warm), the target alone and llama-completion, alternated."""
    schema = json.dumps(task.schema)
    common = ["-n", str(args.tokens), "-t", "0", "--seed", "1", "--json-schema", schema]
    progress(f"{name}: warm-up")
    localspec(common, task.prompt, root / "warm", args.threads)
    default: list[Run] = []
    alone: list[Run] = []
    llama: list[Run] = []
    text = chat_text(task.prompt) if bindir else ""
    grammar_file = root / f"{name}.gbnf"
    grammar_file.write_text(gbnf(task.schema), encoding="utf-8")
    for r in range(args.repeat):
        progress(f"{name}: {r + 1}/{args.repeat}")
        default.append(localspec(common, task.prompt, root / "warm", args.threads))
        alone.append(localspec([*common, *TARGET_ALONE], task.prompt, root / "alone", args.threads))
        if bindir:
            llama.append(llama_completion(bindir, text, args.tokens, args.threads,
                                          ["--grammar-file", str(grammar_file)]))
    med = statistics.median
    answer = default[0].data
    s = shares(task, answer["text"])
    satisfied = all(r.data.get("constraint_satisfied") for r in default + alone)
    same = all(r.data["text"] == answer["text"] for r in default + alone)
    per_token_alone = med(r.timings["decode"] / max(r.tokens, 1) for r in alone)
    constraint = med(r.data["stats"]["constraint_seconds"] / max(r.tokens, 1) for r in default)
    constraint_alone = med(r.data["stats"]["constraint_seconds"] / max(r.tokens, 1) for r in alone)
    vs_llama = "— | — | —"
    if llama:
        per_llama = med(x.wall / x.tokens for x in llama)
        vs_llama = (f"{med(x.wall for x in llama):.2f} ({med(x.tokens for x in llama):.0f}) | "
                    f"**{med(x.wall for x in llama) / med(r.wall for r in default):.2f}×** | "
                    f"{per_llama / med(r.wall / max(r.tokens, 1) for r in default):.2f}×")
    return [f"| {name}{' (extraction)' if task.extraction else ''} | {s.tokens} | "
            f"{'yes' if s.valid and satisfied else 'NO'}{'' if same else ' (texts differ)'} | "
            f"{100 * s.forced / max(s.tokens, 1):.0f} | {100 * s.copied / max(s.tokens, 1):.0f} | {s.ceiling:.2f} | "
            f"{med(r.data['stats']['block_efficiency'] for r in default):.2f} | "
            f"{med(r.decode_tps for r in default):.1f} / {med(r.decode_tps for r in alone):.1f} | "
            f"{med(r.wall for r in default):.2f} | {med(r.wall for r in alone):.2f} | "
            f"**{med(r.wall for r in alone) / med(r.wall for r in default):.2f}×** | {vs_llama} | "
            f"{constraint * 1e3:.2f} / {constraint_alone * 1e3:.2f} ({100 * constraint_alone / per_token_alone:.1f} %) |"]


HEADER = ["| task | tokens | valid | forced % | copied % | ceiling | tokens/pass | decode tok/s default / alone | "
          "default s | target alone s | **default vs alone** | llama-completion s (tokens) | "
          "**default vs llama-completion** | per token | constraint ms/token default / alone (% of alone's) |",
          "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]


def setup_cost() -> list[str]:
    """What building the grammar's tokenizer costs (once per process; the CLI overlaps it with the load)."""
    from localspec.decoding.grammar.tokenizer import build_tokenizer
    from localspec.llama.model import Model

    vocab = Model.vocabulary(default_target())
    try:
        t0 = time.perf_counter()
        build_tokenizer(vocab)
        seconds = time.perf_counter() - t0
    finally:
        vocab.close()
    return [f"Grammar tokenizer for the target's {vocab.n_vocab}-token vocabulary: {seconds:.2f} s once per "
            "process (the CLI builds it in a background thread while the weights load)."]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    task_options(p, TASKS, tokens=320)
    p.add_argument("--no-llama-completion", action="store_true",
                   help="skip llama.cpp's llama-completion (otherwise built natively once, a few minutes)")
    return checked_args(p, argv, TASKS)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    bindir = None if args.no_llama_completion else native_llama_tools()
    with tempfile.TemporaryDirectory(prefix="localspec-structured-") as tmp:
        print("\n".join(host_header()))
        print("\n".join(setup_cost()))
        print()
        rows = [line for name in args.tasks for line in run_task(name, TASKS[name], args, Path(tmp), bindir)]
        print("\n".join(HEADER + rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
