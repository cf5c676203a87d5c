"""Structured output as asked: :class:`Constraint` (a JSON schema, any JSON object, a regex, a Lark
or GBNF grammar), made from every spelling — OpenAI's ``response_format``, llama-server's
``json_schema`` and ``grammar``, grammar files (:func:`grammar_from_file`) — and the keywords of
``GenerationConfig.from_options`` that ask for one (:data:`CONSTRAINT_KEYS`), the command line's
flags (:func:`constraint_from_flags`: --json-schema, --json-object, --regex, --grammar, each a
text or a file); the bound on how deep JSON a setting holds may nest (:func:`json_depth`). :mod:`localspec.decoding.grammar.compiler`
compiles a constraint (llguidance) and enforces it.

A leaf module (no numpy, no llama.cpp, no llguidance): :mod:`localspec.settings` imports it, and
``localspec --help`` stays fast.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from localspec.errors import ConfigError
from localspec.settings.validation import empty_value, require

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of llguidance's stub, not there at run time

Kind = Literal["json_schema", "json_object", "regex", "lark", "gbnf"]
KINDS: tuple[str, ...] = get_args(Kind)
DEFAULT_PARAMS: dict[str, str] = {  # the setting a constraint comes from, unless it says otherwise
    "json_schema": "json_schema", "json_object": "response_format", "regex": "regex",
    "lark": "grammar", "gbnf": "grammar",
}
JSON_LAYOUT: JsonCompileOptions = {  # llguidance's JSON options (overrides): see localspec.decoding.grammar.compiler
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
    ``param`` is the setting it came from, named by the errors it causes (not part of equality).
    ``allow_stop_strings`` says whether stop strings may be combined with it: no for a constraint
    the caller asked for (the grammar decides where the output ends, and text cut at a stop string
    would no longer match it); yes for tool calling's grammar (``ToolSet.constraint``), whose
    answer is text or calls, the stop strings applying to the text only (``localspec.decoding.text.StopScanner``).
    It says how the constraint is used, not what it matches: not part of equality either."""

    kind: Kind
    source: str = ""
    name: str | None = None
    param: str | None = field(default=None, compare=False)
    allow_stop_strings: bool = field(default=False, compare=False)

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
                    param: str = "json_schema") -> Constraint:
        """A JSON schema (a mapping, or its JSON text)."""
        schema = _schema_value(schema, param)
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:  # a set, an object, NaN: not JSON
            raise ConfigError(f"the JSON schema is not JSON: {exc}", param) from None
        return cls("json_schema", text, name, param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> Constraint:
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json_object", "", None, param)

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> Constraint:
        """The whole output matches a regular expression (Rust regex syntax, no look-around)."""
        return cls("regex", pattern, None, param)

    @classmethod
    def grammar(cls, text: str, *, lark: bool | None = None, param: str = "grammar",
                allow_stop_strings: bool = False) -> Constraint:
        """A grammar: GBNF (llama.cpp's, as llama-server's ``grammar``), or Lark (llguidance's
        syntax) when ``lark`` says so or, by default, when the text starts with ``%llguidance``.
        ``allow_stop_strings``: see the class."""
        if lark is None:
            lark = isinstance(text, str) and text.lstrip().startswith(LARK_MARKER)
        return cls("lark" if lark else "gbnf", text, None, param, allow_stop_strings)

    @classmethod
    def from_response_format(cls, value: Mapping[str, Any] | None,
                             param: str = "response_format") -> Constraint | None:
        """OpenAI's ``response_format``: ``{"type": "text"}`` (or None) → None, ``{"type":
        "json_object"}`` → any JSON object, ``{"type": "json_schema", "json_schema": {"name":
        ..., "schema": {...}, "strict": true}}`` → that schema (always enforced, whatever
        ``strict`` says; no ``schema`` → any JSON object). llama-server's ``{"type":
        "json_object", "schema": {...}}`` is read as that schema."""
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ConfigError(f"response_format must be an object, not {json_type(value)}", param)
        format_type = value.get("type")
        if format_type == "text":
            return None
        if format_type == "json_object":
            schema = value.get("schema")
            return cls.json_object(param) if schema is None else cls.json_schema(schema, None, param)
        if format_type == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, Mapping):
                raise ConfigError('response_format of type "json_schema" needs a "json_schema" object '
                                  '({"name": ..., "schema": {...}})', param)
            name = spec.get("name")
            if name is not None and not isinstance(name, str):
                raise ConfigError(f"response_format.json_schema.name must be a string, not {json_type(name)}", param)
            schema = spec.get("schema")
            return cls.json_object(param) if schema is None else cls.json_schema(schema, name, param)
        raise ConfigError(f"response_format.type {format_type!r} is not supported; use \"text\", \"json_object\" "
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
    from localspec.settings.files import (  # bounded while reading: /dev/zero ends at the limit
        SPEC_LIMIT,
        read_user_text,
    )

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


CONSTRAINT_KEYS: tuple[str, ...] = ("response_format", "json_schema", "regex", "grammar")


def constraint_from_options(options: dict[str, Any]) -> Constraint | None | bool:
    """The constraint the keywords ask for (popped from `options`): a Constraint, None (a
    keyword says "no constraint", e.g. response_format {"type": "text"}) or False (no constraint
    keyword given: the base's stays). More than one constraint is a ConfigError."""
    given = [k for k in ("constraint", *CONSTRAINT_KEYS) if options.get(k) is not None]
    require(len(given) <= 1, given[-1] if given else "",
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
    require(isinstance(value, str), name, f"{name} must be text, got {type(value).__name__}")
    return Constraint.regex(value) if name == "regex" else Constraint.grammar(value)


def constraint_to_options(c: Constraint | None) -> dict[str, Any]:
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


# ---------------------------------------------------------------- the command line's flags


CONSTRAINT_FLAGS: tuple[str, ...] = ("json_schema", "json_object", "regex", "grammar")  # parameter names
EMPTY_HINTS = {"json_schema": "a schema file or JSON text", "regex": "a pattern",
               "grammar": "a grammar file or text"}  # what each flag that takes text needs
GRAMMAR_TEXT = "a grammar (GBNF with '::=', or Lark starting with %llguidance)"
SCHEMA_TEXT = "a JSON schema (JSON text starting with '{')"


def constraint_from_flags(flags: Mapping[str, Any]) -> Constraint | None:
    """The constraint the command line's flags ask for (their values by parameter name; at most
    one given), built as the API's and the server's from the same keywords: --json-object is
    response_format {"type": "json_object"}; --json-schema and --grammar take the text the API
    takes, or a file that holds it. A ConfigError names the flag at fault (an empty value too:
    an unset shell variable is never "no constraint")."""
    given = [k for k in CONSTRAINT_FLAGS if flags.get(k) not in (None, False)]
    for flag in given:
        if flag in EMPTY_HINTS and not flags[flag].strip():
            raise ConfigError(empty_value(EMPTY_HINTS[flag]), flag)
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError("give one of --json-schema, --json-object, --regex and --grammar", given[1])
    constraint = constraint_from_options(_keywords(given[0], flags[given[0]]))
    assert isinstance(constraint, Constraint)
    return constraint


def _keywords(flag: str, value: Any) -> dict[str, Any]:
    """A constraint flag as GenerationConfig's keywords (those of the API and the server)."""
    if flag == "json_object":
        return {"response_format": {"type": "json_object"}}
    if flag == "json_schema":
        return {"json_schema": _schema_text(value)}
    if flag == "grammar" and not _is_grammar_text(value):
        return {"constraint": grammar_from_file(_existing_file(value, "grammar", GRAMMAR_TEXT), param="grammar")}
    return {flag: value}


def _is_grammar_text(value: str) -> bool:
    """--grammar's value is the grammar itself (not a file): GBNF's rules (::=), Lark's marker, or
    several lines."""
    return "::=" in value or "\n" in value or value.lstrip().startswith(LARK_MARKER)


def _existing_file(value: str, param: str, text: str) -> Path:
    """The file a flag that takes text or a file names; a ConfigError when there is none."""
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(f"{value!r} is neither {text} nor a file", param)
    return path


def _schema_text(value: str) -> str:
    """--json-schema's value: the schema as JSON text, or the file that holds it."""
    from localspec.settings.files import SPEC_LIMIT, read_user_text

    text = value.strip()
    if text.startswith("{") or text in ("true", "false"):
        return text
    path = _existing_file(value, "json_schema", SCHEMA_TEXT)
    return read_user_text(path, param="json_schema", limit=SPEC_LIMIT, what="the JSON schema file")
