"""A call to the core, and what it answers: one typed, versioned :class:`Request`, and a stream
of events (:class:`Note`, :class:`Ready`, :class:`Text`, :class:`Done`, :class:`Failed`).

The command line resolves everything a call needs before it makes one: the settings (the same
:class:`~localspec.settings.generation.GenerationConfig` the API and the server build, in its flat form), the
pair (:class:`~localspec.core.pairs.PairSpec`: files resolved, registry models fetched), the
prompt (the text it read from the argument, stdin and files), the prompt cache and the profile
directory. Nothing of the calling process travels: no argv, environment or working directory.
The same request runs in the calling process (``--keep-alive 0``) or in the resident service,
and the same events come back; the command line renders them (:mod:`localspec.cli.render`).

Plain dataclasses and the standard library (the ``localspec`` client imports this module): a
service validates a request with pydantic, from these types (:func:`localspec.core.wire.parse_request`).
A client reads its service's events as these dataclasses (:func:`event_of`) without checking their
fields' types: the service it talks to is its own user's, started from the same code (the
service's name says which install and version it runs, and a service whose code changed on disk
takes no call), and made them from these types.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from localspec.core.pairs import PairSpec
from localspec.decoding.stats import GenerationStats
from localspec.settings.validation import WIRE_CONFIG

VERSION = 1  # of Request; a service answers another version with a Failed event


@dataclass(frozen=True)
class Prompt:
    """What to generate from: the user's text (wrapped in the model's chat template when `chat`
    and the model has one, with `system` first), or a chat's messages."""

    __pydantic_config__ = WIRE_CONFIG

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    chat: bool = True
    system: str | None = None


@dataclass(frozen=True)
class Tools:
    """OpenAI's tools, tool_choice and parallel_tool_calls, as the call gave them (checked and
    compiled where the call runs: localspec.tools.ToolSet.parse)."""

    __pydantic_config__ = WIRE_CONFIG

    tools: list[Any]
    tool_choice: Any = None
    parallel_tool_calls: bool = True


CallKind = Literal["generate", "open", "keep"]  # a reply; a chat's first call; a chat's /save


@dataclass(frozen=True)
class Request:
    """One call: what to do, on which pair, with which settings, from which prompt, and where
    its prompt cache and cost profiles live (None: the prompt cache is off)."""

    __pydantic_config__ = WIRE_CONFIG

    kind: CallKind
    pair: PairSpec
    settings: dict[str, Any]  # GenerationConfig.options()
    prompt: Prompt
    prompt_cache: str | None  # a directory (None: off)
    prompt_cache_limit: int  # bytes it keeps on disk
    profiles: str  # the cost profiles' directory
    keep_alive: float  # seconds the pair stays loaded after the call (where it runs in a service)
    max_loaded: int  # pairs a service keeps loaded at most (LOCALSPEC_MAX_LOADED)
    tools: Tools | None = None
    grammar: bool = False  # a constrained generation follows (the tokenizer is built while the target loads)
    log_level: int = 30  # the caller's logging level (logging.WARNING; -v: INFO): a service sends such lines as notes
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class Note:
    """A line for the user's stderr (why the call waits, what loads)."""

    text: str


@dataclass(frozen=True)
class Ready:
    """The pair is loaded and the call checked (a chat's banner)."""

    model: str  # the target's name (its metadata's)
    draft: str | None  # the draft model's name (None: none)
    n_ctx: int
    speculation: str  # what drafts, in words (localspec.settings.generation.describe_speculation)


@dataclass(frozen=True)
class Text:
    """Generated text (with tools: the answer's content, without call markup); `drafted`: it came
    from an accepted draft, where speculation paid."""

    text: str
    drafted: bool = False


@dataclass(frozen=True)
class Done:
    """The call's end. `stats` is None when nothing was generated (stopped before the first
    token, or an open/keep call); `stopped` says why a generation ended early ("interrupted",
    "terminated"); `error` is an error that ended it after output (the output is kept)."""

    model: str = ""  # the target as the call named it
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # the settings as applied (GenerationConfig.options())
    prompt_tokens: int = 0
    constraint_satisfied: bool | None = None
    tool_calls: list[dict[str, Any]] | None = None  # with tools: the calls made
    call_cut_off: bool = False  # the answer ended inside a tool call (not reported)
    speculative: bool = False  # something could be drafted (not the target alone)
    one_token_seconds: float = 0.0  # the target's measured one-token step (-u's speedup estimate)
    timings: dict[str, Any] = field(default_factory=dict)
    stopped: str | None = None
    error: Failed | None = None
    kept: bool = False  # keep: the conversation's state is in the prompt cache


@dataclass(frozen=True)
class Failed:
    """An error before any output: the class of localspec.errors it is (a name), its message and
    the setting at fault."""

    error: str
    message: str
    param: str | None = None


EVENTS: dict[str, type] = {"note": Note, "ready": Ready, "text": Text, "done": Done, "failed": Failed}
_NAMES = {cls: name for name, cls in EVENTS.items()}


def event_json(event: Any) -> dict[str, Any]:
    """An event as one JSON object ({"event": name, **fields})."""
    data = asdict(event)
    if isinstance(event, Done) and event.stats is not None:
        data["stats"] = event.stats.to_json()
    return {"event": _NAMES[type(event)], **data}


class BadEvent(ValueError):
    """What arrived is not an event of this version."""


def event_of(data: Any) -> Any:
    """The event of event_json's object: a known event with exactly its fields (BadEvent
    otherwise; see the module docstring for why the fields' types are not checked here)."""
    if not isinstance(data, dict) or data.get("event") not in EVENTS:
        raise BadEvent("not an event")
    cls = EVENTS[data["event"]]
    fields_ = {k: v for k, v in data.items() if k != "event"}
    try:
        if cls is Done:
            stats, error = fields_.get("stats"), fields_.get("error")
            fields_["stats"] = None if stats is None else GenerationStats.from_json(stats)
            fields_["error"] = None if error is None else Failed(**error)
        return cls(**fields_)
    except (TypeError, ValueError) as exc:
        raise BadEvent(f"a malformed {data['event']} event ({exc})") from None
