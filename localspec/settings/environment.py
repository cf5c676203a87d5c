"""localspec's environment variables: every one is named here, and each is parsed here.

A bad value is a one-line :class:`~localspec.errors.ConfigError` that names the variable and says
what to write instead. The command line parses them all before any command runs (a bad one is a
usage error: exit status 2, never a traceback); the Python API where a value is first needed,
before any work that depends on it. An empty variable counts as unset.

Read by localspec itself (:func:`get`):

============================  ====================================================  ================
variable                      value                                                 default
============================  ====================================================  ================
LOCALSPEC_CACHE_DIR           directory of models, profiles and the prompt cache    user cache dir
LOCALSPEC_PROFILE_DIR         directory of cost profiles and CPU kernel checks      <cache>/profiles
LOCALSPEC_PROMPT_CACHE        directory of the prompt cache, or off                 <cache>/prompts
LOCALSPEC_PROMPT_CACHE_LIMIT  size the prompt cache keeps on disk: 4G, 512M, bytes  4G
LOCALSPEC_PIP_ARGS            pip arguments for fetching models (shell words)       none
LOCALSPEC_RPC_TIMEOUT         duration one remote decode may take: 120, 90s, 5m     120 s
LOCALSPEC_LLAMA_LOG           boolean: llama.cpp's log at debug level (with -vv)    off
LOCALSPEC_KEEP_ALIVE          duration the models stay loaded in a resident         5m
                              service after a call (``--keep-alive``): 30s, 5m,
                              1h, 1h30m (0 = never)
LOCALSPEC_MAX_LOADED          most pairs the resident service keeps loaded at once  3
                              (the idle one used least recently is unloaded first)
============================  ====================================================  ================

Read by the command line as the default of a flag (click; a bad value is reported as the flag's,
"(from $LOCALSPEC_...)" added): LOCALSPEC_MODEL (``-m``), LOCALSPEC_DRAFT (``-d``),
LOCALSPEC_CACHE_TYPE (``--cache-type``), LOCALSPEC_LOAD_MODE (``--load-mode``),
LOCALSPEC_CPU_KERNELS (``--cpu-kernels``), LOCALSPEC_RPC (``--rpc``), LOCALSPEC_API_KEY
(``serve --api-key``) and LOCALSPEC_PROMPT_CACHE (``--prompt-cache``, also read by the Python API).

Read when the C verifier is built (``native/build_verifier.py``): LOCALSPEC_CFLAGS, LOCALSPEC_LDFLAGS.
The tests' own variables are not localspec's (TESTS_REQUIRE_RPC, TESTS_SKIP_REAL_MODELS,
TESTS_N_GPU_LAYERS: tests/). Any other LOCALSPEC_* variable is reported by the command line as
unknown (with the closest known name: a typo would otherwise be ignored).

Sizes are bytes with an optional K, M, G or T suffix (powers of 1024; B and iB are allowed);
durations are seconds, or a number with a unit (h, m, s, ms) per part in that order: 1h30m, 2m30s;
booleans are 1/0, true/false, yes/no or on/off. ``inf``, ``nan``, negative numbers and anything
else are refused. A leaf module (the standard
library and :mod:`localspec.errors` only).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

TYPE_CHECKING = False  # typing is not imported at run time: the `localspec` client starts in milliseconds
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any, Literal

from localspec.errors import ConfigError

MAX_SIZE = 2**63 - 1  # bytes: what a file offset holds
MAX_DURATION = 10 * 365 * 86400.0  # seconds (ten years): every timer and sleep takes it
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*(?:([KMGT])(?:I?B)?|B)?", re.I)
_NUMBER = re.compile(r"\d+(?:\.\d+)?|\.\d+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*(ms|h|m|s)\s*", re.I)
_DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3}  # in the order parts must come
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
OFF = ("off", "none", "0", "false", "no")  # a directory setting that turns a feature off


def _show(text: str) -> str:
    """A value as a message shows it: its repr (one line), cut to 60 characters."""
    shown = repr(text)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _refuse(name: str, text: str, problem: str, param: str | None) -> ConfigError:
    return ConfigError(f"{name}={_show(text)} {problem}", param)


# ---------------------------------------------------------------- parsers (text, the name to blame)


def parse_size(text: str, name: str, param: str | None = None) -> int:
    """Bytes of a size: 4G, 512M, 1.5G, 4GiB, 100000 (K/M/G/T are powers of 1024)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        problem = "is negative" if text.strip().startswith("-") else "is not a size"
        raise _refuse(name, text, f"{problem}; use e.g. 4G, 512M or a number of bytes", param)
    if len(m.group(1)) > 40:  # Python's int() refuses numbers of over 4300 digits
        raise _refuse(name, text, f"has too many digits (at most {MAX_SIZE} bytes)", param)
    from fractions import Fraction

    n = int(Fraction(m.group(1)) * _UNITS[(m.group(2) or "").upper()])  # exact: no float rounding
    if n > MAX_SIZE:
        raise _refuse(name, text, f"is too large (at most {MAX_SIZE} bytes)", param)
    return n


def parse_duration(text: str, name: str, param: str | None = None) -> float:
    """Seconds of a duration: "0", "30s", "5m", "1h", "1h30m", "250ms", or a plain number of
    seconds ("90", "1.5"); negative, infinite, NaN and unknown units are refused."""
    value = text.strip()
    hint = "; use e.g. 30s, 5m, 1h, 1h30m or a number of seconds"
    if _NUMBER.fullmatch(value):
        seconds = float(value)
    else:
        seconds, pos, last = 0.0, 0, -1
        for m in _DURATION_PART.finditer(value):
            order = list(_DURATION_UNITS).index(m.group(2).lower())
            if m.start() != pos or order <= last:
                break
            seconds += float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
            pos, last = m.end(), order
        if not value or pos != len(value):
            problem = "is negative" if value.startswith("-") else "is not a duration"
            raise _refuse(name, text, problem + (" (units h, m, s, ms, largest first)" if value[:1].isdigit()
                                                 else "") + hint, param)
    if not math.isfinite(seconds) or seconds > MAX_DURATION:
        raise _refuse(name, text, f"is too long (at most {MAX_DURATION:.0f} seconds, ten years)", param)
    return seconds


def parse_timeout(text: str, name: str, param: str | None = None) -> float:
    """A duration that must be longer than 0 (a time limit of 0 would expire at once)."""
    seconds = parse_duration(text, name, param)
    if seconds <= 0:
        raise _refuse(name, text, "must be longer than 0 (e.g. 120 or 5m)", param)
    return seconds


def parse_bool(text: str, name: str, param: str | None = None) -> bool:
    """1/0, true/false, yes/no, on/off (any case)."""
    value = text.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise _refuse(name, text, "is not a boolean; use 1 or 0 (true/false, yes/no and on/off work too)", param)


def parse_dir(text: str, name: str, param: str | None = None) -> Path:
    """A directory (~ expanded): refused if it holds a NUL or names something that is not a
    directory (it need not exist yet)."""
    if "\0" in text:
        raise _refuse(name, text, "holds a NUL character, which no path can", param)
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # ~name of no user, or no home directory
        raise _refuse(name, text, "starts with ~ but that home directory is unknown here; give the whole path",
                      param) from None
    try:
        other = path.exists() and not path.is_dir()
    except OSError:  # not searchable here: whoever uses the directory reports why
        other = False
    if other:
        where = "" if str(path) == text else f" ({path})"
        raise _refuse(name, text, f"is not a directory{where}; use a directory (it need not exist yet)", param)
    return path


def parse_dir_or_off(text: str, name: str, param: str | None = None) -> Path | Literal[False]:
    """A directory, or False for "off" (also none, 0, false, no)."""
    if text.strip().lower() in OFF:
        return False
    return parse_dir(text, name, param)


def parse_words(text: str, name: str, param: str | None = None) -> list[str]:
    """Arguments as a POSIX shell splits them (quotes group words)."""
    try:
        import shlex

        return shlex.split(text)
    except ValueError as exc:  # "No closing quotation", "No escaped character"
        raise _refuse(name, text, f"cannot be split into arguments ({exc}); quote as a shell does",
                      param) from None


def parse_count(text: str, name: str, param: str | None = None) -> int:
    """A whole number of at least 1 (1, 3, 10)."""
    value = text.strip()
    if not value.isascii() or not value.isdigit() or len(value) > 9 or int(value) < 1:
        raise _refuse(name, text, "is not a whole number of at least 1; use e.g. 1 or 3", param)
    return int(value)


def _text(text: str, name: str, param: str | None = None) -> str:
    return text


# ---------------------------------------------------------------- the variables


class Variable:
    """One environment variable: how its text is parsed, its default and its meaning; `flag`:
    the command-line option that reads it (click parses it there, as the flag's value)."""

    __slots__ = ("name", "parse", "default", "meaning", "flag")

    def __init__(self, name: str, parse: Callable[..., Any], default: Any, meaning: str,
                 flag: str | None = None) -> None:
        self.name, self.parse, self.default, self.meaning, self.flag = name, parse, default, meaning, flag

    def __repr__(self) -> str:
        return f"Variable({self.name!r}, default={self.default!r}, flag={self.flag!r})"


def _variables(*items: Variable) -> dict[str, Variable]:
    return {v.name: v for v in items}


VARIABLES: dict[str, Variable] = _variables(
    Variable("LOCALSPEC_CACHE_DIR", parse_dir, None, "directory of models, profiles and the prompt cache"),
    Variable("LOCALSPEC_PROFILE_DIR", parse_dir, None, "directory of cost profiles and CPU kernel checks"),
    Variable("LOCALSPEC_PROMPT_CACHE", parse_dir_or_off, None, "directory of the prompt cache, or off",
             "--prompt-cache"),
    Variable("LOCALSPEC_PROMPT_CACHE_LIMIT", parse_size, 4 << 30, "most bytes the prompt cache keeps on disk"),
    Variable("LOCALSPEC_PIP_ARGS", parse_words, [], "extra pip arguments for fetching registry models"),
    Variable("LOCALSPEC_RPC_TIMEOUT", parse_timeout, 120.0, "longest one remote decode may take"),
    Variable("LOCALSPEC_LLAMA_LOG", parse_bool, False, "llama.cpp's log lines at debug level"),
    Variable("LOCALSPEC_KEEP_ALIVE", parse_duration, 300.0,
             "how long a resident service keeps the models loaded after a call (0 = never)", "--keep-alive"),
    Variable("LOCALSPEC_MAX_LOADED", parse_count, 3, "most model pairs the resident service keeps loaded at once"),
    Variable("LOCALSPEC_NUM_PARALLEL", parse_count, None, "calls generating at once on one loaded pair (slots)",
             "--parallel"),
    Variable("LOCALSPEC_MODEL", _text, None, "target model (GGUF path or registry name)", "--model"),
    Variable("LOCALSPEC_DRAFT", _text, None, "draft model (GGUF path, registry name or none)", "--draft"),
    Variable("LOCALSPEC_CACHE_TYPE", _text, None, "KV cache type", "--cache-type"),
    Variable("LOCALSPEC_LOAD_MODE", _text, None, "how weights are loaded", "--load-mode"),
    Variable("LOCALSPEC_CPU_KERNELS", _text, None, "llama.cpp's CPU weight kernels", "--cpu-kernels"),
    Variable("LOCALSPEC_RPC", _text, None, "llama.cpp RPC servers for the target", "--rpc"),
    Variable("LOCALSPEC_API_KEY", _text, None, "the key `localspec serve` requires", "--api-key"),
    Variable("LOCALSPEC_CFLAGS", _text, None, "build: extra C compiler flags of the verifier"),
    Variable("LOCALSPEC_LDFLAGS", _text, None, "build: extra linker flags of the verifier"),
)


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of variable `name` (its default when unset or empty); ConfigError naming
    the variable when its text is bad. `environ`: instead of os.environ."""
    variable = VARIABLES[name]
    text = (os.environ if environ is None else environ).get(name)
    if text is None or not text.strip():
        return variable.default
    return variable.parse(text, name)


def check(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every variable localspec parses itself, parsed (ConfigError naming the first bad one); the
    command line checks them all before any command runs. Those a flag reads are checked by it."""
    return {name: get(name, environ) for name, v in VARIABLES.items() if v.parse is not _text}


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether variable `name` has a (non-empty) value."""
    if name not in VARIABLES:
        raise KeyError(name)
    return bool(((os.environ if environ is None else environ).get(name) or "").strip())


def unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """A line for each LOCALSPEC_* variable that localspec does not know (a typo is ignored
    otherwise), with the closest known name."""
    out = []
    for name in sorted(os.environ if environ is None else environ):
        if name.startswith("LOCALSPEC_") and name not in VARIABLES:
            import difflib

            close = difflib.get_close_matches(name, list(VARIABLES), n=1, cutoff=0.8)
            out.append(f"unknown environment variable {name}" + (f" (did you mean {close[0]}?)" if close else ""))
    return out


PROCESS_DEFAULTS = {"OPENBLAS_NUM_THREADS": "1"}  # what quiet_blas sets where the user did not


def quiet_blas() -> None:
    """numpy's OpenBLAS threads busy-wait on the cores llama.cpp and the verifier need, and
    localspec does no BLAS work: one thread, unless the user set it. Called by the processes
    localspec starts (the command line, the resident service, a kernel check) before numpy loads;
    a program using the Python API decides for itself."""
    for name, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(name, value)


def format_duration(seconds: float) -> str:
    """A duration as parse_duration reads it back: 0, 45s, 5m, 1h30m (fractions: 2.5s)."""
    if seconds <= 0:
        return "0"
    whole = int(seconds)
    if whole != seconds:
        return f"{seconds:g}s"
    h, m, s = whole // 3600, whole // 60 % 60, whole % 60
    return "".join(f"{n}{unit}" for n, unit in ((h, "h"), (m, "m"), (s, "s")) if n)
