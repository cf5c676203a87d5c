"""Prompts as token ids: plain text, token ids, or chat messages through the model's template.

Text in a message is text. A chat template wraps messages in control tokens (``<|im_start|>``,
``<|im_end|>``); a message that *contains* such a marker must not become one, or anyone who can
put words into a message (a web page, a file an app quotes, a tool's result) can open a system
turn or fake a tool call. So every marker in the caller's strings (contents, tool definitions,
call names and arguments) is replaced by a placeholder before the template is rendered, only
the template's own text is read for markers, and the caller's text, placeholders turned back
into text, is tokenized as plain text. For messages without markers the tokens equal those of
tokenizing the whole rendered prompt.

Tools and tool messages are rendered by the GGUF's Jinja template as Hugging Face renders it
(``tojson`` keeps key order and does not escape HTML; a call's ``arguments``, JSON text in
OpenAI's messages, is given to the template as an object).
"""

from __future__ import annotations

import datetime
import functools
import json
import numbers
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeGuard

from localspec.errors import ModelError, PromptError
from localspec.llama.model import Model
from localspec.settings.constraints import MAX_JSON_DEPTH, json_depth

Prompt = str | Sequence[int] | Sequence[dict]
# OpenAI message fields that would change the prompt but that localspec's templates do not render:
# refused rather than dropped (an app's own keys, such as the chat command's "interrupted", are kept)
UNUSED_MESSAGE_KEYS = ("function_call", "audio")
ROLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,31}$")
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around a placeholder (see _escape)


_PROMPT_SHAPES = "a string, a non-empty list of chat messages ({'role': ..., 'content': ...}) or a non-empty list of token ids"


def _is_token_id(value: object) -> TypeGuard[numbers.Integral]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def prompt_tokens(target: Model, prompt: Prompt, tools: Sequence[dict] | None = None) -> list[int]:
    """A prompt (text, chat messages or token ids) as the token ids generation starts from;
    `tools` (OpenAI's tool definitions) are rendered with chat messages by the template."""
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        return target.tokenize(prompt, add_special=True, parse_special=False)
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise PromptError("the prompt is bytes, not text; decode it first (e.g. data.decode('utf-8'))")
    if isinstance(prompt, dict):
        raise PromptError("the prompt is one chat message (a dict); pass a list of messages, e.g. "
                          "[{'role': 'user', 'content': 'Hi'}]")
    if not isinstance(prompt, Iterable):
        raise PromptError(f"the prompt must be {_PROMPT_SHAPES}, got {type(prompt).__name__}")
    items: list[object] = list(prompt)  # what the caller passed: each item is checked here
    if not items:
        raise PromptError(f"the prompt is empty; it must be {_PROMPT_SHAPES}")
    if any(isinstance(m, dict) for m in items):
        return chat_tokens(target, items, tools)
    ids = [int(t) for t in items if _is_token_id(t)]
    if len(ids) == len(items):
        for i, t in enumerate(ids):
            if not 0 <= t < target.n_vocab:
                raise PromptError(f"token id {t} at index {i} of the prompt is not in the vocabulary (token ids in "
                                  f"[0, {target.n_vocab}))")
        return ids
    bad = next((i, t) for i, t in enumerate(items) if not _is_token_id(t))
    raise PromptError(f"the prompt must be {_PROMPT_SHAPES}; item {bad[0]} is a {type(bad[1]).__name__}")


def check_text(text: str, what: str) -> None:
    """Text that UTF-8 can encode: a lone surrogate (from JSON such as "\\ud800", or undecodable
    bytes) is not text, and is refused naming where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(f"{what} is not valid Unicode text: a lone surrogate U+{ord(text[exc.start]):04X} at "
                          f"character {exc.start}") from None


def check_messages(messages: Sequence[object]) -> list[dict]:
    """Each message needs a role (a short name: user, system, assistant, tool, ...) and text
    content; an assistant message may carry OpenAI's ``tool_calls`` (then its content may be null)
    and a tool message its ``tool_call_id`` and ``name``. Returns the messages as a chat template
    takes them: a call's ``arguments`` (JSON text, as OpenAI sends them) as an object, null content
    as ""."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptError(f"chat message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not ROLE_RE.match(role):
            raise PromptError(f"chat message {i} has role {role!r}; a role is a short name such as user, "
                              "system or assistant (letters, digits, _ and -)")
        calls = m.get("tool_calls") or None
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and calls is not None):
            got = "no 'content'" if "content" not in m else f"'content' of type {type(content).__name__}"
            raise PromptError(f"chat message {i} needs a string 'content' (text), got {got}")
        unused = [k for k in UNUSED_MESSAGE_KEYS if m.get(k) not in (None, "", [])]
        if role != "tool":
            unused += [k for k in ("name", "tool_call_id") if m.get(k) not in (None, "")]
        if unused:
            raise PromptError(f"chat message {i} has {', '.join(map(repr, unused))}, which localspec cannot use "
                              f"(the chat template does not render it for a {role} message); leave it out")
        message = {**m, "content": content or ""}
        check_text(message["content"], f"the content of chat message {i}")
        if calls is not None:
            if role != "assistant":
                raise PromptError(f"messages[{i}].tool_calls: only an assistant message carries tool calls")
            message["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in
                                     enumerate(calls if isinstance(calls, list) else [calls])]
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise PromptError(f"messages[{i}].{key} must be a string")
        out.append(message)
    return out


def _template_call(call: object, where: str) -> dict:
    """One of OpenAI's tool calls ({"id", "type": "function", "function": {"name", "arguments"}})
    as templates take it: arguments as an object (Qwen's template writes them with tojson)."""
    from localspec.tools import NAME_RE

    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(function, dict):
        raise PromptError(f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                          "\"arguments\": \"{...}\"}}", where)
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise PromptError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r:.80}",
                          f"{where}.function.name")
    too_deep = PromptError(f"{where}.function.arguments nests deeper than {MAX_JSON_DEPTH} levels of JSON arrays "
                           "and objects (the most localspec accepts)", f"{where}.function.arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise PromptError(f"{where}.function.arguments is not valid JSON ({exc}); send the arguments the "
                              "model gave, a JSON object as a string", f"{where}.function.arguments") from None
        except RecursionError:
            raise too_deep from None
    if not isinstance(arguments, dict):
        raise PromptError(f"{where}.function.arguments must be a JSON object (as a string), got "
                          f"{type(arguments).__name__}", f"{where}.function.arguments")
    if json_depth(arguments) > MAX_JSON_DEPTH:
        raise too_deep
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise PromptError(f"{where}.id must be a string", f"{where}.id")
    return {**call, "type": call.get("type") or "function", "function": {**function, "arguments": arguments}}


def has_tool_messages(messages: Sequence[dict]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages if isinstance(m, dict))


def supports_tools(template: str) -> bool:
    """Whether a chat template renders tools (it reads a ``tools`` variable, as Qwen's does)."""
    return "tools" in _template_variables(template)


def template_of(model: Model) -> str:
    """The model's chat template (PromptError when it has none)."""
    template = model.chat_template
    if not template:
        raise PromptError(f"{model.path.name} has no chat template; send a plain prompt instead")
    return template


def render_messages(model: Model, template: str, messages: list[dict], add_generation_prompt: bool,
                    tools: Sequence[dict] | None) -> str:
    """Checked messages (:func:`check_messages`) and the tools the model may call as text, through
    the model's own chat template (its Jinja, as Hugging Face and llama-server render it: with the
    model's default system message where the template has one)."""
    if (tools or has_tool_messages(messages)) and not supports_tools(template):
        raise PromptError(f"the chat template of {model.path.name} has no support for tools (tool "
                          "definitions, tool calls or tool results); send the conversation without them")
    return _render_jinja(template, messages, add_generation_prompt, model, tools)


def chat_tokens(model: Model, messages: Sequence[object], tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of the conversation plus the assistant's turn. Everything the caller wrote —
    message contents, tool definitions, call names and arguments — stays plain text: a control
    token or a marker such as ``<tool_call>`` in it is read as text, never as that token. (Each
    such marker is replaced by a placeholder before rendering; only the template's own text is
    read for tokens; the placeholders become the text again.)"""
    template = template_of(model)
    checked = check_messages(messages)
    real = render_messages(model, template, checked, True, tools)
    marked = render_messages(model, template, _escape(model, checked), True,
                             _escape(model, list(tools or [])) or None)
    if _unescape(marked) != real:
        raise PromptError(f"the chat template of {model.path.name} treats message text differently when it "
                          "holds control tokens, so localspec cannot tell its markup from the messages; send a "
                          "plain prompt (--raw) instead")
    pieces = [p if isinstance(p, int) else _unescape(p) for p in _template_pieces(model, marked)]
    tokens = [model.bos] if model.add_bos and not (pieces and pieces[0] == model.bos) else []
    return tokens + _tokenize_pieces(model, pieces)


def _marker_spans(model: Model, text: str) -> Iterator[tuple[int, int, int]]:
    """Where llama.cpp's tokenizer (parse_special on) reads a marker in `text`: (token, start, end)."""
    pos = 0
    for tok in model.tokenize(text, add_special=False, parse_special=True):
        if not model.is_marker(tok):
            continue
        marker = model.token_text(tok).decode("utf-8", "replace")
        at = text.find(marker, pos)
        if at < 0:  # cannot happen: the tokenizer found it in this text
            raise ModelError(f"marker token {marker!r} not found in the text it was read from")
        pos = at + len(marker)
        yield tok, at, pos


def _escape(model: Model, value: Any) -> Any:
    """`value` with every marker in its strings (and keys) replaced by a placeholder (and the
    placeholder characters themselves escaped), see :func:`_unescape`."""
    if isinstance(value, str):
        return _escape_text(model, value)
    if isinstance(value, dict):
        return {_escape(model, k): _escape(model, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escape(model, v) for v in value]
    return value


def _escape_text(model: Model, text: str) -> str:
    if _OPEN in text or _CLOSE in text:  # in one pass: the second replacement must not see the first's
        text = _PLACEHOLDER_CHARS.sub(lambda m: f"{_OPEN}{'o' if m.group() == _OPEN else 'c'}{_CLOSE}", text)
    out, pos = [], 0
    for tok, at, end in _marker_spans(model, text):
        out += [text[pos:at], f"{_OPEN}x{model.token_text(tok).hex()}{_CLOSE}"]
        pos = end
    out.append(text[pos:])
    return "".join(out)


_ESCAPED = re.compile(f"{_OPEN}(x[0-9a-f]+|o|c){_CLOSE}")
_PLACEHOLDER_CHARS = re.compile(f"[{_OPEN}{_CLOSE}]")


def _unescape(text: str) -> str:
    """The text :func:`_escape` made placeholders in, as the caller wrote it."""
    return _ESCAPED.sub(_unescape_one, text)


def _unescape_one(m: re.Match) -> str:
    code = m.group(1)
    if code == "o":
        return _OPEN
    if code == "c":
        return _CLOSE
    return bytes.fromhex(code[1:]).decode("utf-8", "replace")


def _template_pieces(model: Model, text: str) -> list[int | str]:
    """The template's own text split into control tokens (ids) and plain text, as llama.cpp's
    tokenizer with parse_special reads it (including whitespace a marker strips beside it)."""
    out: list[int | str] = []
    pos = 0
    for tok, at, end in _marker_spans(model, text):
        lstrip, rstrip = model.strips(tok)
        before = text[pos:at]
        if lstrip:
            before = before.rstrip()
        out += [before, tok]
        pos = end
        if rstrip:
            rest = text[pos:]
            pos += len(rest) - len(rest.lstrip())
    out.append(text[pos:])
    return [p for p in out if p != ""]


def _tokenize_pieces(model: Model, pieces: list[int | str]) -> list[int]:
    """Control tokens as they are; each run of plain text between them tokenized as text."""
    tokens: list[int] = []
    run: list[str] = []
    for piece in pieces + [-1]:
        if isinstance(piece, str):
            run.append(piece)
            continue
        if run:
            tokens += text_tokens(model, "".join(run))
            run = []
        if piece >= 0:
            tokens.append(piece)
    return tokens


def text_tokens(model: Model, text: str) -> list[int]:
    """`text` as plain text: no control token (parse_special off), and no user-defined marker
    either — llama.cpp's tokenizer reads those (``<tool_call>``) even in plain text, so the text
    is cut inside each such marker and the parts tokenized apart."""
    tokens = model.tokenize(text, add_special=False, parse_special=False)
    marker = next((t for t in tokens if model.is_marker(t)), None)
    if marker is None:
        return tokens
    at = text.find(model.token_text(marker).decode("utf-8", "replace"))
    if at < 0:  # the tokenizer found it, so it is there
        raise ModelError(f"marker token {marker} not found in the text it was read from")
    head = model.tokenize(text[: at + 1], add_special=False, parse_special=False)
    return head + _continuation(model, text[at + 1:])


def _continuation(model: Model, text: str) -> list[int]:
    """:func:`text_tokens` of text that continues other text: without the space a SentencePiece
    vocabulary puts before the start of a text (tokenized after a separator no merge crosses)."""
    sep = model.tokenize("\x01", add_special=False, parse_special=False)
    joined = text_tokens(model, "\x01" + text)
    if joined[: len(sep)] == sep:
        return joined[len(sep):]
    return text_tokens(model, text)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """Hugging Face's tojson: keys in their order, no HTML escaping (jinja2's own escapes <, > and &)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise PromptError(f"the chat template refuses these messages: {message}")


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """The template compiled in a sandbox, with the filters and functions Hugging Face gives templates."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # jinja2 comes with llama-cpp-python
        raise ModelError("rendering this chat template needs jinja2") from exc
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env, env.from_string(template)


@functools.lru_cache(maxsize=8)
def _template_variables(template: str) -> frozenset[str]:
    from jinja2 import meta

    env, _ = _compiled(template)
    return frozenset(meta.find_undeclared_variables(env.parse(template)))


def _render_jinja(template: str, messages: Sequence[dict], add_assistant: bool, model: Model,
                  tools: Sequence[dict] | None = None) -> str:
    """The GGUF's Jinja template rendered in a sandbox, as Hugging Face renders it."""
    try:
        _, compiled = _compiled(template)
        return compiled.render(
            messages=list(messages), tools=list(tools) if tools else None, add_generation_prompt=add_assistant,
            bos_token=model.token_text(model.bos).decode("utf-8", "replace"),
            eos_token=model.token_text(model.eos).decode("utf-8", "replace"))
    except PromptError:
        raise
    except Exception as exc:
        raise PromptError(f"the chat template of {model.path.name} failed to render these messages: {exc}") from exc
