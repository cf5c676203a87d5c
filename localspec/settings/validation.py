"""The checks every setting shares: numbers as settings take them (an int, a float, numpy's
scalars; never a bool), the ConfigError that names the setting at fault, the message for unknown
keyword names. A leaf: the standard library and :mod:`localspec.errors` only."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from localspec.errors import ConfigError

INT32_MAX = 2**31 - 1  # what llama.cpp's int32 counts (tokens, threads, layers, top-k) hold
# pydantic's configuration of every dataclass a process reads from another (the resident service's
# requests, a service's status: localspec.core.wire): no field it does not know, no value converted
# from another type ("3" is no int, true no number), and no number that is not finite (NaN, inf)
WIRE_CONFIG: dict[str, Any] = {"extra": "forbid", "strict": True, "allow_inf_nan": False}


def is_number(value: Any) -> bool:
    """A real number (int, float, numpy's scalars, Fraction; never a bool) that a float can hold:
    10**400 is no temperature."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or type(value).__name__ == "bool_":
        return False
    try:
        float(value)
    except (OverflowError, ValueError, TypeError):
        return False
    return True


def is_int(value: Any) -> bool:
    """An integral number: an int (numpy's included) or a float with no fractional part."""
    if isinstance(value, numbers.Integral):
        return not isinstance(value, bool) and type(value).__name__ != "bool_"
    return is_number(value) and float(value).is_integer()


def as_int(value: Any) -> Any:
    """An integral setting as a Python int (3.0 and numpy.int64(3) are 3); other values as they
    are, for the range check to refuse."""
    return int(value) if is_int(value) else value


def as_float(value: Any) -> Any:
    return float(value) if is_number(value) else value


def unknown_names(names: Any, known: Sequence[str], what: str) -> str:
    """The message for unknown keyword names, suggesting the closest known name of each."""
    import difflib

    parts = []
    for name in sorted(map(str, names)):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        parts.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return f"unknown {what}: {', '.join(parts)}; known: {', '.join(sorted(known))}"


def show(value: Any) -> str:
    """A value as an error message shows it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def empty_value(needed: str) -> str:
    """The error of a flag given an empty value: an unset shell variable, never "no value"."""
    return f"the value is empty (an unset shell variable?); give {needed}, or leave the flag out"


def require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ConfigError(message, param)


def choice(value: Any, param: str, choices: Sequence[str]) -> None:
    require(isinstance(value, str) and value in choices, param,
            f"{param} must be one of {', '.join(choices)}, got {show(value)}")
