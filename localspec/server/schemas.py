"""The OpenAI request bodies as pydantic models; their values become a GenerationConfig.

Pydantic checks the shape and types of a request (strictly: a string is never a number, a
number never a boolean); the values are checked once more by :class:`GenerationConfig`, which
owns every range and combination rule. Both kinds of failure become a :class:`RequestError`
naming the field.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from localspec.errors import ConfigError, RequestError
from localspec.prompt import ROLE_RE
from localspec.settings.generation import SETTING_KEYS, GenerationConfig
from localspec.settings.validation import unknown_names
from localspec.tools import ToolSet

# parameters this server cannot honour: accepted only at their no-op values, never silently
# ignored (the text would differ from what the client asked for). OpenAI's, then the samplers of
# llama.cpp's and llama-cpp-python's servers that localspec does not have.
UNSUPPORTED: dict[str, Any] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "functions": (None, []),
    "repeat_penalty": (None, 1), "repetition_penalty": (None, 1), "penalty_last_n": (None, 0),
    "mirostat": (None, 0), "mirostat_mode": (None, 0), "typical_p": (None, 1), "tfs_z": (None, 1),
    "dry_multiplier": (None, 0), "xtc_probability": (None, 0), "top_n_sigma": (None, -1),
    "dynatemp_range": (None, 0), "min_keep": (None, 0), "n_probs": (None, 0), "ignore_eos": (None, False),
    # OpenAI's, whose other values would change the text or its form
    "function_call": (None, "none", "auto"), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    "web_search_options": (None,), "min_tokens": (None, 0), "lenience": (None, 0),  # lenience: the Python API's
}
# fields an unknown name is not refused for when null; a misspelt setting gets its suggestion
_HINTS = {"n_predict": "max_tokens", "max_new_tokens": "max_tokens", "max_length": "max_tokens",
          "stop_sequences": "stop", "num_predict": "max_tokens", "random_seed": "seed"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class _Open(_Strict):
    """A JSON object whose unknown fields are kept, to be refused by name (never dropped)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    def unknown(self) -> dict[str, Any]:
        """The fields this model does not declare that carry a value (null is no value)."""
        return {k: v for k, v in (self.model_extra or {}).items() if v is not None}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Open):
    """A chat message; an assistant message may carry tool_calls (and content null), a tool
    message the tool_call_id it answers (checked by localspec.prompt.check_messages)."""

    role: str = Field(pattern=ROLE_RE.pattern)
    content: str | list[TextPart] | None = Field(default=None, validate_default=False)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": self.role, "content": text}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class StreamOptions(_Strict):
    include_usage: bool = False



class _Request(_Open):
    """Fields both endpoints share: the OpenAI ones and localspec's speculative extensions. A
    field not declared here is refused by name unless it is null."""

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (llama.cpp's sampler)
    min_p: float | None = None  # extension
    seed: int | None = None  # -1: a random seed, as llama.cpp's server
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object, json_schema (checked by Constraint)
    grammar: str | None = None  # llama-server's: GBNF (Lark when it starts with %llguidance); "" is none
    json_schema: dict[str, Any] | bool | None = None  # llama-server's: a JSON schema
    verifier: str | None = None
    num_draft_tokens: int | None = None
    paths: int | None = None
    tree: str | list[int] | None = None
    drafter: str | None = None
    plan: str | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    tools: Any = None
    functions: Any = None
    repeat_penalty: Any = None
    repetition_penalty: Any = None
    penalty_last_n: Any = None
    mirostat: Any = None
    mirostat_mode: Any = None
    typical_p: Any = None
    tfs_z: Any = None
    dry_multiplier: Any = None
    xtc_probability: Any = None
    top_n_sigma: Any = None
    dynatemp_range: Any = None
    min_keep: Any = None
    n_probs: Any = None
    ignore_eos: Any = None
    tool_choice: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    min_tokens: Any = None
    lenience: Any = None
    # accepted and without effect on the text: bookkeeping of OpenAI's and llama.cpp's servers
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    cache_prompt: bool | None = None  # llama.cpp's: the server's prompt cache (--prompt-cache) decides instead
    parallel_tool_calls: bool | None = None  # with tools (chat only); without them it has no effect

    def check_supported(self) -> None:
        for name, no_ops in UNSUPPORTED.items():
            if getattr(self, name) not in no_ops:
                raise RequestError(f"'{name}' is not supported by localspec's server"
                                   + (" (a setting of the Python API only)" if name == "lenience" else ""), name)
        for name in self.unknown():
            hint = _HINTS.get(name)
            if name in ("messages", "prompt"):
                raise RequestError(f"'{name}' belongs to POST /v1/{'chat/' if name == 'messages' else ''}completions; "
                                   f"this endpoint takes '{'prompt' if name == 'messages' else 'messages'}'", name)
            message = (f"unknown field {name!r}; use {hint!r}" if hint else
                       unknown_names([name], sorted(type(self).model_fields), "field").split("; known:")[0])
            raise RequestError(f"{message}; localspec's server refuses the fields it cannot honour rather than "
                               "ignore them (leave it out, or send null)", name)
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise RequestError(f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                               f"({self.max_completion_tokens}) differ; give one of them", "max_completion_tokens")

    def config(self, defaults: GenerationConfig) -> GenerationConfig:
        """The request's settings over the server's defaults (ConfigError -> RequestError)."""
        options = {k: getattr(self, k) for k in SETTINGS if getattr(self, k) is not None}
        if options.get("seed") == -1:
            options["seed"] = None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None:
            options["max_tokens"] = max_tokens
        if options.get("grammar") == "":
            del options["grammar"]  # llama-server's "no grammar"
        if self.json_schema is not None:
            options["json_schema"] = self.json_schema
        try:
            config = GenerationConfig.from_options(defaults, **options)
            if config.constraint is not None:  # compiled now: a bad schema is this request's 400, before any work
                from localspec.decoding.grammar.compiler import compile_constraint

                compile_constraint(config.constraint)
            return config
        except ConfigError as exc:
            param = exc.param
            if param == "max_tokens" and self.max_completion_tokens is not None:
                param = "max_completion_tokens"  # the field the client sent
            raise RequestError(str(exc).replace("max_tokens", param or "max_tokens"), param) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# the settings a request may carry: every GenerationConfig setting that is a request field
# (max_tokens comes as max_tokens or max_completion_tokens, see _Request.config)
SETTINGS = tuple(k for k in SETTING_KEYS if k in _Request.model_fields and k != "max_tokens")


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)

    def check_supported(self) -> None:
        super().check_supported()
        for i, message in enumerate(self.messages):
            for name in message.unknown():
                raise RequestError(f"'messages[{i}].{name}' is not supported by localspec's server: the chat "
                                   "template sees 'role', 'content', 'tool_calls', 'tool_call_id' and 'name' "
                                   "(leave it out, or send null)", f"messages[{i}].{name}")
            if message.content is None and not message.tool_calls:
                raise RequestError(f"'messages[{i}].content': Field required (only an assistant message with "
                                   "'tool_calls' may leave it out)", f"messages[{i}].content")
            allowed = {"tool_calls": message.role == "assistant", "tool_call_id": message.role == "tool",
                       "name": message.role == "tool"}
            for name, ok in allowed.items():
                if getattr(message, name) not in (None, "", []) and not ok:
                    owner = "an assistant" if name == "tool_calls" else "a tool"
                    raise RequestError(f"'messages[{i}].{name}' is not supported on a {message.role} message: the "
                                       f"chat template renders it only on {owner} message (leave it out, or send "
                                       "null)", f"messages[{i}].{name}")

    def prompt(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]

    def toolset(self) -> ToolSet | None:
        """The request's tools, tool_choice and parallel_tool_calls (RequestError naming the field)."""
        try:
            return ToolSet.parse(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ConfigError as exc:
            raise RequestError(str(exc), exc.param) from None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                raise RequestError(f"'{name}' belongs to POST /v1/chat/completions (tool calls need chat messages)",
                                   name)

    def prompt_value(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise RequestError("'prompt' must not be empty", "prompt")
        texts = [x for x in p if isinstance(x, str)]  # all of it or nothing: a list of strings, or of token ids
        if not texts:
            return [x for x in p if isinstance(x, int)]
        if len(p) != 1:
            raise RequestError("'prompt' must be one string (batches of prompts are not supported)", "prompt")
        return texts[0]


def _location(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in ("str", "list[int]", "list[str]", "list[TextPart]", "int", "function-after"):
            out += ("." if out else "") + str(part)
    return out


def _non_finite(value: Any, where: str = "") -> str | None:
    """The path of the first number JSON cannot carry (NaN, Infinity, or 1e400, which Python's
    json module reads as infinity), None when there is none."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return at
        if isinstance(item, dict):
            stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))
    return None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise RequestError(f"the request body names {key!r} twice; give each field once", key)
        seen[key] = value
    return seen


def decode_json(data: bytes) -> Any:
    """A request body as JSON (localspec.server.app.parse_json), refusing a field named twice
    (which value would win?); RecursionError and ValueError as json.loads raises them. NaN and
    Infinity literals, which RFC 8259 leaves out, decode as floats here so that :func:`parse`
    refuses them naming the field."""
    return json.loads(data, object_pairs_hook=_no_duplicates)


def parse(body: Any, chat: bool) -> ChatRequest | CompletionRequest:
    """The validated request, or a RequestError naming the first field at fault."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    where = _non_finite(body)
    if where is not None:
        raise RequestError(f"'{where}' is not a finite number (JSON has no NaN or Infinity, and 1e400 is "
                           "too large)", where.split(".")[0].split("[")[0] or None)
    model = ChatRequest if chat else CompletionRequest
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = _location(error["loc"])
        got = "" if error["type"] == "missing" else f", got {error['input']!r:.80}"
        raise RequestError(f"'{where}': {error['msg']}{got}", where or None) from None
    request.check_supported()
    return request
