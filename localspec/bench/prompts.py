"""Built-in prompt sets for benchmarks, and prompt files (one prompt per line, or a JSON list)."""

from __future__ import annotations

import json
from pathlib import Path

from localspec.errors import ConfigError
from localspec.files import TEXT_LIMIT, read_user_text

PROMPT_SETS: dict[str, tuple[str, ...]] = {
    # fresh code: the draft must guess what comes next
    "code": (
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a Python class for a stack with push, pop and peek methods.",
        "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
        "Write a Python function that merges two sorted lists into one sorted list.",
    ),
    # free text: lower agreement between draft and target
    "prose": (
        "Explain in a short paragraph why the sky is blue.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Describe the water cycle to a ten-year-old.",
        "Give three tips for writing clear technical documentation.",
    ),
    # input-grounded: the answer largely repeats the prompt (n-gram drafting shines here)
    "code-edit": (
        "Add type hints to this function and return it unchanged otherwise:\n\n"
        "def scale(values, factor, offset=0):\n"
        "    result = []\n"
        "    for value in values:\n"
        "        result.append(value * factor + offset)\n"
        "    return result\n",
        "Rename the variable `tmp` to `total` in this code and show the whole code:\n\n"
        "def mean(numbers):\n"
        "    tmp = 0\n"
        "    for n in numbers:\n"
        "        tmp += n\n"
        "    return tmp / len(numbers) if numbers else 0.0\n",
        "Summarise this paragraph in two sentences, reusing its wording:\n\n"
        "Speculative decoding speeds up text generation by letting a small draft model propose "
        "several tokens, which the large target model then checks in a single forward pass. "
        "Tokens the target agrees with are kept; the first disagreement is replaced by a token "
        "drawn from a corrected distribution, so the output is distributed exactly as if the "
        "target had generated it alone.",
    ),
}
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
