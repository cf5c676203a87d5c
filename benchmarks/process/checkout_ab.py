"""Two checkouts of localspec, whole process, side by side: does a change (a refactoring) keep the
text and the speed?

Every run is a fresh ``python -m localspec`` process with one checkout first on ``PYTHONPATH``
(its own compiled verifier copied in: ``localspec/_verifier.abi3.so``), no resident service
(``--keep-alive 0``), no prompt cache, each side with its own copy of the cost profiles (copied
from ``--profiles`` at the start, so both begin equally warm and neither learns from the
other's runs). Runs alternate (old, new, then new, old, ...); the table gives each side's median
wall time, the ratio old/new (> 1: the new checkout is faster) and whether every run of both
sides wrote the same text.

    git worktree add --detach /tmp/old <commit> && cp localspec/_verifier.abi3.so /tmp/old/localspec/
    python benchmarks/checkout_ab.py --old /tmp/old --new . --repeat 5
    python benchmarks/checkout_ab.py --old /tmp/old --new . --prompts prose -- --plan fixed -k 3 --drafter ngram

Arguments after ``--`` go to both sides' ``localspec`` (default: the default settings, T = 0).
Progress goes to stderr, the markdown table to stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.host import host_header
from benchmarks.common.prompts import PROMPTS
from benchmarks.common.runs import run_localspec

SIDES = ("old", "new")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the checkout before the change")
    parser.add_argument("--new", type=Path, required=True, help="the checkout after it")
    parser.add_argument("--prompts", default="code,prose,code-edit,summarise",
                        help=f"comma-separated, of: {', '.join(PROMPTS)}")
    parser.add_argument("--repeat", type=int, default=3, help="runs per side and prompt")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--profiles", type=Path, default=Path.home() / ".cache" / "localspec" / "profiles",
                        help="cost profiles both sides start from (copied)")
    parser.add_argument("extra", nargs="*", help="arguments for both sides' localspec (after --)")
    args = parser.parse_args(argv)
    for side in SIDES:
        root = getattr(args, side)
        if not (root / "localspec" / "__init__.py").is_file():
            parser.error(f"--{side} {root}: not a localspec checkout (no localspec/__init__.py)")
        if not any((root / "localspec").glob("_verifier*.so")):
            parser.error(f"--{side} {root}: its compiled verifier is missing; copy localspec/_verifier.abi3.so "
                         "there (or build it)")
    unknown = [p for p in args.prompts.split(",") if p not in PROMPTS]
    if unknown:
        parser.error(f"unknown prompt {unknown[0]!r}; use {', '.join(PROMPTS)}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def run(root: Path, profiles: Path, prompt: str, tokens: int, extra: Sequence[str]) -> tuple[float, str]:
    """One fresh process of the checkout at `root`: (wall seconds, text)."""
    env = dict(os.environ, PYTHONPATH=str(root.resolve()), LOCALSPEC_PROMPT_CACHE="off",
               LOCALSPEC_PROFILE_DIR=str(profiles))
    args = ["--keep-alive", "0", "-t", "0", "-n", str(tokens), *extra, "--raw", prompt]
    try:
        done = run_localspec(args, env=env, cwd=tempfile.gettempdir(), timeout=None)
    except RuntimeError as exc:
        sys.exit(f"{root}: {exc}")
    return done.wall, done.stdout


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="localspec-ab-") as scratch:
        profiles = {}
        for side in SIDES:
            profiles[side] = Path(scratch) / side
            if args.profiles.is_dir():
                shutil.copytree(args.profiles, profiles[side], symlinks=True)
            else:
                profiles[side].mkdir(mode=0o700)
        lines = ["| prompt | old, median s | new, median s | old / new | same text |", "| --- | ---: | ---: | ---: | --- |"]
        for name in args.prompts.split(","):
            walls: dict[str, list[float]] = {side: [] for side in SIDES}
            texts: set[str] = set()
            for i in range(args.repeat):
                for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                    print(f"{name}: {side} run {i + 1}/{args.repeat}", file=sys.stderr, flush=True)
                    wall, text = run(getattr(args, side), profiles[side], PROMPTS[name], args.tokens, args.extra)
                    walls[side].append(wall)
                    texts.add(text)
            old, new = statistics.median(walls["old"]), statistics.median(walls["new"])
            lines.append(f"| {name} | {old:.2f} | {new:.2f} | {old / new:.3f} | {'yes' if len(texts) == 1 else 'no'} |")
    print("\n".join(host_header()))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
