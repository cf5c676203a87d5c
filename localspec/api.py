"""Python API: load models, then stream or generate text with speculative decoding.

    from localspec import load_model, default_pair, stream_generate, generate

    target, draft = default_pair()                 # fetches the Qwen2.5-Coder pair on first use
    for r in stream_generate(target, draft, "def fib(n):", max_tokens=64):
        print(r.text, end="", flush=True)
    print(r.stats.block_efficiency, r.stats.tokens_per_second)

``draft=None`` loads no draft model: the n-gram drafter (``drafter="auto"`` or ``"ngram"``) still
drafts from the context. ``num_draft_tokens=0`` decodes with the target alone through the same
code path (the baseline).
Keyword names equal the CLI flags. As in mlx-lm, :class:`~localspec.generation.Generation` is the
eager set-up (it validates the settings, tokenizes the prompt and builds the engine, so bad input
raises at once) and iterating over it runs the generation; ``stream_generate`` and ``generate``
wrap it, ``astream_generate`` and ``agenerate`` are the same for an event loop.

Several threads (or tasks) may generate on one loaded pair at once: each generation is a slot of
the target's scheduler (localspec.decoding.scheduler), which batches every slot's step into one
decode (``parallel`` slots per loaded model, default 4; more wait). A ``cancel`` event (anything
with ``is_set()``) stops a generation from any thread, within one step, and within a graph node
during its prompt's prefill; its last response then has finish_reason ``"cancelled"``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from localspec.decoding.history import History
from localspec.decoding.profiles import Profiles
from localspec.generation import (
    END,
    CancelEvent,
    Generation,
    PromptCacheSetting,
    Response,
    applied_config,
    prompt_cache_of,
)
from localspec.llama.model import Model
from localspec.loading import load_model, load_pair
from localspec.prompt import Prompt
from localspec.settings.generation import GenerationConfig
from localspec.settings.models import PairOptions
from localspec.tools import ToolSet

log = logging.getLogger(__name__)

__all__ = ["Generation", "Response", "agenerate", "applied_config", "astream_generate", "default_pair", "generate",
           "load_model", "prompt_cache_of", "stream_generate"]


def default_pair(*, draft_n_gpu_layers: int | None = None, draft_rpc: str | None = None,
                 progress: Callable[[float], Any] | None = None, **options: Any) -> tuple[Model, Model]:
    """The default (target, draft) pair of the registry, fetched if needed. Options as for load_model
    (`progress`: one fraction 0 to 1 over the downloads and both loads, each part by its bytes);
    draft_n_gpu_layers defaults to n_gpu_layers; the draft stays on this machine unless draft_rpc
    names RPC servers for it (rpc= applies to the target)."""
    pair = PairOptions.from_flags({**options, "draft_n_gpu_layers": draft_n_gpu_layers, "draft_rpc": draft_rpc})
    loaded = load_pair(None, None, pair, progress=progress)
    return loaded.target, loaded.draft


def generation(target: Model, draft: Model | None, prompt: Prompt, config: GenerationConfig | None = None,
               *, profiles: Profiles | None = None, prompt_cache: PromptCacheSetting = None,
               tools: Sequence[dict] | ToolSet | None = None, tool_choice: Any = None,
               parallel_tool_calls: bool | None = None, history: History | None = None,
               cancel: CancelEvent | None = None, **options: Any) -> Generation:
    """The Generation stream_generate and astream_generate run (its settings checked now)."""
    toolset = tools if isinstance(tools, ToolSet) else ToolSet.parse(tools, tool_choice, parallel_tool_calls)
    return Generation(target, draft, prompt, GenerationConfig.from_options(config, **options), profiles,
                      prompt_cache, toolset, history, cancel)


def stream_generate(target: Model, draft: Model | None, prompt: Prompt, config: GenerationConfig | None = None,
                    *, profiles: Profiles | None = None, prompt_cache: PromptCacheSetting = None,
                    tools: Sequence[dict] | ToolSet | None = None, tool_choice: Any = None,
                    parallel_tool_calls: bool | None = None, history: History | None = None,
                    cancel: CancelEvent | None = None, **options: Any) -> Iterator[Response]:
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
    making many calls keeps one per target; see Generation). `cancel`: anything with is_set()
    (a threading.Event): set from any thread, it stops the generation within one step (within a
    graph node during the prompt's prefill); the last Response then has finish_reason
    "cancelled" and the text held back until then."""
    return iter(generation(target, draft, prompt, config, profiles=profiles, prompt_cache=prompt_cache, tools=tools,
                           tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, history=history,
                           cancel=cancel, **options))


def generate(target: Model, draft: Model | None, prompt: Prompt, config: GenerationConfig | None = None,
             *, profiles: Profiles | None = None, prompt_cache: PromptCacheSetting = None,
             history: History | None = None, cancel: CancelEvent | None = None, **options: Any) -> str:
    """The whole completion as a string (see stream_generate for the settings; with tools, use
    stream_generate, whose last Response carries the calls)."""
    return "".join(r.text for r in stream_generate(target, draft, prompt, config, profiles=profiles,
                                                   prompt_cache=prompt_cache, history=history, cancel=cancel,
                                                   **options))


async def astream_generate(target: Model, draft: Model | None, prompt: Prompt, config: GenerationConfig | None = None,
                           **keywords: Any) -> AsyncIterator[Response]:
    """stream_generate for an event loop (same arguments): an async iterator of the same
    responses. The set-up runs in a worker thread (a grammar may take a second to compile); the
    steps run on the target's scheduler, whose thread hands each response to this loop: the loop
    is never blocked by decoding, and several tasks generate on one pair at once. Cancelling the
    task that iterates (or leaving the loop early) stops the generation as `cancel` does."""
    loop = asyncio.get_running_loop()
    gen = await asyncio.to_thread(generation, target, draft, prompt, config, **keywords)
    events: asyncio.Queue[Any] = asyncio.Queue()

    def sink(event: Any) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody reads any more
            gen.stop()

    gen.submit(sink)
    ended = False
    try:
        while True:
            event = await events.get()
            if event is END:
                ended = True
                return
            if isinstance(event, BaseException):
                ended = True
                raise event
            yield event
    finally:
        if not ended:
            gen.stop()


async def agenerate(target: Model, draft: Model | None, prompt: Prompt, config: GenerationConfig | None = None,
                    **keywords: Any) -> str:
    """generate for an event loop (see astream_generate): the whole completion as a string."""
    return "".join([r.text async for r in astream_generate(target, draft, prompt, config, **keywords)])
