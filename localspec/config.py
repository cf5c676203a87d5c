"""Settings, one type per concept, each validated once when it is made, with the defaults.

A leaf module (no numpy, no llama.cpp), so ``localspec --help`` stays fast and every layer can
import it:

* :class:`SamplingParams`: temperature, top-k, top-p, min-p (:data:`DEFAULT_SAMPLING` is what
  users get; the field defaults are the neutral "off" values);
* :class:`Shape`: what to draft per step (a chain, K paths, a tree), parsed from every spelling
  by :meth:`Shape.parse`;
* :class:`Constraint`: what the output must match (a JSON schema, any JSON object, a regex, a Lark
  or GBNF grammar), as asked; :mod:`localspec.decoding.constraint` compiles and enforces it;
* :class:`GenerationConfig`: everything one generation needs besides the models and prompt;
* :class:`ModelOptions`: how to load a model and size its context.

Keyword names equal the CLI flags (``num_draft_tokens`` is ``--num-draft-tokens``).
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, get_args

from localspec.errors import ConfigError

VERIFIERS: tuple[str, ...] = ("greedy", "match", "token", "block", "gbv", "rrs", "rrsw", "traversal", "batch")
CHAIN_ONLY = ("token", "block")  # verify one chain
K_PATHS = ("gbv", "batch")  # verify K root-to-leaf chains
WITHOUT_REPLACEMENT = ("rrsw", "traversal")  # trees whose siblings are drawn without replacement
DRAFTERS: tuple[str, ...] = ("auto", "model", "ngram", "hybrid")
PLANS: tuple[str, ...] = ("auto", "fixed")
CACHE_TYPES: tuple[str, ...] = ("f16", "f32", "q8_0")
FLASH_ATTN: tuple[str, ...] = ("auto", "on", "off")
LOAD_MODES: tuple[str, ...] = ("read", "mmap", "auto")
CPU_KERNELS: tuple[str, ...] = ("auto", "llama", "repack", "plain")  # see localspec.llama.kernels

MAX_DRAFT_TOKENS = 64  # draft depth
MAX_PATHS = 16
MAX_BRANCHING = 16  # children per node at one depth
MAX_BRANCHES = 64  # root-to-leaf paths of one draft (KV sequences)
SEED_LIMIT = 2**64
INT32_MAX = 2**31 - 1  # what llama.cpp's int32 counts (tokens, threads, layers, top-k) hold
MIN_TEMPERATURE = 1e-4  # below, logits / temperature overflows float32: use 0 (greedy)
MAX_TEMPERATURE = 1e6
MIN_PROBABILITY = 2.0**-126  # smallest top_p and min_p > 0: the smallest normal float32 (C's FLT_MIN)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # every token is scanned for every stop string
MAX_THREADS = 1024


_ENDPOINT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-_]+):(\d{1,5})$")
RPC_PORT = 50052  # llama.cpp's rpc-server default


def parse_endpoints(value: str | Sequence[str] | None, param: str = "rpc") -> tuple[str, ...]:
    """RPC servers as "host:port[,host:port...]" (or a list of them); ConfigError names a bad one."""
    if value is None or value == "" or value == ():
        return ()
    _require(isinstance(value, (str, list, tuple)), param,
             f"{param} must be \"HOST:PORT[,HOST:PORT...]\" or a list of such strings, got {_show(value)}")
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in (str(i).strip() for i in items):
        m = _ENDPOINT.match(item) if len(item) <= 300 else None
        _require(m is not None and 1 <= int(m.group(2)) <= 65535, param,
                 f"{_show(item)} is not an RPC server address; use HOST:PORT, e.g. 192.168.1.20:{RPC_PORT} "
                 "(several: comma-separated)")
        out.append(item)
    return tuple(dict.fromkeys(out))


def _is_number(value: Any) -> bool:
    """A real number (int, float, numpy's scalars, Fraction; never a bool) that a float can hold:
    10**400 is no temperature."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or type(value).__name__ == "bool_":
        return False
    try:
        float(value)
    except (OverflowError, ValueError, TypeError):
        return False
    return True


def _is_int(value: Any) -> bool:
    """An integral number: an int (numpy's included) or a float with no fractional part."""
    if isinstance(value, numbers.Integral):
        return not isinstance(value, bool) and type(value).__name__ != "bool_"
    return _is_number(value) and float(value).is_integer()


def _as_int(value: Any) -> Any:
    """An integral setting as a Python int (3.0 and numpy.int64(3) are 3); other values as they
    are, for the range check to refuse."""
    return int(value) if _is_int(value) else value


def _as_float(value: Any) -> Any:
    return float(value) if _is_number(value) else value


def unknown_names(names: Any, known: Sequence[str], what: str) -> str:
    """The message for unknown keyword names, suggesting the closest known name of each."""
    parts = []
    for name in sorted(map(str, names)):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        parts.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return f"unknown {what}: {', '.join(parts)}; known: {', '.join(sorted(known))}"


def _show(value: Any) -> str:
    """A value as an error message shows it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ConfigError(message, param)


def _choice(value: Any, param: str, choices: Sequence[str]) -> None:
    _require(isinstance(value, str) and value in choices, param,
             f"{param} must be one of {', '.join(choices)}, got {_show(value)}")


# ---------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingParams:
    """The plain sampler's settings. The verifier transforms the target exactly as plain sampling
    does: top-k, then top-p, then min-p on the temperature-1 distribution, then temperature."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", _as_float(self.temperature))
        object.__setattr__(self, "top_k", _as_int(self.top_k))
        object.__setattr__(self, "top_p", _as_float(self.top_p))
        object.__setattr__(self, "min_p", _as_float(self.min_p))
        # the ranges of the C verifier, which holds these as float32 (native/verifier.h: ls_sampling)
        t, p = self.temperature, self.min_p
        _require(_is_number(t) and math.isfinite(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
                 "temperature", f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                                f"{MAX_TEMPERATURE:g}], got {_show(t)}")
        _require(_is_int(self.top_k) and 0 <= self.top_k <= INT32_MAX, "top_k",
                 f"top_k must be an integer in [0, {INT32_MAX}] (0: off), got {_show(self.top_k)}")
        _require(_is_number(self.top_p) and MIN_PROBABILITY <= self.top_p <= 1, "top_p",
                 f"top_p must lie in (0, 1] (1: off) and be at least 2**-126 (about 1.2e-38, the smallest normal "
                 f"float32: the sampler computes in float32), got {_show(self.top_p)}")
        _require(_is_number(p) and (p == 0 or MIN_PROBABILITY <= p <= 1), "min_p",
                 f"min_p must lie in [0, 1] (0: off) and be 0 or at least 2**-126 (about 1.2e-38, the smallest "
                 f"normal float32: the sampler computes in float32), got {_show(p)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


DEFAULT_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)  # llama.cpp's defaults


# ---------------------------------------------------------------- draft shapes

SHAPE_SYNTAX = ("kN (a chain of N draft tokens), pKkN (K paths of N tokens), "
                "AxBx.. or tAxBx.. (a tree: A children at depth 1, B at depth 2, ...)")
# ASCII digits only (\d takes other scripts' digits too)
_SHAPE_RE = re.compile(r"^(?:k([0-9]+)|p([0-9]+)k([0-9]+)|t?([0-9]+(?:[x,][0-9]+)*))$")
_MAX_SHAPE_CHARS = 1024


def _shape_int(digits: str, param: str) -> int:
    """A number of a shape's spelling; never a parse of a huge string (Python refuses an int of
    over 4300 digits), and no number past what the limits hold."""
    _require(len(digits) <= 9, param, f"{digits:.20}{'...' if len(digits) > 20 else ''} is too large for {param}")
    return int(digits)


@dataclass(frozen=True)
class Shape:
    """chain: paths 1, no branching; K paths: paths K; tree: a branching factor per depth."""

    depth: int
    paths: int = 1
    branching: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "depth", _as_int(self.depth))
        object.__setattr__(self, "paths", _as_int(self.paths))
        if self.branching is not None:
            b = tuple(_as_int(x) for x in self.branching)
            _require(all(_is_int(x) and 1 <= x <= MAX_BRANCHING for x in b) and bool(b), "tree",
                     f"tree branching factors must be integers in [1, {MAX_BRANCHING}], got {_show(list(b))}")
            _require(len(b) <= MAX_DRAFT_TOKENS, "tree",
                     f"a draft tree has at most {MAX_DRAFT_TOKENS} levels, got {len(b)}")
            _require(self.paths == 1, "tree", "use either paths or tree, not both")
            object.__setattr__(self, "branching", b)
            object.__setattr__(self, "depth", len(b))
        _require(_is_int(self.depth) and 0 <= self.depth <= MAX_DRAFT_TOKENS, "num_draft_tokens",
                 f"num_draft_tokens must be an integer in [0, {MAX_DRAFT_TOKENS}], got {_show(self.depth)}")
        _require(_is_int(self.paths) and 1 <= self.paths <= MAX_PATHS, "paths",
                 f"paths must be an integer in [1, {MAX_PATHS}], got {_show(self.paths)}")
        _require(self.n_leaves <= MAX_BRANCHES, "tree",
                 f"the draft {self.describe()} has {self.n_leaves} branches; at most {MAX_BRANCHES} fit")

    @classmethod
    def chain(cls, gamma: int) -> "Shape":
        return cls(depth=gamma)

    @classmethod
    def k_paths(cls, k: int, gamma: int) -> "Shape":
        return cls(depth=gamma, paths=k)

    @classmethod
    def tree(cls, branching: Sequence[int]) -> "Shape":
        return cls(depth=len(branching), branching=tuple(branching))

    @classmethod
    def parse(cls, value: str | Sequence[int]) -> "Shape":
        """Every spelling: "k4" (chain), "p3k4" (3 paths of 4), "t3x2x1", "3x2x1", "3,2,1" or
        [3, 2, 1] (a tree)."""
        if isinstance(value, (bytes, bytearray)):
            value = value.decode("ascii", "replace")
        if not isinstance(value, str):
            items = list(value) if isinstance(value, (list, tuple)) else None
            _require(bool(items) and all(_is_int(b) for b in items), "tree",  # type: ignore[union-attr]
                     f"a draft tree is a list of branching factors such as [3, 2, 1], got {_show(value)}")
            assert items is not None
            _require(len(items) <= MAX_DRAFT_TOKENS, "tree",
                     f"a draft tree has at most {MAX_DRAFT_TOKENS} levels, got {len(items)}")
            return cls.tree(tuple(int(b) for b in items))
        m = _SHAPE_RE.match(value.strip().lower()) if len(value) <= _MAX_SHAPE_CHARS else None
        _require(m is not None, "tree", f"{_show(value)} is not a draft shape; use {SHAPE_SYNTAX}")
        assert m is not None
        if m.group(1) is not None:
            return cls.chain(_shape_int(m.group(1), "num_draft_tokens"))
        if m.group(2) is not None:
            return cls.k_paths(_shape_int(m.group(2), "paths"), _shape_int(m.group(3), "num_draft_tokens"))
        levels = re.split(r"[x,]", m.group(4))
        _require(len(levels) <= MAX_DRAFT_TOKENS, "tree",
                 f"a draft tree has at most {MAX_DRAFT_TOKENS} levels, got {len(levels)}")
        return cls.tree(tuple(_shape_int(b, "tree") for b in levels))

    @property
    def n_nodes(self) -> int:
        if self.branching is None:
            return self.paths * self.depth
        total, width = 0, 1
        for b in self.branching:
            width *= b
            total += width
        return total

    @property
    def n_leaves(self) -> int:
        return math.prod(self.branching) if self.branching is not None else self.paths

    @property
    def is_chain(self) -> bool:
        return self.paths == 1 and (self.branching is None or all(b == 1 for b in self.branching))

    @property
    def num_draft_tokens(self) -> int:
        return self.depth

    def truncated(self, depth: int) -> "Shape":
        """The same shape cut to at most `depth` levels (near the end of the context/budget)."""
        depth = max(0, min(depth, self.depth))
        if self.branching is not None:
            return Shape(0) if depth == 0 else Shape.tree(self.branching[:depth])
        return Shape(depth=depth, paths=self.paths)

    @property
    def label(self) -> str:
        """The compact spelling Shape.parse reads back: k4, p3k4, t3x2x1."""
        if self.branching is not None:
            return "t" + "x".join(map(str, self.branching))
        return f"p{self.paths}k{self.depth}" if self.paths > 1 else f"k{self.depth}"

    def describe(self) -> str:
        if self.branching is not None:
            return "tree " + "x".join(str(b) for b in self.branching)
        return f"{self.paths}x{self.depth} paths" if self.paths > 1 else f"chain {self.depth}"


# ---------------------------------------------------------------- structured output (what is asked; compiled by
# localspec.decoding.constraint, which needs llguidance)

Kind = Literal["json_schema", "json_object", "regex", "lark", "gbnf"]
KINDS: tuple[str, ...] = get_args(Kind)
DEFAULT_PARAMS: dict[str, str] = {  # the setting a constraint comes from, unless it says otherwise
    "json_schema": "json_schema", "json_object": "response_format", "regex": "regex",
    "lark": "grammar", "gbnf": "grammar",
}
JSON_LAYOUT: dict[str, Any] = {  # llguidance's JSON options (overrides): see the module docstring
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False,
}
ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
LARK_MARKER = "%llguidance"
LARK_SUFFIXES = (".lark",)
MAX_GRAMMAR_CHARS = 1 << 20  # a grammar file or schema larger than this is refused, not compiled
# JSON a setting holds (a schema, a tool) nests at most this deep ([] and {} are one level): the
# JSON that llguidance reads nests at most 128 levels, and a tool's schema is nested in a call's
MAX_JSON_DEPTH = 64


@dataclass(frozen=True)
class Constraint:
    """What a generation's output must match. ``source`` is the schema as JSON text
    (``json_schema``), the regex, or the grammar text; empty for ``json_object`` (any JSON
    object). ``name`` is the schema's name (response_format's ``json_schema.name``), if any.
    ``param`` is the setting it came from, named by the errors it causes (not part of equality)."""

    kind: Kind
    source: str = ""
    name: str | None = None
    param: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(KINDS)}",
                              param=self.param)
        if self.param is None:
            object.__setattr__(self, "param", DEFAULT_PARAMS[self.kind])
        if not isinstance(self.source, str):
            raise ConfigError(f"{self.describe()}: expected text, got {type(self.source).__name__}", self.param)
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ConfigError(f"{self.describe()} has {len(self.source)} characters; at most "
                              f"{MAX_GRAMMAR_CHARS} are accepted", self.param)
        if self.kind != "json_object" and not self.source.strip():
            raise ConfigError(f"{self.describe()} is empty", self.param)
        if self.kind == "json_schema":
            _schema_value(self.source, self.param)  # JSON, an object or a boolean, not too deep

    # ------------------------------------------------------------ constructors

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str, name: str | None = None,
                    param: str = "json_schema") -> "Constraint":
        """A JSON schema (a mapping, or its JSON text)."""
        schema = _schema_value(schema, param)
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:  # a set, an object, NaN: not JSON
            raise ConfigError(f"the JSON schema is not JSON: {exc}", param) from None
        return cls("json_schema", text, name, param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> "Constraint":
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json_object", "", None, param)

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> "Constraint":
        """The whole output matches a regular expression (Rust regex syntax, no look-around)."""
        return cls("regex", pattern, None, param)

    @classmethod
    def grammar(cls, text: str, *, lark: bool | None = None, param: str = "grammar") -> "Constraint":
        """A grammar: GBNF (llama.cpp's, as llama-server's ``grammar``), or Lark (llguidance's
        syntax) when ``lark`` says so or, by default, when the text starts with ``%llguidance``."""
        if lark is None:
            lark = isinstance(text, str) and text.lstrip().startswith(LARK_MARKER)
        return cls("lark" if lark else "gbnf", text, None, param)

    @classmethod
    def from_response_format(cls, value: Mapping[str, Any] | None,
                             param: str = "response_format") -> "Constraint | None":
        """OpenAI's ``response_format``: ``{"type": "text"}`` (or None) → None, ``{"type":
        "json_object"}`` → any JSON object, ``{"type": "json_schema", "json_schema": {"name":
        ..., "schema": {...}, "strict": true}}`` → that schema (always enforced, whatever
        ``strict`` says; no ``schema`` → any JSON object). llama-server's ``{"type":
        "json_object", "schema": {...}}`` is read as that schema."""
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ConfigError(f"response_format must be an object, not {json_type(value)}", param)
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema = value.get("schema")
            return cls.json_object(param) if schema is None else cls.json_schema(schema, None, param)
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, Mapping):
                raise ConfigError('response_format of type "json_schema" needs a "json_schema" object '
                                  '({"name": ..., "schema": {...}})', param)
            name = spec.get("name")
            if name is not None and not isinstance(name, str):
                raise ConfigError(f"response_format.json_schema.name must be a string, not {json_type(name)}", param)
            schema = spec.get("schema")
            return cls.json_object(param) if schema is None else cls.json_schema(schema, name, param)
        raise ConfigError(f"response_format.type {kind!r} is not supported; use \"text\", \"json_object\" "
                          "or \"json_schema\"", param)

    # ------------------------------------------------------------ views

    def schema(self) -> Any:
        """The JSON schema this constraint enforces (json kinds), None otherwise."""
        if self.kind == "json_object":
            return dict(ANY_OBJECT_SCHEMA)
        return json.loads(self.source) if self.kind == "json_schema" else None

    def describe(self) -> str:
        """How errors name it: "the JSON schema 'person'", "the regex", ..."""
        what = {"json_schema": "the JSON schema", "json_object": "the JSON object format", "regex": "the regex",
                "lark": "the Lark grammar", "gbnf": "the GBNF grammar"}[self.kind]
        return f"{what} {self.name!r}" if self.name else what


def grammar_from_file(path: str | os.PathLike, param: str = "grammar") -> Constraint:
    """A grammar file: Lark when it ends in ``.lark`` or its text starts with ``%llguidance``,
    GBNF otherwise (llama.cpp's ``.gbnf`` files)."""
    from localspec.files import SPEC_LIMIT, read_user_text  # bounded while reading: /dev/zero ends at the limit

    file = Path(path).expanduser()
    text = read_user_text(file, param=param, limit=SPEC_LIMIT, what="the grammar file")
    lark = file.suffix.lower() in LARK_SUFFIXES or text.lstrip().startswith(LARK_MARKER)
    return Constraint.grammar(text, lark=lark, param=param)


def json_depth(value: Any) -> int:
    """How deep a JSON value (as Python's json module gives it) nests: a scalar is 0, [] or {} is 1;
    counted up to MAX_JSON_DEPTH + 1 (too deep, whatever lies below), iteratively: never a
    RecursionError, and a Python value that contains itself ends too."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, (list, tuple)) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # deeper is too deep whatever lies below: stop there
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_json_depth(value: Any, what: str, param: str | None) -> None:
    """ConfigError naming `param` when `value` nests deeper than MAX_JSON_DEPTH levels."""
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ConfigError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels of JSON arrays and objects (the most "
                          "localspec accepts)", param)


def _schema_value(schema: Any, param: str | None) -> Any:
    """A JSON schema (a mapping, a boolean, or JSON text of one) as a value, checked: valid JSON, an
    object or a boolean, at most MAX_JSON_DEPTH levels deep."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"the JSON schema is not valid JSON: {exc}", param) from None
        except RecursionError:  # deeper than Python's recursion limit
            raise ConfigError(f"the JSON schema nests deeper than {MAX_JSON_DEPTH} levels of JSON arrays and "
                              "objects (the most localspec accepts)", param) from None
    if not isinstance(schema, (Mapping, bool)):
        raise ConfigError(f"a JSON schema is an object (or true/false), not {json_type(schema)}", param)
    check_json_depth(schema, "the JSON schema", param)
    return schema


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)


# ---------------------------------------------------------------- one generation


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """Stop strings as a tuple: none (None), one string, or a list/tuple of strings; each valid
    Unicode text (a lone surrogate could never match) and bounded in number and length (every
    token is scanned for every stop string)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    _require(isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop), "stop",
             f"stop must be a string or a list of strings, got {_show(stop)}")
    _require(len(stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in stop), "stop",
             f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each")
    for s in stop:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"stop string {_show(s)} is not valid Unicode text: a lone surrogate "
                              f"U+{ord(s[exc.start]):04X} at character {exc.start}", "stop") from None
    return tuple(stop)


_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")
_SHAPE_KEYS = ("num_draft_tokens", "paths", "tree")


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how to draft and verify it (models and prompt aside)."""

    max_tokens: int = 256
    sampling: SamplingParams = DEFAULT_SAMPLING
    seed: int | None = None  # None: a random seed
    verifier: str = "block"
    shape: Shape = Shape(32)  # the most a drafter may draft per step; plan auto chooses how many
    drafter: str = "auto"
    plan: str = "auto"  # auto: choose each step's depth (or none) from measured costs; fixed
    lenience: float = 0.0  # > 0: the LOSSY over-acceptance of Yin et al. (verifier token only)
    stop: tuple[str, ...] = field(default=())
    constraint: Constraint | None = None  # structured output: what the text must match (None: free text)

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_tokens", _as_int(self.max_tokens))
        object.__setattr__(self, "seed", _as_int(self.seed))
        object.__setattr__(self, "lenience", _as_float(self.lenience))
        _require(_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT32_MAX, "max_tokens",
                 f"max_tokens must be an integer in [1, {INT32_MAX}], got {_show(self.max_tokens)}")
        _require(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT), "seed",
                 f"seed must be an integer in [0, 2**64) (or none for a random seed), got {_show(self.seed)}")
        _require(isinstance(self.sampling, SamplingParams), "sampling",
                 f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        _require(isinstance(self.shape, Shape), "shape", f"shape must be a Shape, got {type(self.shape).__name__}")
        _choice(self.verifier, "verifier", VERIFIERS)
        _choice(self.drafter, "drafter", DRAFTERS)
        _choice(self.plan, "plan", PLANS)
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        _require(_is_number(self.lenience) and math.isfinite(self.lenience) and self.lenience >= 0, "lenience",
                 f"lenience must be a finite number >= 0, got {_show(self.lenience)}")
        _require(self.lenience == 0 or self.verifier == "token", "lenience",
                 "lenience (lossy over-acceptance) needs verifier 'token'")
        _require(self.constraint is None or isinstance(self.constraint, Constraint), "constraint",
                 f"constraint must be a localspec.config.Constraint (or None), got {type(self.constraint).__name__}")
        # tool calling's grammar is text or calls, and stop strings apply to the text only (api.StopScanner)
        _require(not (self.constraint is not None and self.constraint.param != "tools" and self.stop), "stop",
                 "stop strings cannot be combined with a constraint: the grammar decides where the output "
                 "ends, and text cut at a stop string would no longer match it")
        self._check_shape()

    def _check_shape(self) -> None:
        s, v = self.shape, self.verifier
        branched = not s.is_chain
        _require(not (branched and v in CHAIN_ONLY), "verifier",
                 f"verifier {v!r} verifies one chain; use gbv/batch with paths, rrs/rrsw/traversal with a tree")
        _require(not (s.branching is not None and v in K_PATHS), "tree",
                 f"verifier {v!r} takes K paths (paths), not a tree")
        _require(not (s.paths > 1 and v in WITHOUT_REPLACEMENT), "paths",
                 f"verifier {v!r} needs a tree drawn without replacement (tree), not independent paths")
        _require(not (self.drafter == "ngram" and branched), "drafter",
                 "the n-gram drafter proposes a single chain; use drafter model or hybrid for paths and trees")

    @classmethod
    def from_options(cls, base: "GenerationConfig | None" = None, **options: Any) -> "GenerationConfig":
        """A config from flat keyword names (those of the CLI flags and the request fields):
        max_tokens, temperature, top_k, top_p, min_p, seed, verifier, num_draft_tokens, paths,
        tree, drafter, plan, lenience, stop, and at most one constraint: response_format (OpenAI's),
        json_schema (a schema, llama-server's), regex, grammar (GBNF or Lark text) or constraint
        (a Constraint). What is left out (or None, for the sampling and
        shape keys) comes from `base` (default: the project's defaults)."""
        base = DEFAULTS if base is None else base
        _require(isinstance(base, GenerationConfig), "config",
                 f"config must be a GenerationConfig (or None), got {type(base).__name__}; pass settings as "
                 "keywords instead, e.g. max_tokens=64")
        own = {f.name for f in fields(cls)} - {"sampling", "shape"}
        unknown = set(options) - own - set(_SAMPLING_KEYS) - set(_SHAPE_KEYS) - set(CONSTRAINT_KEYS)
        _require(not unknown, sorted(unknown)[0] if unknown else "",
                 unknown_names(unknown, SETTING_KEYS, "setting(s)")
                 + ("; ctx_size, threads and the other model options belong to load_model"
                    if unknown & {f.name for f in fields(ModelOptions)} else ""))
        constraint = _constraint_from_options(options)
        if constraint is not False:
            options["constraint"] = constraint
        sampling = {k: options.pop(k) for k in _SAMPLING_KEYS if options.get(k) is not None}
        shape = {k: options.pop(k) for k in _SHAPE_KEYS if k in options}
        changes = dict(options)
        if sampling:
            changes["sampling"] = replace(base.sampling, **sampling)
        if any(v is not None for v in shape.values()):
            changes["shape"] = _shape_from_options(base.shape, **shape)
        return replace(base, **changes)

    def options(self) -> dict[str, Any]:
        """The flat keyword names and values (inverse of from_options)."""
        s = self.shape
        return {"max_tokens": self.max_tokens, "temperature": self.sampling.temperature,
                "top_k": self.sampling.top_k, "top_p": self.sampling.top_p, "min_p": self.sampling.min_p,
                "seed": self.seed, "verifier": self.verifier, "num_draft_tokens": s.depth, "paths": s.paths,
                "tree": list(s.branching) if s.branching else None, "drafter": self.drafter,
                "plan": self.plan, "lenience": self.lenience, "stop": list(self.stop),
                **constraint_options(self.constraint)}

    @property
    def speculative(self) -> bool:
        return self.shape.depth > 0

    def is_target_alone(self, has_draft_model: bool) -> bool:
        """The one rule for "the target alone": nothing is ever drafted. That is num_draft_tokens
        0, or the model drafter without a draft model. `-d none` alone only means no draft
        *model*: the n-gram drafter (auto, ngram) still drafts from the context."""
        return not self.speculative or (self.drafter == "model" and not has_draft_model)

    def target_alone(self) -> "GenerationConfig":
        """The same generation decoded by the target alone (no draft tokens)."""
        return replace(self, shape=Shape(0))

    def fitted(self, n_batch: int, n_seq_max: int) -> "GenerationConfig":
        """The config within a loaded target's limits: one batch holds the root and every node,
        one KV sequence per branch. Chains and paths are cut to the depth that fits (the depth is
        a maximum); a tree that does not fit is an error."""
        s = self.shape
        _require(s.n_leaves <= n_seq_max, "tree",
                 f"the draft {s.describe()} has {s.n_leaves} branches but the target context holds {n_seq_max} "
                 f"sequences; use a tree of at most {n_seq_max} branches (or load the target with n_seq_max "
                 f">= {s.n_leaves})")
        if s.n_nodes + 1 <= n_batch:
            return self
        _require(s.branching is None and n_batch - 1 >= s.paths, "num_draft_tokens",
                 f"the draft {s.describe()} has {s.n_nodes} nodes; at most n_batch - 1 = {n_batch - 1} fit")
        return replace(self, shape=s.truncated((n_batch - 1) // s.paths))


CONSTRAINT_KEYS: tuple[str, ...] = ("response_format", "json_schema", "regex", "grammar")


def _constraint_from_options(options: dict[str, Any]) -> "Constraint | None | bool":
    """The constraint the keywords ask for (popped from `options`): a Constraint, None (a
    keyword says "no constraint", e.g. response_format {"type": "text"}) or False (no constraint
    keyword given: the base's stays). More than one constraint is a ConfigError."""
    given = [k for k in ("constraint", *CONSTRAINT_KEYS) if options.get(k) is not None]
    _require(len(given) <= 1, given[-1] if given else "",
             f"give one constraint, not {' and '.join(given)}")
    present = [k for k in ("constraint", *CONSTRAINT_KEYS) if k in options]
    values = {k: options.pop(k) for k in present}
    if not given:
        return None if present else False
    name, value = given[0], values[given[0]]
    if name == "constraint":
        return value
    if name == "response_format":
        return Constraint.from_response_format(value)
    if name == "json_schema":
        return Constraint.json_schema(value)
    _require(isinstance(value, str), name, f"{name} must be text, got {type(value).__name__}")
    return Constraint.regex(value) if name == "regex" else Constraint.grammar(value)


def constraint_options(c: Constraint | None) -> dict[str, Any]:
    """A constraint as the keywords of from_options (JSON values; all None without one)."""
    out: dict[str, Any] = {k: None for k in ("response_format", "regex", "grammar")}
    if c is None:
        return out
    if c.kind == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif c.kind == "json_schema":
        spec = {"schema": json.loads(c.source), **({"name": c.name} if c.name else {})}
        out["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif c.kind == "regex":
        out["regex"] = c.source
    else:  # a Lark grammar is marked as one, so that Constraint.grammar reads it back as Lark
        lark = c.kind == "lark" and not c.source.lstrip().startswith(LARK_MARKER)
        out["grammar"] = (LARK_MARKER + " {}\n" if lark else "") + c.source
    return out


def _shape_from_options(base: Shape, num_draft_tokens: int | None = None, paths: int | None = None,
                        tree: Any = None) -> Shape:
    _require(not (isinstance(tree, (str, list, tuple)) and not (tree.strip() if isinstance(tree, str) else tree)),
             "tree", "tree is empty; leave it out for a chain, or give branching factors such as 3x2x1")
    if tree is not None:
        _require(paths in (None, 1), "paths", "use either paths or tree, not both")
        shape = Shape.parse(tree)
        _require(shape.branching is not None, "tree", f"tree {_show(tree)} is not a tree; use e.g. 3x2x1")
        return shape
    depth = base.depth if num_draft_tokens is None else num_draft_tokens
    return Shape(depth=depth, paths=(base.paths if base.branching is None else 1) if paths is None else paths)


DEFAULTS = GenerationConfig()
SETTING_KEYS: tuple[str, ...] = tuple(DEFAULTS.options())  # every setting's keyword (CLI flags, request fields)


# ---------------------------------------------------------------- loading a model


@dataclass(frozen=True)
class ModelOptions:
    """How to load a model and size its context (keyword names of ``localspec.load_model``)."""

    ctx_size: int = 4096  # context length in tokens (KV cells, shared by all sequences)
    batch_size: int = 512  # most tokens one decode may take
    threads: int | None = None  # CPU threads (default: all cores)
    n_gpu_layers: int = 0  # layers offloaded to the GPU (-1: all)
    flash_attn: str = "auto"
    cache_type: str = "f16"  # KV cache type
    n_seq_max: int = 16  # sequences (tree branches) in flight
    load_mode: str = "read"  # read: copy the weights into memory (no mapped duplicate); mmap; auto
    rpc: tuple[str, ...] = ()  # RPC servers ("host:port") that take the model's layers
    cpu_kernels: str = "auto"  # which llama.cpp weight buffer types (AMX, CPU_REPACK) to use: see localspec.llama.kernels

    def __post_init__(self) -> None:
        for name in ("ctx_size", "batch_size", "threads", "n_gpu_layers", "n_seq_max"):
            object.__setattr__(self, name, _as_int(getattr(self, name)))
        object.__setattr__(self, "rpc", parse_endpoints(self.rpc))
        _require(_is_int(self.ctx_size) and self.ctx_size >= 16, "ctx_size",
                 f"ctx_size must be at least 16 tokens, got {_show(self.ctx_size)}")
        _require(self.ctx_size <= INT32_MAX, "ctx_size", f"ctx_size must be at most {INT32_MAX}, got {_show(self.ctx_size)}")
        _require(_is_int(self.batch_size) and self.batch_size >= 1, "batch_size",
                 f"batch_size must be a positive integer, got {_show(self.batch_size)}")
        _require(self.batch_size <= INT32_MAX, "batch_size", f"batch_size must be at most {INT32_MAX}")
        _require(self.threads is None or (_is_int(self.threads) and 1 <= self.threads <= MAX_THREADS), "threads",
                 f"threads must be an integer in [1, {MAX_THREADS}], got {_show(self.threads)}")
        _require(_is_int(self.n_gpu_layers) and -1 <= self.n_gpu_layers <= INT32_MAX, "n_gpu_layers",
                 f"n_gpu_layers must be an integer in [-1, {INT32_MAX}] (-1: all), got {_show(self.n_gpu_layers)}")
        _choice(self.flash_attn, "flash_attn", FLASH_ATTN)
        _choice(self.cache_type, "cache_type", CACHE_TYPES)
        _choice(self.load_mode, "load_mode", LOAD_MODES)
        _choice(self.cpu_kernels, "cpu_kernels", CPU_KERNELS)
        _require(not (self.cache_type == "q8_0" and self.flash_attn == "off"), "cache_type",
                 "cache_type q8_0 (a quantized KV cache) needs flash attention: use flash_attn 'auto' or 'on', "
                 "or cache_type f16")
        _require(_is_int(self.n_seq_max) and 1 <= self.n_seq_max <= 256, "n_seq_max",
                 f"n_seq_max must lie in [1, 256], got {_show(self.n_seq_max)}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "ModelOptions":
        """Options from keywords; unknown names are a ConfigError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        _require(not unknown, unknown[0] if unknown else "", unknown_names(unknown, sorted(known), "model option(s)"))
        return cls(**{k: v for k, v in options.items() if v is not None or k == "threads"})


MODEL_DEFAULTS = ModelOptions()
