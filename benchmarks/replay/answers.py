"""What a replay decodes again: the target alone's greedy answers, recorded once and kept in a file
(a replay then loads no model), and the cost curve it prices the steps with, given as ratios
c(n)/c(1) (``--curve``) on a nominal c(1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common.target import greedy_answer

Answers = dict[str, tuple[list[int], list[int]]]  # prompt name: (prompt tokens, greedy output)
NOMINAL_C1 = 0.03  # seconds: c(1) of a replay that decodes nothing (speedups are ratios, the scale cancels)


def record(target: Any, prompts: dict[str, str], max_tokens: int, saved: Path | None = None) -> Answers:
    """The target alone's greedy answer to each prompt (chat template), as token ids; with
    `saved`, answers recorded earlier for the same model file, prompt text and length are read
    from there and new ones added to it (a replay then needs no decoding)."""
    key = {"model": Path(target.path).name, "bytes": target.file_bytes, "tokens": max_tokens}
    store = read_answers(saved, key)
    found = found_answers(store, prompts)
    for name, text in prompts.items():
        if name not in found:
            print(f"recording {name}", file=sys.stderr, flush=True)
            found[name] = greedy_answer(target, text, max_tokens)
            store[name] = {"text": text, "prompt": found[name][0], "output": found[name][1]}
    if saved is not None:
        saved.write_text(json.dumps({**key, "answers": store}))
    return {name: found[name] for name in prompts}


def read_answers(saved: Path | None, key: dict) -> dict:
    """The answers in `saved` if it holds answers recorded under `key` (model, length), else none."""
    if saved is None or not saved.is_file():
        return {}
    data = json.loads(saved.read_text())
    same = all(data.get(k) == v for k, v in key.items())
    return data.get("answers", {}) if same else {}


def found_answers(store: dict, prompts: dict[str, str]) -> Answers:
    """The answers in `store` to those of `prompts` whose text it holds unchanged, in their order."""
    return {name: (list(entry["prompt"]), list(entry["output"])) for name, text in prompts.items()
            if (entry := store.get(name)) is not None and entry.get("text") == text}


def recorded(saved: Path | None, prompts: dict[str, str], max_tokens: int) -> Answers | None:
    """Every prompt's answer from `saved` (whatever model recorded them), or None if one is missing."""
    found = found_answers(read_answers(saved, {"tokens": max_tokens}), prompts)
    return found if len(found) == len(prompts) else None


def parse_curve(text: str) -> dict[int, float]:
    """`2:1.76,4:3.02,...` as {1: 1.0, 2: 1.76, 4: 3.02, ...}, checked (an argparse type: --curve of
    the replays)."""
    curve = {1: 1.0}
    for item in text.replace(" ", "").split(","):
        n, _, ratio = item.partition(":")
        try:
            size, value = int(n), float(ratio)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not N:RATIO (a pass size and its cost in c(1), "
                                             "e.g. 16:8.43)") from None
        if not 1 <= size <= 64 or not 1.0 <= value <= size:
            raise argparse.ArgumentTypeError(f"{item!r}: a pass of 1 to 64 tokens costs between c(1) and N·c(1)")
        curve[size] = value
    return curve

