"""The calls a model made, read back out of what it generates: :class:`ToolCallParser` splits the
generated tokens into the answer's content and :class:`ToolCall` objects (OpenAI's shape), for
calls in the model's own ``<tool_call>`` syntax and, under ``auto``, calls written as plain JSON
(``localspec.tools.JsonCalls``). The tools, the tool choice and the grammar that constrains the
answer are ``localspec.tools``."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from localspec.errors import ConfigError
from localspec.tools import CALL_CLOSE, CALL_OPEN, JsonCalls


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: ``arguments`` is the JSON text it wrote (an object valid for the
    function's schema); ``fragments`` are that text's pieces as the tokens came (for streaming)."""

    index: int
    id: str
    name: str
    arguments: str
    fragments: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}}."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_call_markers(model: Any) -> tuple[int, int]:
    """The ids of the model's <tool_call> and </tool_call> tokens (ConfigError when it has none)."""
    ids = [model.tokenize(text, add_special=False, parse_special=True) for text in (CALL_OPEN, CALL_CLOSE)]
    if any(len(i) != 1 for i in ids):
        raise ConfigError(f"{model.path.name} has no {CALL_OPEN} token: localspec calls tools in the "
                          f"{CALL_OPEN} format of Qwen 2.5 and Hermes-style models, which this model does not use",
                          "tools")
    return ids[0][0], ids[1][0]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Splits generated (token, text) pairs into the answer's content and its tool calls. Content
    is released as it comes, except trailing whitespace, held until more text follows (the
    newline before a call belongs to the syntax, not to the content), and, with `json_calls`,
    the answer's start while it may still be a call written as plain JSON (:class:`JsonCalls`)."""

    def __init__(self, open_token: int, close_token: int, json_calls: JsonCalls | None = None) -> None:
        self.tokens = (open_token, close_token)
        self.json_calls = json_calls
        self.calls: list[ToolCall] = []
        self.content = ""  # released so far
        self._held = ""  # trailing whitespace of the content, not yet released
        self._call: list[str] | None = None  # the text pieces of the call being written
        self._start: str | None = "" if json_calls is not None else None  # the answer's start, held
        self._json: list[str] | None = None  # the answer, once it opened a call written as plain JSON
        self._cut = False  # at the end, the answer's plain-JSON calls went on with one cut off

    def push(self, token: int | None, text: str) -> str:
        """One generated token and its text; returns the content it releases."""
        if self._json is not None:
            self._json.append(text)
            return ""
        if self._start is None:
            return self._push(token, text)
        held, self._start = self._start, None
        if token in self.tokens or self.json_calls is None:  # a call token: what was held is text before it
            return self._text(held) + self._push(token, text)
        start = held + text
        if self.json_calls.opens(start):
            self._json = [start]
        elif self.json_calls.may_open(start):
            self._start = start
        else:
            return self._text(start)
        return ""

    def _push(self, token: int | None, text: str) -> str:
        if token == self.tokens[0] and self._call is None:
            self._held = ""  # the newline before the first call is syntax
            self._call = []
            return ""
        if token == self.tokens[1] and self._call is not None:
            self.calls.append(self._parse(self._call, len(self.calls)))
            self._call = None
            return ""
        if self._call is not None:
            self._call.append(text)
            return ""
        if self.calls:  # between or after calls: the syntax's newlines
            return ""
        return self._text(text)

    def _text(self, text: str) -> str:
        """Content, released but for its trailing whitespace."""
        text = self._held + text
        kept = text.rstrip()
        self._held = text[len(kept):]
        self.content += kept
        return kept

    def flush(self) -> str:
        """At the end of the answer: the calls written as plain JSON that are complete (all of
        them, or those before one the end cut off), or the content still held (the answer's
        start, trailing whitespace)."""
        if self._json is not None:
            calls, whole = JsonCalls.read("".join(self._json))
            self._json, self._cut = None, not whole
            for name, arguments in calls:
                text = json.dumps(arguments, ensure_ascii=False)
                self.calls.append(ToolCall(len(self.calls), new_call_id(), name, text, (text,)))
            return ""
        out = self._text(self._start) if self._start else ""
        self._start = None
        held, self._held = ("", "") if self.calls or self._call is not None else (self._held, "")
        self.content += held
        return out + held

    @property
    def writing(self) -> bool:
        """A call is open and not complete (at the end: one was cut off)."""
        return self._call is not None or self._json is not None or self._cut

    @property
    def complete(self) -> bool:
        """Calls were made and none is cut off."""
        return bool(self.calls) and not self.writing

    @staticmethod
    def _parse(pieces: list[str], index: int) -> ToolCall:
        """A call from its text ('\\n{"name": ..., "arguments": {...}}\\n'), the grammar's layout."""
        text = "".join(pieces)
        body = json.loads(text)
        name = body["name"]
        head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        start = text.index(head) + len(head)
        end = text.rindex("}")  # the body's own closing brace
        arguments = text[start:end]
        if json.loads(arguments) != body["arguments"]:  # not the layout the grammar forces: re-serialise
            arguments = json.dumps(body["arguments"], ensure_ascii=False)
            return ToolCall(index, new_call_id(), name, arguments, (arguments,))
        fragments, pos = [], 0
        for piece in pieces:
            a, b = max(pos, start), min(pos + len(piece), end)
            if a < b:
                fragments.append(text[a:b])
            pos += len(piece)
        return ToolCall(index, new_call_id(), name, arguments, tuple(fragments))
