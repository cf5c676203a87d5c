"""Prompts as token ids: plain text, token ids, or chat messages through the model's template.

Text in a message is text. A chat template wraps messages in control tokens (``<|im_start|>``,
``<|im_end|>``); a message that *contains* such a marker must not become one, or anyone who can
put words into a message (a web page, a file an app quotes) can open a system turn. So the
template is rendered with a placeholder for each message's content, only the template's own text
is read for control tokens, and the contents are tokenized as plain text. For messages without
markers the tokens equal those of tokenizing the whole rendered prompt.
"""

from __future__ import annotations

import ctypes
import numbers
import re
from typing import Iterable, Sequence, Union

import llama_cpp as lc

from localspec.errors import ModelError, PromptError
from localspec.llama.model import Model

Prompt = Union[str, Sequence[int], Sequence[dict]]
# OpenAI message fields that would change the prompt but that localspec's templates do not render:
# refused rather than dropped (an app's own keys, such as the chat command's "interrupted", are kept)
UNUSED_MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id", "function_call", "audio")
ROLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,31}$")
_SPECIAL_ATTRS = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN  # read only where parse_special is on
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around a placeholder's number
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


_PROMPT_KINDS = "a string, a non-empty list of chat messages ({'role': ..., 'content': ...}) or a non-empty list of token ids"


def _is_token_id(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def prompt_tokens(target: Model, prompt: Prompt) -> list[int]:
    """A prompt (text, chat messages or token ids) as the token ids generation starts from."""
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        return target.tokenize(prompt, add_special=True, parse_special=False)
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise PromptError("the prompt is bytes, not text; decode it first (e.g. data.decode('utf-8'))")
    if isinstance(prompt, dict):
        raise PromptError("the prompt is one chat message (a dict); pass a list of messages, e.g. "
                          "[{'role': 'user', 'content': 'Hi'}]")
    if not isinstance(prompt, Iterable):
        raise PromptError(f"the prompt must be {_PROMPT_KINDS}, got {type(prompt).__name__}")
    items = list(prompt)
    if not items:
        raise PromptError(f"the prompt is empty; it must be {_PROMPT_KINDS}")
    if any(isinstance(m, dict) for m in items):
        return chat_tokens(target, items)
    if all(_is_token_id(t) for t in items):
        for i, t in enumerate(items):
            if not 0 <= t < target.n_vocab:
                raise PromptError(f"token id {t} at index {i} of the prompt is not in the vocabulary (token ids in "
                                  f"[0, {target.n_vocab}))")
        return [int(t) for t in items]
    bad = next((i, t) for i, t in enumerate(items) if not _is_token_id(t))
    raise PromptError(f"the prompt must be {_PROMPT_KINDS}; item {bad[0]} is a {type(bad[1]).__name__}")


def check_text(text: str, what: str) -> None:
    """Text that UTF-8 can encode: a lone surrogate (from JSON such as "\\ud800", or undecodable
    bytes) is not text, and is refused naming where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(f"{what} is not valid Unicode text: a lone surrogate U+{ord(text[exc.start]):04X} at "
                          f"character {exc.start}") from None


def check_messages(messages: Sequence[dict]) -> None:
    """Each message needs a role (a short name: user, system, assistant, ...) and text content."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptError(f"chat message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("content"), str):
            got = "no 'content'" if "content" not in m else f"'content' of type {type(m['content']).__name__}"
            raise PromptError(f"chat message {i} needs a string 'content' (text), got {got}")
        unused = [k for k in UNUSED_MESSAGE_KEYS if m.get(k) not in (None, "", [])]
        if unused:
            raise PromptError(f"chat message {i} has {', '.join(map(repr, unused))}, which localspec cannot use "
                              "(the chat template sees only 'role' and 'content'); leave it out")
        role = m.get("role")
        if not isinstance(role, str) or not ROLE_RE.match(role):
            raise PromptError(f"chat message {i} has role {role!r}; a role is a short name such as user, "
                              "system or assistant (letters, digits, _ and -)")
        check_text(m["content"], f"the content of chat message {i}")


def render_chat(model: Model, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The conversation as text, through the model's own chat template."""
    template = model.chat_template
    if not template:
        raise PromptError(f"{model.path.name} has no chat template; send a plain prompt instead")
    check_messages(messages)
    rendered = _render_builtin(template, messages, add_generation_prompt)
    if rendered is None:
        rendered = _render_jinja(template, messages, add_generation_prompt, model)
    return rendered


def chat_tokens(model: Model, messages: Sequence[dict]) -> list[int]:
    """Token ids of the conversation plus the assistant's turn; message contents stay plain text."""
    check_messages(messages)
    contents = [m["content"] for m in messages]
    real = render_chat(model, messages)
    marked = render_chat(model, [{**m, "content": f"{_OPEN}{i}{_CLOSE}"} for i, m in enumerate(messages)])
    for fill in (lambda c: c, str.strip):
        if _PLACEHOLDER.sub(lambda m: fill(contents[int(m.group(1))]), marked) == real:
            break
    else:
        raise PromptError(f"the chat template of {model.path.name} rewrites message text, so localspec cannot "
                         "tell its markup from the messages; send a plain prompt (--raw) instead")
    pieces: list[int | str] = []  # control-token ids and plain text, in order
    pos = 0
    for m in _PLACEHOLDER.finditer(marked):
        pieces += _template_pieces(model, marked[pos: m.start()])
        pieces.append(fill(contents[int(m.group(1))]))
        pos = m.end()
    pieces += _template_pieces(model, marked[pos:])
    tokens = [model.bos] if model.add_bos and not (pieces and pieces[0] == model.bos) else []
    return tokens + _tokenize_pieces(model, pieces)


def _template_pieces(model: Model, text: str) -> list[int | str]:
    """The template's own text split into control tokens (ids) and plain text, as llama.cpp's
    tokenizer with parse_special reads it (including whitespace a marker strips beside it)."""
    out: list[int | str] = []
    pos = 0
    for tok in model.tokenize(text, add_special=False, parse_special=True):
        attr = model.token_attr(tok)
        if not attr & _SPECIAL_ATTRS:
            continue
        marker = model.token_text(tok).decode("utf-8", "replace")
        at = text.find(marker, pos)
        if at < 0:  # cannot happen: the tokenizer found it in this text
            raise ModelError(f"control token {marker!r} not found in the chat template's output")
        before = text[pos:at]
        if attr & lc.LLAMA_TOKEN_ATTR_LSTRIP:
            before = before.rstrip()
        out += [before, tok]
        pos = at + len(marker)
        if attr & lc.LLAMA_TOKEN_ATTR_RSTRIP:
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
            tokens += model.tokenize("".join(run), add_special=False, parse_special=False)
            run = []
        if piece >= 0:
            tokens.append(piece)
    return tokens


def _render_builtin(template: str, messages: Sequence[dict], add_assistant: bool) -> str | None:
    """llama.cpp's built-in template engine; None when it does not know this template."""
    msgs = (lc.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        msgs[i].role = role
        msgs[i].content = content
    size = 4096 + sum(len(k) for k in keep) * 2
    buf = ctypes.create_string_buffer(size)
    n = lc.llama_chat_apply_template(template.encode(), msgs, len(messages), add_assistant, buf, size)
    if n > size:
        buf = ctypes.create_string_buffer(n + 1)
        n = lc.llama_chat_apply_template(template.encode(), msgs, len(messages), add_assistant, buf, n + 1)
    if n < 0:
        return None
    return buf.raw[:n].decode("utf-8", "replace")


def _render_jinja(template: str, messages: Sequence[dict], add_assistant: bool, model: Model) -> str:
    """Fallback: render the GGUF's jinja template in a sandbox (as llama-cpp-python does)."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # jinja2 comes with llama-cpp-python
        raise ModelError("rendering this chat template needs jinja2") from exc
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(template).render(
            messages=list(messages), add_generation_prompt=add_assistant,
            bos_token=model.token_text(model.bos).decode("utf-8", "replace"),
            eos_token=model.token_text(model.eos).decode("utf-8", "replace"))
    except Exception as exc:
        raise PromptError(f"the chat template of {model.path.name} failed to render these messages: {exc}") from exc
