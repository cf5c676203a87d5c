"""Tool calling: OpenAI's ``tools`` and ``tool_choice``, and the grammar of the model's own
tool-call syntax (the calls parsed back out of what it generates: ``localspec.tool_calls``).

The syntax is the one Qwen 2.5 and Hermes-style models are trained on, where ``<tool_call>`` and
``</tool_call>`` are single (user-defined) tokens of the vocabulary::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Parallel calls follow each other, separated by a newline; text before the first call is the
answer's content. :class:`ToolSet` turns a request's tools into a grammar
(:meth:`ToolSet.constraint`): with ``required`` or a named function the whole answer is calls
(the name one of the tools', the arguments valid for that function's JSON schema); with ``auto``
the answer is text or text followed by calls, and once a call opens the rest of it is
constrained; with ``none`` it is text and the call token is forbidden. The grammar names the
call tokens as tokens, so a model writing the *text* "<tool_call>" never opens a call.

With ``auto`` a call may also be written as plain JSON, the whole answer being
``{"name": ..., "arguments": {...}}`` (bare or in a Markdown code block): small models trained on
the syntax above often call that way (:class:`JsonCalls`; llama.cpp's server reads these too).
``localspec.tool_calls`` reads the generated tokens back into content and calls.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from localspec.errors import ConfigError
from localspec.settings.constraints import JSON_LAYOUT, Constraint, check_json_depth

NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
Mode = Literal["none", "auto", "required", "function"]
CHOICES: tuple[Mode, ...] = ("none", "auto", "required")  # the modes tool_choice names as a string
MAX_TOOLS = 128  # OpenAI's limit on the number of functions in one request
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name, description and JSON schema of arguments
    (``spec`` is the tool as the client sent it, which the chat template renders)."""

    name: str
    parameters: Mapping[str, Any]  # the arguments' JSON schema (always of an object)
    spec: Mapping[str, Any]

    @classmethod
    def parse(cls, value: Any, where: str) -> Tool:
        """A tool in OpenAI's shape ({"type": "function", "function": {"name", "description",
        "parameters", "strict"}}); ConfigError naming the field otherwise."""
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be an object ({{\"type\": \"function\", \"function\": {{...}}}}), "
                              f"not {_json_type(value)}", where)
        check_json_depth(value, where, where)
        if value.get("type") != "function":
            raise ConfigError(f"{where}.type must be \"function\" (the only kind of tool localspec calls), got "
                              f"{value.get('type')!r}", f"{where}.type")
        function = value.get("function")
        if not isinstance(function, Mapping):
            raise ConfigError(f"{where}.function must be an object with a \"name\", not {_json_type(function)}",
                              f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ConfigError(f"{where}.function.name must be 1 to 64 letters, digits, _ or - (OpenAI's rule), got "
                              f"{name!r:.80}", f"{where}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ConfigError(f"{where}.function.description must be a string", f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        if not isinstance(parameters, Mapping):
            raise ConfigError(f"{where}.function.parameters must be a JSON schema object, not "
                              f"{_json_type(parameters)}", f"{where}.function.parameters")
        if "type" not in parameters:  # {} or {"properties": ...}: arguments are always an object (OpenAI's contract)
            parameters = {"type": "object", **parameters}
        elif parameters["type"] != "object":
            raise ConfigError(f"{where}.function.parameters must describe an object (\"type\": \"object\"): "
                              f"a call's arguments are a JSON object, not {parameters['type']!r:.40}",
                              f"{where}.function.parameters")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ConfigError(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ConfigError(f"{where}.function has unknown field {unknown[0]!r} (known: name, description, "
                              "parameters, strict)", f"{where}.function.{unknown[0]}")
        return cls(name, parameters, value)


@dataclass(frozen=True)
class ToolSet:
    """The tools of one request and how the model may use them: ``mode`` none, auto, required,
    or function (``function`` names the one to call); ``parallel``: several calls in one answer."""

    tools: tuple[Tool, ...]
    mode: Mode = "auto"
    function: str | None = None
    parallel: bool = True

    @classmethod
    def parse(cls, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolSet | None:
        """OpenAI's tools, tool_choice and parallel_tool_calls, checked (ConfigError naming the
        field); None when there are no tools (and no tool_choice asks for one)."""
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ConfigError("parallel_tool_calls must be true or false", "parallel_tool_calls")
        if tools is None or (isinstance(tools, (list, tuple)) and not tools):
            if tool_choice not in (None, "none", "auto"):
                raise ConfigError("tool_choice asks for a tool call but no tools are given; send 'tools'",
                                  "tool_choice")
            return None
        if not isinstance(tools, (list, tuple)):
            raise ConfigError(f"tools must be an array of tools, not {_json_type(tools)}", "tools")
        if len(tools) > MAX_TOOLS:
            raise ConfigError(f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are accepted", "tools")
        parsed = tuple(Tool.parse(t, f"tools[{i}]") for i, t in enumerate(tools))
        seen: dict[str, int] = {}
        for i, tool in enumerate(parsed):
            if tool.name in seen:
                raise ConfigError(f"tools[{i}].function.name {tool.name!r} is also the name of tools[{seen[tool.name]}];"
                                  " function names must differ", f"tools[{i}].function.name")
            seen[tool.name] = i
        mode, function = cls._choice(tool_choice, seen)
        toolset = cls(parsed, mode, function, True if parallel_tool_calls is None else parallel_tool_calls)
        toolset.check_schemas()
        return toolset

    @staticmethod
    def _choice(value: Any, names: Mapping[str, int]) -> tuple[Mode, str | None]:
        if value is None:
            return "auto", None
        if isinstance(value, str):
            mode = next((m for m in CHOICES if m == value), None)
            if mode is None:
                raise ConfigError(f"tool_choice must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", "
                                  f"\"function\": {{\"name\": ...}}}}, got {value!r:.80}", "tool_choice")
            return mode, None
        if not isinstance(value, Mapping) or value.get("type") != "function" \
                or not isinstance(value.get("function"), Mapping):
            raise ConfigError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                              '{"name": ...}}', "tool_choice")
        name = value["function"].get("name")
        if name not in names:
            raise ConfigError(f"tool_choice names the function {name!r:.80}, which is not among the tools "
                              f"({', '.join(names)})", "tool_choice.function.name")
        return "function", name

    def check_schemas(self) -> None:
        """Each function's parameters compile as a JSON schema (ConfigError naming the tool and
        where in its schema the problem is)."""
        from localspec.decoding.grammar.compiler import compile_constraint

        for i, tool in enumerate(self.tools):
            compile_constraint(Constraint.json_schema(tool.parameters, param=f"tools[{i}].function.parameters"))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)

    def specs(self) -> list[dict[str, Any]]:
        """The tools as the chat template renders them (as the client sent them)."""
        return [dict(t.spec) for t in self.tools]

    @property
    def calls_allowed(self) -> bool:
        return self.mode != "none"

    @functools.cached_property
    def json_calls(self) -> JsonCalls | None:
        """Calls written as plain JSON, which only ``auto`` reads as calls (None otherwise)."""
        return JsonCalls(self.tools) if self.mode == "auto" else None

    def constraint(self) -> Constraint:
        """The grammar of an answer under this tool choice (see the module docstring)."""
        return Constraint.grammar(tool_grammar(self), lark=True, param="tools", allow_stop_strings=True)


def _body_rules(tools: Sequence[Tool]) -> list[str]:
    """The rules of a call's body, ``{"name": "<one of the tools'>", "arguments": {...}}`` in
    JSON_LAYOUT (the layout llguidance gives such an object), the arguments valid for that
    function's schema. Each schema is its own ``%json`` root, so its ``$ref``s resolve against the
    parameters themselves (``#/$defs/...``, as openai.pydantic_function_tool writes them)."""
    rules = ["body: " + " | ".join(f"body{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        head = '{"name": ' + json.dumps(tool.name) + ', "arguments": '  # NAME_RE: nothing to escape
        schema = {**tool.parameters, "x-guidance": JSON_LAYOUT}
        rules += [f'body{i}: {json.dumps(head)} call_arguments{i} "}}"',
                  f"call_arguments{i}: %json {json.dumps(schema, ensure_ascii=False)}"]
    return rules


def tool_grammar(toolset: ToolSet) -> str:
    """A Lark grammar (llguidance's) of the answer: text and/or calls in the model's syntax (and,
    with ``auto``, calls written as plain JSON: :class:`JsonCalls`)."""
    tools = toolset.tools if toolset.mode != "function" else tuple(t for t in toolset.tools
                                                                    if t.name == toolset.function)
    # a newline may end the calls (then only the end of the answer may follow): models trained on
    # this syntax often write one after </tool_call>, and a newline that must open another call
    # would force them into calling again and again
    calls = 'call ("\\n" call)* "\\n"?' if toolset.parallel and toolset.mode != "function" else 'call "\\n"?'
    start = {"none": "TEXT", "auto": "TEXT | TEXT? calls | json_calls", "required": "calls",
             "function": "calls"}[toolset.mode]
    plain = toolset.json_calls
    # text cannot open a call written as plain JSON: once it does, only json_calls goes on
    text = "TEXT: /(?s:.+)/" + (f" & ~/(?s:{plain.opening}.*)/" if plain else "")
    return "\n".join([
        "%llguidance {}",
        f"start: {start}",
        f"calls: {calls}",
        f'call: {CALL_OPEN} "\\n" body "\\n" {CALL_CLOSE}',
        *_body_rules(tools),
        *(plain.rules(toolset.parallel) if plain else []),
        text,
        "",
    ])


_WS = "[ \\t\\r\\n]{0,64}"  # whitespace around a plain-JSON call's keys (bounded: a model cannot pad forever)
_FENCE = "```(?:json)?\\n"  # a Markdown code block opening
_FENCE_RE = re.compile(_FENCE)


class JsonCalls:
    """Calls written as plain JSON, ``{"name": "get_weather", "arguments": {...}}``, bare or in a
    Markdown code block, from the very start of the answer: how small models trained on the
    <tool_call> syntax often answer instead (llama.cpp's server accepts these too). With
    ``auto``, once the answer opens with ``{"name": "<one of the tools>"`` (any whitespace, after
    an optional `````json`` line), text is no longer possible: the rest is constrained as a call
    (arguments valid for that function's schema), and more calls may follow, one per block."""

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools = tuple(tools)
        names = "|".join(re.escape(t.name) for t in self.tools)
        # the same regex for the grammar (Rust's regex syntax) and the parser (Python's)
        self.opening = f'(?:{_FENCE})?\\{{{_WS}"name"{_WS}:{_WS}"(?:{names})"'
        self._opening = re.compile(self.opening)
        self._prefix = re.compile(_prefix_pattern(self.tools))

    def rules(self, parallel: bool) -> list[str]:
        """The grammar's rules: ``json_calls`` and what it is made of."""
        layout = {"whitespace_flexible": True, "whitespace_pattern": "[ \\t\\r\\n]{1,64}", "lenient": False}
        arguments_key = f'/{_WS},{_WS}"arguments"{_WS}:{_WS}/'
        rules, alternatives = [], []
        for i, tool in enumerate(self.tools):
            name = f'\\{{{_WS}"name"{_WS}:{_WS}"{re.escape(tool.name)}"'
            rules += [f"json_call{i}: /{name}/ {arguments_key} arguments{i} /{_WS}\\}}/",
                      f"fenced_call{i}: /{_FENCE}{name}/ {arguments_key} arguments{i} /{_WS}\\}}\\n```/",
                      f"arguments{i}: %json {json.dumps({**tool.parameters, 'x-guidance': layout}, ensure_ascii=False)}"]
            alternatives += [f"json_call{i}", f"fenced_call{i}"]
        more = ' (/\\n\\n?/ json_call)*' if parallel else ""
        return [f"json_calls: json_call{more} \"\\n\"?", "json_call: " + " | ".join(alternatives), *rules]

    def opens(self, text: str) -> bool:
        """Whether an answer starting with `text` has opened a call (the grammar allows no text then)."""
        return self._opening.match(text) is not None

    def may_open(self, text: str) -> bool:
        """Whether an answer starting with `text` may still turn out to be a call."""
        return self._prefix.fullmatch(text) is not None

    @staticmethod
    def parse(text: str) -> list[tuple[str, Any]] | None:
        """The (name, arguments) of each call in the answer `text`, in the grammar's layout (calls,
        each bare or in a code block, one or two newlines apart, perhaps a newline after the
        last); None when it is not that, complete."""
        calls, whole = JsonCalls.read(text)
        return calls if whole else None

    @staticmethod
    def read(text: str) -> tuple[list[tuple[str, Any]], bool]:
        """The (name, arguments) of the complete calls at the start of `text` (a call is complete
        when its object closes, and its code block, if it opened one), and whether they are all of
        it (False: the text goes on with a call cut off, or with what is no call)."""
        decoder, pos = json.JSONDecoder(), 0
        calls: list[tuple[str, Any]] = []
        while True:
            fence = _FENCE_RE.match(text, pos)
            try:
                body, pos = decoder.raw_decode(text, fence.end() if fence else pos)
            except (json.JSONDecodeError, RecursionError):
                return calls, False
            if fence and not text.startswith("\n```", pos):
                return calls, False
            pos += 4 if fence else 0
            if not isinstance(body, dict) or set(body) != {"name", "arguments"}:
                return calls, False
            calls.append((body["name"], body["arguments"]))
            if text[pos:] in ("", "\n"):
                return calls, True
            separator = len(text[pos:pos + 2]) - len(text[pos:pos + 2].lstrip("\n"))
            if not separator:
                return calls, False
            pos += separator


def _prefix_pattern(tools: Sequence[Tool]) -> str:
    """A regex matching every prefix of an opening (:attr:`JsonCalls.opening`), the empty one too."""
    def literal(s: str) -> str:  # s, or any prefix of it
        return "".join(f"(?:{re.escape(c)}" for c in s) + ")?" * len(s)

    def then(first: str, first_prefix: str, rest: str) -> str:  # a prefix of `first` followed by `rest`
        return f"(?:(?:{first}){rest}|{first_prefix})"

    ws = _WS
    names = "(?:" + "|".join(literal(t.name + '"') for t in tools) + ")"
    tail = then("\\{", "", then(ws, ws, then('"name"', literal('"name"'), then(
        ws, ws, then(":", "", then(ws, ws, then('"', "", names)))))))
    fence = then("```json\\n|```\\n", literal("```json\n") + "|" + literal("```\n"), tail)
    return f"(?:{fence}|{tail})"
