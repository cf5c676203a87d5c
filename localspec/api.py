"""Python API: load models, then stream or generate text with speculative decoding.

    from localspec import load_model, default_pair, stream_generate, generate

    target, draft = default_pair()                 # fetches the Qwen2.5-Coder pair on first use
    for r in stream_generate(target, draft, "def fib(n):", max_tokens=64):
        print(r.text, end="", flush=True)
    print(r.stats.block_efficiency, r.stats.tokens_per_second)

``draft=None`` loads no draft model: the n-gram drafter (``drafter="auto"`` or ``"ngram"``) still
drafts from the context. ``num_draft_tokens=0`` decodes with the target alone through the same
code path (the baseline).
Keyword names equal the CLI flags. As in mlx-lm, :class:`Generation` is the eager set-up (it
validates the settings, tokenizes the prompt and builds the engine, so bad input raises at once)
and iterating over it runs the generation; ``stream_generate`` and ``generate`` wrap it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from localspec.settings.generation import GenerationConfig
from localspec.settings.models import PairOptions
from localspec.decoding.drafters import make_drafters
from localspec.decoding.engine import Engine
from localspec.decoding.history import History
from localspec.decoding.stats import GenerationStats
from localspec.errors import ConfigError, PromptError
from localspec.loading import load_model, load_pair
from localspec.llama.model import Model
from localspec.decoding.profiles import Profiles
from localspec.llama.prompt_cache import PromptCache
from localspec.prompt import Prompt, prompt_tokens, supports_tools
from localspec.tool_calls import ToolCall, ToolCallParser, call_tokens
from localspec.tools import JsonCalls, ToolSet

log = logging.getLogger(__name__)

__all__ = ["Generation", "Response", "applied_config", "default_pair", "generate", "load_model", "stream_generate"]


@dataclass(frozen=True)
class Response:
    """One generated token: its text (may be empty mid-character), id, and running stats."""

    text: str
    token: int | None
    finish_reason: str | None  # None while generating; "stop" (EOS or a stop string), "length", "tool_calls"
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


def default_pair(*, draft_n_gpu_layers: int | None = None, draft_rpc: str | None = None,
                 progress: Callable[[float], Any] | None = None, **options: Any) -> tuple[Model, Model]:
    """The default (target, draft) pair of the registry, fetched if needed. Options as for load_model
    (`progress`: one fraction 0 to 1 over the downloads and both loads, each part by its bytes);
    draft_n_gpu_layers defaults to n_gpu_layers; the draft stays on this machine unless draft_rpc
    names RPC servers for it (rpc= applies to the target)."""
    pair = PairOptions.from_flags({**options, "draft_n_gpu_layers": draft_n_gpu_layers, "draft_rpc": draft_rpc})
    loaded = load_pair(None, None, pair, progress=progress)
    return loaded.target, loaded.draft


def applied_config(config: GenerationConfig, has_draft: bool) -> GenerationConfig:
    """The settings as they apply to a pair: where nothing can be drafted
    (GenerationConfig.is_target_alone), no draft tokens and no tree."""
    return config.target_alone() if config.is_target_alone(has_draft) else config


class _StopFilter:
    """Holds back text that could be the start of a stop string; cuts at the first stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        self.held += text
        if not self.stops:
            out, self.held = self.held, ""
            return out
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.held = self.held[: min(hits)], ""
            return out
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class StopScanner:
    """A follower of the target's sequence (localspec.llama.sequence.Follower): the text of the tokens
    generated since the prompt, cut at the first stop string. :meth:`take` hands out each token
    with its text once; tokens rolled back before they were taken are forgotten. With `calls`
    (the ids of <tool_call> and </tool_call>), stop strings apply to the text outside tool
    calls only: a call's JSON is the grammar's, not the answer's text; so with `json_calls`, to
    an answer that is a call written as plain JSON (its start is held back while it may be)."""

    def __init__(self, target: Model, stops: Sequence[str], calls: tuple[int, int] | None = None,
                 json_calls: JsonCalls | None = None) -> None:
        self.target = target
        self.stops = tuple(stops)
        self.calls = calls
        self.json_calls = json_calls
        self.reset(())

    def reset(self, tokens: Sequence[int]) -> None:
        """A new prompt: nothing generated yet."""
        self.generated: list[int] = []
        self._pieces: list[tuple[int, str]] = []  # (token, text) of generated tokens, up to a stop string
        self._taken = 0
        self._detok = self.target.detokenizer()
        self._filter = _StopFilter(self.stops)
        self._in_call = False
        self._start: str | None = "" if self.json_calls is not None and self.stops else None  # held back
        self._in_json = False  # the answer is a call written as plain JSON

    @property
    def stopped(self) -> bool:
        return self._filter.stopped

    def commit(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            self.generated.append(tok)
            if self.stopped:
                continue  # past a stop string: no text
            if self.target.is_eog(tok):
                text = ""
            elif self.calls is not None and (self._in_call or tok == self.calls[0]):
                # a call opens: the text held back before it can no longer start a stop string
                text = ("" if self._in_call else self._release_start() + self._filter.flush()) + self._detok.add(tok)
                self._in_call = tok != self.calls[1]
            elif self._in_json:
                text = self._detok.add(tok)
            elif self._start is not None:
                text = self._watch_start(self._detok.add(tok))
            else:
                text = self._filter.push(self._detok.add(tok))
            self._pieces.append((tok, text))

    def _watch_start(self, text: str) -> str:
        """The answer's start, kept from the stop strings while it may be a call written as plain
        JSON (then all of it is)."""
        start, self._start, calls = (self._start or "") + text, None, self.json_calls
        if calls is not None and calls.opens(start):
            self._in_json = True
            return start
        if calls is not None and calls.may_open(start):
            self._start = start
            return ""
        return self._filter.push(start)

    def _release_start(self) -> str:
        start, self._start = self._start or "", None
        return self._filter.push(start) if start and not self.stopped else ""

    def rollback(self, n: int) -> None:
        keep = self.generated[: len(self.generated) - n]
        if len(keep) < self._taken:
            raise RuntimeError(f"cannot withdraw {n} tokens: their text was already handed out")
        taken = self._taken
        self.reset(())
        self.commit(keep)  # the same tokens give the same text
        self._taken = taken

    def take(self) -> list[tuple[int, str]]:
        """The (token, text) pairs committed since the last call, up to the one that stopped."""
        out = self._pieces[self._taken:]
        self._taken = len(self._pieces)
        return out

    def flush(self) -> str:
        """Text held back (a possible start of a stop string, an incomplete character)."""
        if self.stopped:
            return ""
        if self._in_json:
            return self._detok.flush()
        return self._release_start() + self._filter.push(self._detok.flush()) + self._filter.flush()


def _check_arguments(target: Any, draft: Any, config: Any, profiles: Any) -> None:
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
        raise ConfigError(f"profiles must be a localspec.decoding.profiles.Profiles (or None), got {type(profiles).__name__}",
                          "profiles")


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
    beside the context where that pays; this generation is added to it when it ends."""

    def __init__(self, target: Model, draft: Model | None, prompt: Prompt, config: GenerationConfig,
                 profiles: Profiles | None = None, prompt_cache: PromptCacheSetting = None,
                 tools: ToolSet | None = None, history: History | None = None) -> None:
        _check_arguments(target, draft, config, profiles)
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
        if len(self.prompt) >= target.n_ctx:
            raise PromptError(f"the prompt has {len(self.prompt)} tokens but the context holds {target.n_ctx}; "
                             "shorten the prompt or raise --ctx-size")
        self.history = history
        drafters = make_drafters(target, draft, self.config, history)
        self.engine = Engine(target, drafters, self.config, self.profiles)
        self._models = [m for m in (target, draft) if m is not None]
        parser = self._parser
        self.scanner = StopScanner(target, self.config.stop, parser.tokens if parser else None,
                                   parser.json_calls if parser else None)
        self.restored = 0  # prompt tokens restored from the prompt cache
        self.restore_seconds = 0.0  # restoring the prompt's saved prefix (target and draft)
        self.save_seconds = 0.0  # saving the prompt's state (and the draft's at the end)

    def __iter__(self) -> Iterator[Response]:
        with contextlib.ExitStack() as held:
            for model in self._models:  # one generation at a time per model: its KV cache is one state
                held.enter_context(model.in_use())
            followers = self.target.sequence.followers
            followers.append(self.scanner)  # follows the committed tokens from the prompt on
            held.callback(followers.remove, self.scanner)
            held.callback(self.engine.close)  # a constraint's grammar stops following the target
            self._start()
            try:
                yield from self._responses()
            except GeneratorExit:  # the caller stopped between steps: the caches are consistent
                if not sys.is_finalizing():  # a generator left open at exit: nothing to save then
                    self._finish()
                raise
            self._finish()

    def prime(self) -> bool:
        """The prompt into the target's cache and the prompt cache, without generating (a chat's
        /save: the conversation's state is kept for --resume); whether the prompt cache holds it."""
        with contextlib.ExitStack() as held:
            for model in self._models:
                held.enter_context(model.in_use())
            held.callback(self.engine.close)
            self._start()
        cache = self.prompt_cache
        return cache is not None and cache.keeps(self.target, len(self.prompt) - 1)

    @property
    def call_cut_off(self) -> bool:
        """Whether the answer ended inside a tool call (which is then not reported; the calls
        completed before it are)."""
        return self._parser is not None and self._parser.writing

    def _start(self) -> None:
        """The prompt into the target's cache: restored from the prompt cache as far as it has it
        (the draft model's too, when it is loaded), the rest prefilled, then saved for later runs."""
        cache, state = self.prompt_cache, self.engine.state
        t0 = time.perf_counter()
        if cache is not None:
            self.restored = state.restore(cache, self.prompt)
        t1 = time.perf_counter()
        self.engine.start(self.prompt)
        t2 = time.perf_counter()
        if cache is not None:
            cache.save(self.target, self.prompt)  # the prefill decoded all of it
        self.restore_seconds, self.save_seconds = t1 - t0, time.perf_counter() - t2

    def _save_draft(self) -> None:
        """The draft's state of what it caught up on (see PairState.save_draft)."""
        if self.prompt_cache is not None:
            t0 = time.perf_counter()
            self.engine.state.save_draft(self.prompt_cache, self.prompt)
            self.save_seconds += time.perf_counter() - t0

    def _finish(self) -> None:
        if self.history is not None:  # later calls of this target may draft from it
            self.history.add(self.engine.tokens)
        self._save_draft()
        self.engine.finish()
        if self._owns_profiles:
            self.profiles.save()  # what this generation measured, for the next run

    def _responses(self) -> Iterator[Response]:
        engine, scanner = self.engine, self.scanner
        while True:
            new = engine.step()
            if not new:  # the context is full
                yield self._response(scanner.flush(), None, "length")
                return
            pieces = scanner.take()  # what the step committed, cut after a stop string
            for i, (tok, text) in enumerate(pieces):
                last = i == len(pieces) - 1
                finish = "stop" if last and scanner.stopped else engine.finish_reason if i == len(new) - 1 else None
                if finish and not scanner.stopped:
                    text += scanner.flush()
                yield self._response(text, tok, finish, drafted=i < engine.speculated)
                if finish:
                    return

    def _response(self, text: str, token: int | None, finish: str | None, drafted: bool = False) -> Response:
        """The Response of one token; with tools, its content and, at the end, the calls made
        (finish_reason "tool_calls" only when every call is complete; with "length", the calls
        completed before the limit: a call cut off is never reported, nor one completed lost)."""
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
            elif finish == "length":
                calls = tuple(parser.calls)
        return Response(text, token, finish, engine.stats(), satisfied, content, calls, drafted)


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
    return ToolCallParser(*call_tokens(target), tools.json_calls)


def _with_tools(config: GenerationConfig, tools: ToolSet) -> GenerationConfig:
    """The config with the grammar of the answer under the tool choice (tool_choice "none" with
    a response format keeps that format)."""
    if config.constraint is not None:
        if tools.calls_allowed:
            raise ConfigError(f"{config.constraint.describe()} cannot be combined with tool calls; send "
                              "tool_choice \"none\" to answer in that format, or leave it out", "tools")
        return config
    return dataclasses.replace(config, constraint=tools.constraint())


def stream_generate(target: Model, draft: Model | None, prompt: Prompt, config: GenerationConfig | None = None,
                    *, profiles: Profiles | None = None, prompt_cache: PromptCacheSetting = None,
                    tools: Sequence[dict] | ToolSet | None = None, tool_choice: Any = None,
                    parallel_tool_calls: bool | None = None, history: History | None = None,
                    **options: Any) -> Iterator[Response]:
    """Yield one Response per generated token; the last one carries the finish reason.

    Settings come from `config` and/or the flat keywords of the CLI flags (max_tokens,
    temperature, top_k, top_p, min_p, seed, verifier, num_draft_tokens, paths, tree, drafter, plan,
    lenience, stop); they are checked here, before the first token (ConfigError; PromptError for the prompt).
    Structured output: at most one of response_format (OpenAI's: {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}), json_schema (a schema),
    regex, grammar (GBNF, or Lark when it starts with %llguidance); a schema or grammar that cannot
    be enforced is a ConfigError here, naming the setting. The last Response's
    constraint_satisfied says whether the text is complete (finish_reason "length": truncated).
    plan="auto" (default) drafts at most num_draft_tokens levels and picks each step's depth, or
    no speculation at all, from measured step costs and acceptance; plan="fixed" always drafts
    the full shape. `profiles`: the cost profiles to plan with; `prompt_cache`: a directory,
    "off", or the default (LOCALSPEC_PROMPT_CACHE, else the user cache) (see Generation).
    Tool calling: `tools` (OpenAI's tool definitions, with a chat prompt), `tool_choice` ("auto",
    "none", "required" or {"type": "function", "function": {"name": ...}}) and
    `parallel_tool_calls`; the last Response has finish_reason "tool_calls" and the calls in
    `tool_calls` when the model called tools (finish_reason "length": the calls it completed
    before the limit), and `content` is the text without the call markup. `history`: a
    localspec.decoding.history.History of earlier calls of this target to draft from (an app
    making many calls keeps one per target; see Generation)."""
    toolset = tools if isinstance(tools, ToolSet) else ToolSet.parse(tools, tool_choice, parallel_tool_calls)
    return iter(Generation(target, draft, prompt, GenerationConfig.from_options(config, **options), profiles,
                           prompt_cache, toolset, history))


def generate(target: Model, draft: Model | None, prompt: Prompt, config: GenerationConfig | None = None,
             *, profiles: Profiles | None = None, prompt_cache: PromptCacheSetting = None,
             history: History | None = None, **options: Any) -> str:
    """The whole completion as a string (see stream_generate for the settings; with tools, use
    stream_generate, whose last Response carries the calls)."""
    return "".join(r.text for r in stream_generate(target, draft, prompt, config, profiles=profiles,
                                                   prompt_cache=prompt_cache, history=history, **options))
