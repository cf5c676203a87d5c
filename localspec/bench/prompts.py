"""The one prompt registry: named prompts (the texts the documented benchmark tables were measured
with, which `localspec bench`'s built-in sets and the repository's benchmarks/ both draw on), the
sets `localspec bench --prompts` offers, and prompt files (one prompt per line, or a JSON list)."""

from __future__ import annotations

import json
from pathlib import Path

from localspec.errors import ConfigError
from localspec.settings.files import TEXT_LIMIT, read_user_text

PROMPTS: dict[str, str] = {
    # the texts the documented benchmark tables were measured with (docs/head-to-head.md,
    # docs/whole-process.md: benchmarks/decode/head_to_head.py, benchmarks/process/whole_process.py)
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
    "rename": ("Rename the variable `tmp` to `total` in this code and show the whole code:\n\n"
               "def mean(numbers):\n    tmp = 0\n    for n in numbers:\n        tmp += n\n"
               "    return tmp / len(numbers) if numbers else 0.0\n"),
    # more fresh code and free text for `localspec bench`'s sets
    "fibonacci": "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "stack": "Write a Python class for a stack with push, pop and peek methods.",
    "merge": "Write a Python function that merges two sorted lists into one sorted list.",
    "sky": "Explain in a short paragraph why the sky is blue.",
    "water-cycle": "Describe the water cycle to a ten-year-old.",
    "documentation": "Give three tips for writing clear technical documentation.",
}
GROUNDED = ("code-edit", "summarise", "rename")  # input-grounded: the answer largely repeats the prompt
SETS: dict[str, tuple[str, ...]] = {  # `localspec bench --prompts`: names of PROMPTS
    "code": ("fibonacci", "stack", "code", "merge"),  # fresh code: the draft must guess what comes next
    "prose": ("sky", "prose", "water-cycle", "documentation"),  # free text: lower agreement of draft and target
    "code-edit": ("code-edit", "rename", "summarise"),  # input-grounded: n-gram drafting shines here
}
PROMPT_SETS: dict[str, tuple[str, ...]] = {name: tuple(PROMPTS[n] for n in names) for name, names in SETS.items()}
ALL = "all"


def builtin_prompts(name: str) -> dict[str, tuple[str, ...]]:
    """The built-in prompt set `name` (or every set for "all"), keyed by set name."""
    if name == ALL:
        return dict(PROMPT_SETS)
    if name not in PROMPT_SETS:
        raise ConfigError(f"unknown prompt set {name!r}; choose one of {', '.join(PROMPT_SETS)}, {ALL}, "
                         "or give a file path")
    return {name: PROMPT_SETS[name]}


def load_prompt_file(path: str | Path) -> tuple[str, ...]:
    """Prompts from a file: a JSON list of strings, or one prompt per (non-empty) line."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"prompt file {str(p)!r} does not exist (give code, prose, code-edit, all, "
                         "or the path of a file with one prompt per line or a JSON list of strings)")
    text = read_user_text(p, param="prompts", limit=TEXT_LIMIT, what="the prompt file")  # bounded: /dev/zero ends
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except RecursionError:
            raise ConfigError(f"prompt file {str(p)!r} nests its JSON too deeply") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"prompt file {str(p)!r} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                             "give a JSON list of strings or one prompt per line") from None
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise ConfigError(f"prompt file {str(p)!r} must hold a JSON list of strings")
        prompts = tuple(x for x in data if x.strip())
    else:
        prompts = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not prompts:
        raise ConfigError(f"prompt file {str(p)!r} holds no prompts")
    return prompts


def load_prompts(spec: str) -> dict[str, tuple[str, ...]]:
    """Built-in set names (comma list, or "all"), or a file path (the set is then named after the file)."""
    names = [n.strip() for n in spec.split(",")]
    if all(n == ALL or n in PROMPT_SETS for n in names):
        return {k: v for n in names for k, v in builtin_prompts(n).items()}
    return {Path(spec).stem or spec: load_prompt_file(spec)}
