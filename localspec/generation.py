"""One generation: set up eagerly, run by its target's scheduler, read as a stream of responses.

:class:`Generation` validates the settings, tokenizes the prompt and builds the engine when it is
made (bad input raises at once, as mlx-lm's set-up call does). It is then a call of the target's
scheduler (localspec.decoding.scheduler: every call on a loaded target is a slot of one step
loop): its :meth:`~Generation.program` restores the prompt's saved prefix, prefills the rest and
runs the engine's steps there, and each step's tokens become :class:`Response`\\ s (text cut at
stop strings, tool calls read back) handed to whoever reads it — iterating over it in any thread
(localspec.api.stream_generate), or an event loop (localspec.api.astream_generate). A generation
stops, as its reader asks, between two steps or during a prompt's prefill.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from localspec.decoding.drafters import ModelDrafter, make_drafters
from localspec.decoding.engine import Engine, check_prompt
from localspec.decoding.history import History
from localspec.decoding.passes import Turn
from localspec.decoding.profiles import Profiles
from localspec.decoding.scheduler import Scheduler
from localspec.decoding.slots import Program
from localspec.decoding.stats import GenerationStats
from localspec.decoding.text import StopScanner
from localspec.errors import ConfigError, ModelError
from localspec.llama.model import Model
from localspec.llama.prompt_cache import PromptCache
from localspec.prompt import Prompt, prompt_tokens, supports_tools
from localspec.settings.generation import GenerationConfig
from localspec.tool_calls import ToolCall, ToolCallParser, tool_call_markers
from localspec.tools import ToolSet

END = object()  # the last event of a generation's stream


class CancelEvent(Protocol):
    """What stops a generation: anything with is_set() (a threading.Event, localspec.core's Cancel)."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class Response:
    """One generated token: its text (may be empty mid-character), id, and running stats."""

    text: str
    token: int | None
    # None while generating; "stop" (EOS or a stop string), "length", "tool_calls", or "cancelled"
    # (its cancel was set: the last response, with the text held back until then)
    finish_reason: str | None
    stats: GenerationStats
    # with a constraint, on the last response: whether the text is a complete answer of it ("stop"
    # always is; "length" is truncated unless the text happened to be complete); None otherwise
    constraint_satisfied: bool | None = None
    # the part of `text` that is the answer's content: with tools, the tool-call markup is left
    # out (and whitespace before a call); without tools, `text` itself
    content: str = ""
    # on the last response: the calls the model made, each complete (finish_reason "tool_calls"),
    # or, with finish_reason "length", the calls it completed before the limit cut it off
    tool_calls: tuple[ToolCall, ...] = ()
    # the token was drafted and accepted (a draft model's or an n-gram proposal's; not a token the
    # grammar forced): where speculation paid (chat's /drafts and --show-drafts colour it)
    drafted: bool = False


def applied_config(config: GenerationConfig, has_draft: bool) -> GenerationConfig:
    """The settings as they apply to a pair: where nothing can be drafted
    (GenerationConfig.is_target_alone), no draft tokens and no tree."""
    return config.target_alone() if config.is_target_alone(has_draft) else config


PromptCacheSetting = PromptCache | str | os.PathLike | bool | None


def prompt_cache_of(setting: PromptCacheSetting) -> PromptCache | None:
    """The prompt cache a setting names: a PromptCache; a directory; "off" or False (none); None
    or True: the default (LOCALSPEC_PROMPT_CACHE, else <cache root>/prompts)."""
    if isinstance(setting, PromptCache) or setting is False:
        return setting or None
    if setting is None or setting is True:
        return PromptCache.from_setting(None)
    if isinstance(setting, (str, os.PathLike)):
        return PromptCache.from_setting(setting)
    raise ConfigError(f"prompt_cache must be a directory, 'off', a bool or a PromptCache, not "
                      f"{type(setting).__name__}", "prompt_cache")


class Generation:
    """One generation, set up eagerly: settings validated, prompt tokenized, engine built.
    Iterate over it (once) for one :class:`Response` per token; the last carries the finish reason.

    `profiles` are the cost profiles the planner starts from and refines; given, their owner
    saves them (a chat session, a server); None: the user's, read here and saved when the
    generation ends. `prompt_cache` (see prompt_cache_of; default on): the longest saved prefix
    of the prompt is restored before the prefill and the prompt's state saved after it.
    `history`: the target's earlier calls (localspec.decoding.history.History), drafted from
    beside the context where that pays; this generation is added to it when it ends. `cancel`:
    anything with is_set() (a threading.Event); once set, the generation stops within one step
    (within a graph node during a prefill) and its last response has finish_reason "cancelled"."""

    def __init__(self, target: Model, draft: Model | None, prompt: Prompt, config: GenerationConfig,
                 profiles: Profiles | None = None, prompt_cache: PromptCacheSetting = None,
                 tools: ToolSet | None = None, history: History | None = None,
                 cancel: CancelEvent | None = None) -> None:
        _check_arguments(target, draft, config, profiles, cancel)
        self.prompt_cache = prompt_cache_of(prompt_cache)
        self.target = target
        self.tools = tools
        self._parser = _tool_parser(target, prompt, tools)
        if tools is not None:
            config = _with_tools(config, tools)
        self.config = applied_config(config, draft is not None)
        self._owns_profiles = profiles is None
        self.profiles = Profiles() if profiles is None else profiles
        self.prompt = prompt_tokens(target, prompt, tools.specs() if tools is not None else None)
        check_prompt(self.prompt, target.n_ctx)
        self.history = history
        self.engine = Engine(target, make_drafters(target, draft, self.config, history), self.config, self.profiles)
        parser = self._parser
        self.scanner = StopScanner(target, self.config.stop, parser.tokens if parser else None,
                                   parser.json_calls if parser else None)
        self.restored = 0  # prompt tokens restored from the prompt cache
        self.restore_seconds = 0.0  # restoring the prompt's saved prefix (target and draft)
        self.save_seconds = 0.0  # saving the prompt's state (and the draft's at the end)
        self.slot: int | None = None  # the target's slot it runs in
        self._cancel = cancel
        self._closed = False  # its reader left
        self._sink: Callable[[Any], None] | None = None
        self._started = self._finished = self._prime_only = False

    # ------------------------------------------------------------ the reader's side

    def __iter__(self) -> Iterator[Response]:
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.submit(events.put)
        ended = False
        try:
            while True:
                event = events.get()
                if event is END:
                    ended = True
                    return
                if isinstance(event, BaseException):
                    ended = True  # an error is the call's last event but END
                    raise event
                yield event
        finally:
            if not ended:  # its reader stopped early (closed, or an exception in its thread)
                self._closed = True
                if not sys.is_finalizing():  # at exit, nothing runs the scheduler any more
                    while events.get() is not END:
                        pass

    def submit(self, sink: Callable[[Any], None]) -> None:
        """Run on the target's scheduler, handing each event (a Response, an error, then END) to
        `sink` from the scheduler's thread."""
        if self._sink is not None:
            raise RuntimeError("a Generation runs once; make another for another run")
        self._sink = sink
        Scheduler.of(self.target).submit(self)

    def stop(self) -> None:
        """Stop it (from any thread): between two steps, or at once during a prefill."""
        self._closed = True

    def prime(self) -> bool:
        """The prompt into the target's cache and the prompt cache, without generating (a chat's
        /save: the conversation's state is kept for --resume); whether the prompt cache holds it."""
        self._prime_only = True
        for _ in self:
            pass
        cache = self.prompt_cache
        return cache is not None and cache.keeps(self.target, len(self.prompt) - 1)

    @property
    def call_cut_off(self) -> bool:
        """Whether the answer ended inside a tool call (which is then not reported; the calls
        completed before it are)."""
        return self._parser is not None and self._parser.writing

    # ------------------------------------------------------------ the scheduler's side (a Call)

    def cancelled(self) -> bool:
        return self._closed or (self._cancel is not None and self._cancel.is_set())

    def bind(self, slot: int) -> None:
        self._claim_draft()
        self.slot = slot
        self.engine.bind(slot)
        self.target.sequences[slot].followers.append(self.scanner)  # follows the commits from the prompt on

    def program(self) -> Program:
        self._started = True
        yield from self._start()
        if self._prime_only:
            return
        turn = yield Turn()
        while True:
            new = yield from self.engine.steps(turn)
            for response in self._step_responses(new):
                self._emit(response)
            if self._finished:
                return
            turn = yield Turn()

    def end(self, error: BaseException | None, cancelled: bool) -> None:
        try:
            if self._started:
                self._finish()
            else:
                self.engine.close()
        except Exception as exc:  # noqa: BLE001 - saving what it learned failed: its reader is told
            error = error or exc
        finally:
            if self.slot is not None:
                followers = self.target.sequences[self.slot].followers
                if self.scanner in followers:
                    followers.remove(self.scanner)
        if cancelled and error is None and not self._finished and not self._prime_only:
            self._emit(self._response(self.scanner.flush(), None, "cancelled"))
        if error is not None:
            self._emit(error)
        self._emit(END)

    def _claim_draft(self) -> None:
        """The draft model decodes in this target's step loop from now on: ModelError when another
        target's loop uses it now (one llama.cpp context is never decoded by two threads)."""
        draft = next((d.source for d in self.engine.drafters if isinstance(d, ModelDrafter)), None)
        if draft is None:
            return
        busy = [m for m in (draft.drafting_for, draft) if m is not None and m is not self.target and _generating(m)]
        if busy:
            raise ModelError(f"the draft {draft.path.name} is in use by the generations of another model now: "
                             "load it once for each target that drafts with it")
        draft.drafting_for = self.target

    def _emit(self, event: Any) -> None:
        if self._sink is not None:
            self._sink(event)

    def _start(self) -> Any:
        """The prompt into the target's cache: restored from the prompt cache as far as it has it
        (the draft model's too, when it is loaded), the rest prefilled, then saved for later runs."""
        cache, state = self.prompt_cache, self.engine.state
        t0 = time.perf_counter()
        if cache is not None:
            self.restored = state.restore(cache, self.prompt)
        t1 = time.perf_counter()
        yield from self.engine.start_steps(self.prompt)
        t2 = time.perf_counter()
        if cache is not None:
            cache.save(self.target, self.prompt, state.target)  # the prefill decoded all of it
        self.restore_seconds, self.save_seconds = t1 - t0, time.perf_counter() - t2

    def _finish(self) -> None:
        if self.history is not None:  # later calls of this target may draft from it
            self.history.add(self.engine.tokens)
        if self.prompt_cache is not None:  # the draft's state of what it caught up on
            t0 = time.perf_counter()
            self.engine.state.save_draft(self.prompt_cache, self.prompt)
            self.save_seconds += time.perf_counter() - t0
        self.engine.finish()
        if self._owns_profiles:
            self.profiles.save()  # what this generation measured, for the next run

    def _step_responses(self, new: list[int]) -> list[Response]:
        """The responses of a step's new tokens (none: the context is full), up to the one that
        finishes the generation."""
        engine, scanner = self.engine, self.scanner
        if not new:
            self._finished = True
            return [self._response(scanner.flush(), None, "length")]
        out = []
        pieces = scanner.take()  # what the step committed, cut after a stop string
        for i, (tok, text) in enumerate(pieces):
            last = i == len(pieces) - 1
            finish = "stop" if last and scanner.stopped else engine.finish_reason if i == len(new) - 1 else None
            if finish and not scanner.stopped:
                text += scanner.flush()
            out.append(self._response(text, tok, finish, drafted=i < engine.speculated))
            if finish:
                self._finished = True
                break
        return out

    def _response(self, text: str, token: int | None, finish: str | None, drafted: bool = False) -> Response:
        """The Response of one token; with tools, its content and, at the end, the calls made
        (finish_reason "tool_calls" only when every call is complete; with "length" or
        "cancelled", the calls completed before: a call cut off is never reported, nor one
        completed lost)."""
        engine, parser = self.engine, self._parser
        satisfied = engine.constraint_satisfied if finish else None
        if parser is None:
            return Response(text, token, finish, engine.stats(), satisfied, text, drafted=drafted)
        content = parser.push(token, text)
        calls: tuple[ToolCall, ...] = ()
        if finish:
            content += parser.flush()
            if finish == "stop" and parser.complete:
                finish, calls = "tool_calls", tuple(parser.calls)
            elif finish in ("length", "cancelled"):
                calls = tuple(parser.calls)
        return Response(text, token, finish, engine.stats(), satisfied, content, calls, drafted)


def _generating(model: Any) -> bool:
    """Whether calls generate on `model` now (a target or a draft: a lazy draft not loaded yet has
    no scheduler)."""
    scheduler = getattr(model, "scheduler", None)
    return scheduler is not None and bool(scheduler.busy)


def _check_arguments(target: Any, draft: Any, config: Any, profiles: Any, cancel: Any) -> None:
    """ConfigError naming the argument that is not what a generation takes (a path where a loaded
    model belongs, the target as its own draft, ...), before anything runs."""
    from localspec.llama.lazy import LazyModel

    if not isinstance(target, Model):
        raise ConfigError(f"target must be a loaded model, got {type(target).__name__}; load it with "
                          "localspec.load_model(path)", "target")
    if draft is not None and not isinstance(draft, (Model, LazyModel)):
        raise ConfigError(f"draft must be a loaded model or None, got {type(draft).__name__}; load it with "
                          "localspec.load_model(path)", "draft")
    if draft is target:
        raise ConfigError("the draft is the target itself: a model cannot draft for itself in one generation "
                          "(its KV cache is one state); pass draft=None, or load the file twice", "draft")
    if not isinstance(config, GenerationConfig):
        raise ConfigError(f"config must be a GenerationConfig, got {type(config).__name__}", "config")
    if profiles is not None and not isinstance(profiles, Profiles):
        raise ConfigError(f"profiles must be a localspec.decoding.profiles.Profiles (or None), got "
                          f"{type(profiles).__name__}", "profiles")
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise ConfigError(f"cancel must have an is_set() method (a threading.Event), got {type(cancel).__name__}",
                          "cancel")


def _tool_parser(target: Model, prompt: Prompt, tools: ToolSet | None) -> ToolCallParser | None:
    """The parser of a generation's tool calls (None without tools); ConfigError when the model
    cannot call tools or the prompt is not a chat."""
    if tools is None:
        return None
    if not isinstance(tools, ToolSet):
        raise ConfigError(f"tools must be a localspec.tools.ToolSet (ToolSet.parse(tools, tool_choice)), got "
                          f"{type(tools).__name__}", "tools")
    if isinstance(prompt, (str, bytes)) or not any(isinstance(m, dict) for m in prompt):
        raise ConfigError("tools need a chat prompt (a list of messages): the chat template renders them", "tools")
    template = target.chat_template
    if not template or not supports_tools(template):
        raise ConfigError(f"the chat template of {target.path.name} has no support for tools; localspec calls "
                          "tools with the model's own template (Qwen 2.5 and Hermes-style models have one)", "tools")
    if not tools.calls_allowed:
        return None
    return ToolCallParser(*tool_call_markers(target), tools.json_calls)


def _with_tools(config: GenerationConfig, tools: ToolSet) -> GenerationConfig:
    """The config with the grammar of the answer under the tool choice (tool_choice "none" with
    a response format keeps that format)."""
    if config.constraint is not None:
        if tools.calls_allowed:
            raise ConfigError(f"{config.constraint.describe()} cannot be combined with tool calls; send "
                              "tool_choice \"none\" to answer in that format, or leave it out", "tools")
        return config
    return dataclasses.replace(config, constraint=tools.constraint())
