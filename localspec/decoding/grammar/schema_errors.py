"""Where in a JSON schema llguidance's error is: llguidance names keywords and values, never
their place; :func:`schema_problem` adds a JSON pointer (``/properties/address/pattern``) found by
walking the schema (:func:`walk_schema`), and the regex parser's own explanation of a bad
pattern (:func:`regex_problem`). Used by :func:`localspec.decoding.grammar.compiler.compile_constraint`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import llguidance

from localspec.settings.constraints import JSON_LAYOUT


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text



def regex_problem(message: str) -> str:
    """llguidance wraps a regex into a one-line Lark grammar; its errors quote that wrapper:
    keep the regex parser's own explanation."""
    found = re.search(r"regex parse error:(.*?)(?:\n\s+\d+ \| |\Z)", message, re.S)
    if not found:
        return first_line(message)
    lines = [line for line in found.group(1).splitlines() if line.strip()]
    errors = [line.strip().removeprefix("error:").strip() for line in lines if line.strip().startswith("error:")]
    return "; ".join(errors) or first_line(message)


# ---------------------------------------------------------------- where in a schema

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_KEYWORD = re.compile(r"\b(min\w*|max\w*|exclusive\w*|multipleOf|required|enum|const|pattern|format|"
                      r"uniqueItems|contains|additionalProperties|items|prefixItems)\b")


def pointer_token(key: str) -> str:
    """One JSON pointer reference token (RFC 6901: ~ → ~0, / → ~1)."""
    return key.replace("~", "~0").replace("/", "~1")


def walk_schema(schema: Any, pointer: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every subschema (as an object) of a JSON schema with its JSON pointer, the root first;
    property *names* are never taken for keywords."""
    if not isinstance(schema, Mapping):
        return
    yield pointer, schema
    for key in _SCHEMA_MAPS:
        children = schema.get(key)
        if isinstance(children, Mapping):
            for name, child in children.items():
                yield from walk_schema(child, f"{pointer}/{key}/{pointer_token(str(name))}")
    for key in _SCHEMA_LISTS + _SCHEMA_ONE:
        child = schema.get(key)
        if isinstance(child, list):
            for i, item in enumerate(child):
                yield from walk_schema(item, f"{pointer}/{key}/{i}")
        else:
            yield from walk_schema(child, f"{pointer}/{key}")


def schema_problem(schema: Any, message: str, root: Any = None, at: str = "") -> str:
    """llguidance's message about a schema, with where in the schema the problem is when it can
    be found (llguidance names keywords and values, never their place). `schema` is the
    subschema at JSON pointer `at` of `root` (the whole schema, whose $defs it may use)."""
    root = schema if root is None else root
    text = first_line(message)
    if m := re.match(r"Unimplemented keys: (\[.*\])", text):
        try:
            keys = [str(k) for k in json.loads(m.group(1))]
        except json.JSONDecodeError:
            keys = []
        places = [_keyword_place(schema, key) for key in keys]
        found = [f'"{key}" at {at}{place}' for key, place in zip(keys, places, strict=True) if place is not None]
        missing = [f'"{key}"' for key, place in zip(keys, places, strict=True) if place is None]
        word, them = ("keyword", "it") if len(keys) == 1 else ("keywords", "them")
        return f"unsupported {word} {', '.join(found + missing)} (llguidance cannot enforce {them}; remove or rewrite {them})"
    if m := re.search(r"required property '(.*)' is unsatisfiable", text):
        deeper = _required_problem(schema, m.group(1), root, at)
        if deeper is not None:
            return deeper
    if "regex parse error" in message:
        text = f"invalid regex ({regex_problem(message)})"
    place = _problem_place(schema, text, message)
    return f"{text} at {at}{place}" if place is not None else text


def _required_problem(schema: Any, name: str, root: Any, at: str) -> str | None:
    """Why a required property cannot be satisfied, found by compiling its own schema (with the
    root's definitions, which it may refer to): llguidance says only *that* it cannot."""
    for p, sub in walk_schema(schema):
        props = sub.get("properties")
        if not (isinstance(sub.get("required"), list) and name in sub["required"] and isinstance(props, Mapping)
                and name in props):
            continue
        child, child_at = props[name], f"{at}{p}/properties/{pointer_token(name)}"
        if not isinstance(child, Mapping):
            return None
        alone = dict(child)
        for defs in ("$defs", "definitions"):
            if isinstance(root, Mapping) and defs in root and defs not in alone:
                alone[defs] = root[defs]
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(alone, overrides=JSON_LAYOUT)
        except ValueError:
            return None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if not is_error or not messages:
            return None
        return schema_problem(child, messages[0], root, child_at)
    return None


def _keyword_place(schema: Any, keyword: str) -> str | None:
    """The first place a keyword is used, outside $defs/definitions first (llguidance reports
    the keywords of schemas it compiles, i.e. those in use)."""
    places = [f"{p}/{pointer_token(keyword)}" for p, sub in walk_schema(schema) if keyword in sub]
    used = [p for p in places if not re.match(r"/(\$defs|definitions)/", p)]
    return (used or places)[0] if places else None


def _problem_place(schema: Any, text: str, message: str) -> str | None:
    """A JSON pointer for one of llguidance's messages about a schema, or None."""
    subs = list(walk_schema(schema))
    if m := re.match(r"Unknown format: (.*)", text):
        return next((f"{p}/format" for p, s in subs if s.get("format") == m.group(1).strip()), None)
    if m := re.match(r"Invalid type: (.*)", text):
        name = m.group(1).strip()
        return next((f"{p}/type" for p, s in subs
                     if s.get("type") == name or (isinstance(s.get("type"), list) and name in s["type"])), None)
    if m := re.match(r"Pointer '(.*)' does not exist", text):
        ref = "#" + m.group(1)
        return next((f"{p}/$ref" for p, s in subs if s.get("$ref") in (ref, m.group(1))), None)
    if text.startswith("invalid regex"):
        return _bad_pattern_place(subs)
    if m := re.search(r"required property '(.*)' is unsatisfiable", text):
        return next((f"{p}/required" for p, s in subs
                     if isinstance(s.get("required"), list) and m.group(1) in s["required"]), None)
    keywords = set(_KEYWORD.findall(text))
    values = dict(re.findall(r"\b(\w+) \(([^)]*)\)", text))
    if keywords:
        return next((p for p, s in subs if keywords <= s.keys()
                     and all(json.dumps(s[k]) == v or str(s[k]) == v for k, v in values.items() if k in s)), None)
    return None


def _bad_pattern_place(subs: list[tuple[str, Mapping[str, Any]]]) -> str | None:
    """The first ``pattern`` (or ``patternProperties`` key) that is not a valid regex."""
    def invalid(regex: Any) -> bool:
        if not isinstance(regex, str):
            return False
        grammar = llguidance.LLMatcher.grammar_from_regex(regex)
        return llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]

    for p, s in subs:
        if invalid(s.get("pattern")):
            return f"{p}/pattern"
        props = s.get("patternProperties")
        if isinstance(props, Mapping):
            for key in props:
                if invalid(key):
                    return f"{p}/patternProperties/{pointer_token(str(key))}"
    return None
