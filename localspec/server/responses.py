"""The OpenAI response objects as pydantic models (the wire format, declared once), and
:class:`ResponseBuilder`, which builds those of one request (full responses, stream chunks).

Every JSON body the server sends is one of these models: :class:`ChatCompletion`,
:class:`TextCompletion`, their stream chunks, :class:`ModelList` / :class:`ModelCard`,
:class:`ErrorBody` (``/health`` answers the core's status: :mod:`localspec.core.status`). A None
value is sent as ``null`` (OpenAI's clients read
``logprobs``, ``finish_reason``, ``param`` and ``code`` as present), except where a model says a
field is left out when not given (a chunk's ``usage`` without ``include_usage``, a delta's
unset role or content).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from localspec import __version__
from localspec.decoding.stats import GenerationStats
from localspec.settings.generation import GenerationConfig
from localspec.tool_calls import ToolCall

FINGERPRINT = f"localspec-{__version__}"


class _Wire(BaseModel):
    """A JSON object the server sends. Fields named in `omit_unless_given` are left out when the
    object was built without them (given as None, they are sent as null)."""

    model_config = ConfigDict(extra="forbid")
    omit_unless_given: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self.omit_unless_given - self.model_fields_set:
            data.pop(name, None)
        return data


# ---------------------------------------------------------------- parts


class Speculative(_Wire):
    """The settings a generation used and its acceptance statistics (the `speculative` object);
    the statistics are those of GenerationStats.as_dict."""

    verifier: str
    drafter: str
    plan: str
    num_draft_tokens: int
    paths: int
    tree: list[int] | None
    generated_tokens: int
    tokens_per_second: float
    elapsed_seconds: float
    block_efficiency: float
    acceptance_rate: float
    target_passes: int
    drafted_tokens: int
    accepted_tokens: int
    accept_histogram: list[int]
    verifier_share: float
    accepted_by_kind: dict[str, int]
    constraint_seconds: float
    cached_tokens: int
    depth_limits: dict[str, int]  # steps drafted below num_draft_tokens, by reason (localspec.decoding.depth)
    draft_seconds: float  # drafting (draft model passes, lookups, the planner)
    target_seconds: float  # the target's passes
    verify_seconds: float  # the verifier

    @classmethod
    def of(cls, config: GenerationConfig, stats: GenerationStats) -> Speculative:
        options = config.options()
        settings = {k: options[k] for k in ("verifier", "drafter", "plan", "num_draft_tokens", "paths", "tree")}
        return cls.model_validate({**settings, **stats.as_dict()})


class Timings(_Wire):
    """llama-server's `timings` object, its names and units (GenerationStats.timings computes it;
    docs/server.md says what each field means); the draft fields only when something was drafted."""

    omit_unless_given = frozenset({"draft_n", "draft_n_accepted"})
    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int | None = None
    draft_n_accepted: int | None = None

    @classmethod
    def of(cls, stats: GenerationStats) -> Timings:
        return cls(**stats.timings())


class PromptTokensDetails(_Wire):
    cached_tokens: int  # prompt tokens the KV cache held already (not prefilled again)


class Usage(_Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, stats: GenerationStats) -> Usage:
        return cls(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.generated_tokens,
                   total_tokens=stats.prompt_tokens + stats.generated_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_tokens))


class FunctionCall(_Wire):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    @classmethod
    def of(cls, call: ToolCall) -> ToolCallOut:
        return cls(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


class ChatMessage(_Wire):
    """The reply: its text (null when it is only tool calls) and the calls, sent only when made."""

    omit_unless_given = frozenset({"tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class FunctionDelta(_Wire):
    omit_unless_given = frozenset({"name"})
    name: str | None = None
    arguments: str


class ToolCallDelta(_Wire):
    """A piece of a streamed tool call: the first of each call carries its id, type and name
    with empty arguments; the later ones its index and argument fragments (OpenAI's stream)."""

    omit_unless_given = frozenset({"id", "type"})
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatChoice(_Wire):
    index: int = 0
    message: ChatMessage
    logprobs: None = None
    finish_reason: str


class Delta(_Wire):
    """What a chat chunk adds: the role (first chunk), text, a piece of a tool call, or nothing
    (the last chunk: `{}`)."""

    omit_unless_given = frozenset({"role", "content", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Wire):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class TextChoice(_Wire):
    """A text completion's choice, in a full response and in a chunk (finish_reason null until the end)."""

    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class _Completion(_Wire):
    id: str
    created: int
    model: str
    system_fingerprint: str = FINGERPRINT


# ---------------------------------------------------------------- responses


class ChatCompletion(_Completion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    speculative: Speculative
    timings: Timings


class TextCompletion(_Completion):
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]
    usage: Usage
    speculative: Speculative
    timings: Timings


class ChatCompletionChunk(_Completion):
    """One `chat.completion.chunk` event. `usage` is sent (null but in the last) only when the
    client asked for it (stream_options.include_usage); `speculative` and `timings` only in the
    final chunks."""

    omit_unless_given = frozenset({"usage", "speculative", "timings"})
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = None
    speculative: Speculative | None = None
    timings: Timings | None = None


class TextCompletionChunk(_Completion):
    """One `text_completion` event (the same rules as ChatCompletionChunk)."""

    omit_unless_given = frozenset({"usage", "speculative", "timings"})
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]
    usage: Usage | None = None
    speculative: Speculative | None = None
    timings: Timings | None = None


Chunk = ChatCompletionChunk | TextCompletionChunk


class ModelCard(_Wire):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "localspec"


class ModelList(_Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Wire):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(_Wire):
    error: ErrorDetail


def error_body(message: str, param: str | None = None, error_type: str = "invalid_request_error",
               code: str | None = None) -> ErrorBody:
    return ErrorBody(error=ErrorDetail(message=message, type=error_type, param=param, code=code))


@dataclass
class ResponseBuilder:
    """Builds the OpenAI objects of one request."""

    chat: bool
    include_usage: bool
    config: GenerationConfig  # as it applies to the loaded pair
    model_id: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model_id}

    def full(self, text: str, finish: str, stats: GenerationStats,
             tool_calls: tuple[ToolCall, ...] = ()) -> ChatCompletion | TextCompletion:
        usage, spec, timings = Usage.of(stats), Speculative.of(self.config, stats), Timings.of(stats)
        if self.chat:
            message = (ChatMessage(content=text or None, tool_calls=[ToolCallOut.of(c) for c in tool_calls])
                       if tool_calls else ChatMessage(content=text))
            return ChatCompletion(**self._head(), usage=usage, speculative=spec, timings=timings,
                                  choices=[ChatChoice(message=message, finish_reason=finish)])
        return TextCompletion(**self._head(), usage=usage, speculative=spec, timings=timings,
                              choices=[TextChoice(text=text, finish_reason=finish)])

    def chunk(self, text: str | None, finish: str | None = None, *, role: bool = False,
              **extra: Any) -> Chunk:
        """A chunk adding `text` (role: the first chat chunk, the role and ""); `extra`: usage,
        speculative, timings. `usage` is null unless given, when the client asked for usage."""
        if self.include_usage:
            extra.setdefault("usage", None)
        if self.chat:
            delta = Delta(role="assistant", content="") if role else Delta() if text is None else Delta(content=text)
            return ChatCompletionChunk(**self._head(), **extra,
                                       choices=[ChunkChoice(delta=delta, finish_reason=finish)])
        return TextCompletionChunk(**self._head(), **extra, choices=[TextChoice(text=text or "", finish_reason=finish)])

    def tool_call_chunks(self, calls: tuple[ToolCall, ...]) -> list[Chunk]:
        """The chunks of complete tool calls, as OpenAI streams them: per call, a first delta with
        its index, id, type, name and empty arguments, then one per argument fragment."""
        chunks: list[Chunk] = []
        for call in calls:
            deltas = [ToolCallDelta(index=call.index, id=call.id, type="function",
                                    function=FunctionDelta(name=call.name, arguments=""))]
            deltas += [ToolCallDelta(index=call.index, function=FunctionDelta(arguments=f))
                       for f in call.fragments or (call.arguments,)]
            chunks += [self._delta_chunk(Delta(tool_calls=[d])) for d in deltas]
        return chunks

    def _delta_chunk(self, delta: Delta) -> ChatCompletionChunk:
        extra: dict[str, Any] = {"usage": None} if self.include_usage else {}  # keyword arguments, as chunk's
        return ChatCompletionChunk(**self._head(), **extra, choices=[ChunkChoice(delta=delta)])

    def final_chunks(self, finish: str, stats: GenerationStats) -> list[Chunk]:
        """The chunk with the finish reason and, when the client asked for usage, one with the
        usage and no choices; each carries `speculative` and `timings` (the last one has them)."""
        spec, timings = Speculative.of(self.config, stats), Timings.of(stats)
        last = self.chunk(None, finish, speculative=spec, timings=timings)
        if not self.include_usage:
            return [last]
        cls = ChatCompletionChunk if self.chat else TextCompletionChunk
        return [last, cls(**self._head(), choices=[], usage=Usage.of(stats), speculative=spec, timings=timings)]
