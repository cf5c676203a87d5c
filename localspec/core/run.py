"""Running a call (:class:`~localspec.core.calls.Request`) on the core: the settings checked and
the constraint compiled before anything loads, the pair leased, the generation streamed as
events, its cancellation checked between steps (:func:`run`). The resident service runs it for
its clients, :class:`LocalCall` in the calling process (``--keep-alive 0``, RPC servers): the
same code and the same events, so a call's output, errors and exit status do not depend on
where it ran.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from localspec.core.calls import Done, Failed, Note, Ready, Request, Text
from localspec.core.cancel import STOPS, Cancel, Cancelled
from localspec.core.residency import Residency
from localspec.errors import ConfigError, LocalspecError, ModelError
from localspec.loading import Loaded, draft_loading
from localspec.settings.generation import GenerationConfig, describe_speculation

log = logging.getLogger(__name__)

Emit = Callable[[Any], None]


def failed(exc: BaseException) -> Failed:
    """An error as the event that carries it (its class of localspec.errors, by name)."""
    if isinstance(exc, LocalspecError):
        return Failed(type(exc).__name__, str(exc), getattr(exc, "param", None))
    return Failed("LocalspecError", f"internal error: {type(exc).__name__}: {exc}")


def run(residency: Residency, request: Request, cancel: Cancel, emit: Emit) -> None:
    """Run one call, emitting its events; the last is Done or Failed. Never raises: an error is a
    Failed event (one that is no fault of the call is logged with its traceback first)."""
    try:
        _HANDLERS[request.kind](residency, request, cancel, emit)
    except Cancelled:
        emit(Done(model=request.pair.target_name, stopped=_stopped(cancel)))
    except LocalspecError as exc:
        emit(failed(exc))
    except Exception as exc:  # noqa: BLE001 - a bug: logged, and the call still ends with an answer
        log.exception("the call failed")
        emit(failed(exc))


def _stopped(cancel: Cancel) -> str | None:
    """How a stopped call ends for its user: as after Ctrl-C when the service ended it."""
    reason = cancel.reason
    return reason if reason in STOPS else "interrupted" if reason == "ending" else None


# ---------------------------------------------------------------- the parts of a call


def _config(request: Request) -> GenerationConfig:
    """The call's settings, its constraint compiled now (a ConfigError naming it, before any load)."""
    config = GenerationConfig.from_options(**request.settings)
    if config.constraint is not None:
        from localspec.decoding.grammar.compiler import compile_constraint

        compile_constraint(config.constraint)
    return config


def _tools(request: Request) -> Any:
    """The call's ToolSet (None: no tools), checked and its schemas compiled."""
    if request.tools is None:
        return None
    from localspec.tools import ToolSet

    t = request.tools
    return ToolSet.parse(t.tools, t.tool_choice, t.parallel_tool_calls)


@contextlib.contextmanager
def _lease(residency: Residency, request: Request, config: GenerationConfig, cancel: Cancel, emit: Emit,
           grammar: bool = False) -> Iterator[Loaded]:
    """The call's pair, leased from the residency (the draft as draft_loading says)."""
    need, lazy = draft_loading(config.drafter, draft_named=False)
    with residency.lease(request.pair, cancel, need_draft=need, lazy_draft=lazy,
                         grammar=grammar or request.grammar or config.constraint is not None,
                         keep_alive=request.keep_alive, max_loaded=request.max_loaded,
                         notify=lambda text: emit(Note(text))) as loaded:
        if cancel.is_set():
            raise Cancelled(cancel.reason)
        yield loaded


def _message(request: Request, target: Any, tools: Any) -> Any:
    """What to generate from: the text as it is, or wrapped in the model's chat template (with
    the system message first) when the call asks for that and the model has one (or tools)."""
    prompt = request.prompt
    if prompt.messages is not None:
        return prompt.messages
    if prompt.system is not None and not target.chat_template:
        raise ConfigError(f"{request.pair.target.name} has no chat template, so a system message cannot be given; "
                          "put the text in the prompt", "system")
    if prompt.chat and (target.chat_template or tools is not None):
        system = [{"role": "system", "content": prompt.system}] if prompt.system else []
        return system + [{"role": "user", "content": prompt.text or ""}]
    return prompt.text or ""


def shared_history(residency: Residency, spec: Any, config: GenerationConfig) -> Any:
    """The earlier calls of the pair's target to draft from: with plan "auto" only. A fixed plan's
    drafts (and so its random draws) then depend on nothing but the call itself, so a seeded call
    repeats whatever the pair served before it."""
    return residency.history(spec) if config.plan == "auto" else None


def timings(loaded: Loaded, stats: Any, profile_io: float, prompt_cache: tuple[float, float]) -> dict[str, Any]:
    """Where a call's time went (seconds; `profile_io`: reading and writing cost profiles;
    `prompt_cache`: restoring and saving the prompt's state). The command line adds when it
    started, a service its own time for the call."""
    draft_load = loaded.load_seconds[1]
    if draft_load is None:
        draft_load = getattr(loaded.draft, "load_seconds", None)  # a lazy draft the planner loaded
    return {"target_load": loaded.load_seconds[0], "draft_load": draft_load, "profile_io": profile_io,
            "prompt_cache_restore": prompt_cache[0], "prompt_cache_save": prompt_cache[1],
            "prefill": stats.prompt_seconds if stats is not None else 0.0,
            "decode": stats.elapsed_seconds if stats is not None else 0.0}


# ---------------------------------------------------------------- the kinds of call


def _generate(residency: Residency, request: Request, cancel: Cancel, emit: Emit) -> None:
    """Generate text from the call's prompt, streaming it."""
    from localspec.api import Generation

    config, tools = _config(request), _tools(request)
    with _lease(residency, request, config, cancel, emit, grammar=tools is not None and tools.calls_allowed) as loaded:
        profiles = residency.profiles(request.profiles)
        io_before = profiles.io_seconds
        cache = residency.prompt_cache(request.prompt_cache, request.prompt_cache_limit)
        generation = Generation(loaded.target, loaded.draft, _message(request, loaded.target, tools), config,
                                profiles, prompt_cache=cache or False, tools=tools,
                                history=shared_history(residency, request.pair, config), cancel=cancel)
        last, error = _stream(generation, emit)
        profiles.save()
        speculative = not generation.config.is_target_alone(loaded.draft is not None)
        stats = last.stats if last is not None else None
        emit(Done(model=loaded.target_name, finish_reason=_finish_reason(last),
                  stats=stats, settings=generation.config.options(), prompt_tokens=len(generation.prompt),
                  constraint_satisfied=last.constraint_satisfied if last is not None else None,
                  tool_calls=([c.as_dict() for c in last.tool_calls] if last is not None else [])
                  if tools is not None else None,
                  call_cut_off=generation.call_cut_off, speculative=speculative,
                  one_token_seconds=profiles.one_token_seconds(loaded.target) if speculative else 0.0,
                  timings=timings(loaded, stats, profiles.io_seconds - io_before,
                                  (generation.restore_seconds, generation.save_seconds)),
                  stopped=_stopped(cancel) if cancel.is_set() else None,
                  error=failed(error) if error is not None else None))


def _stream(generation: Any, emit: Emit) -> tuple[Any, BaseException | None]:
    """Run the generation, a Text event per piece (it stops within a step once its cancel is
    set: its last response says "cancelled"). The last Response and an error that ended it after
    some output (one before any output is raised: nothing was generated)."""
    last = None
    stream = iter(generation)
    try:
        for r in stream:
            last = r
            if r.content:
                emit(Text(r.content, r.drafted))
    except LocalspecError as exc:
        if last is None:
            raise
        return last, exc
    finally:
        stream.close()
    return last, None


def _finish_reason(last: Any) -> str | None:
    """How the generation ended, as a Done event says it (None: it was stopped; Done.stopped says why)."""
    if last is None or last.finish_reason == "cancelled":
        return None
    return last.finish_reason


def _open(residency: Residency, request: Request, cancel: Cancel, emit: Emit) -> None:
    """A chat begins: its pair loaded, its settings checked against it (Ready describes it)."""
    from localspec.api import Generation

    config = _config(request)
    with _lease(residency, request, config, cancel, emit) as loaded:
        target = loaded.target
        if not target.chat_template:
            raise ModelError(f"{target.path.name} has no chat template, so it cannot chat; for plain text completion "
                             f"use: localspec generate --raw -m {target.path}")
        system = request.prompt.system
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": ""}]
        applied = Generation(target, loaded.draft, messages, config, residency.profiles(request.profiles)).config
        draft_name = loaded.draft.name if loaded.draft is not None else None
        emit(Ready(target.name, draft_name, target.n_ctx, describe_speculation(applied, draft_name)))
        emit(Done(model=loaded.target_name, settings=applied.options(),
                  speculative=not applied.is_target_alone(loaded.draft is not None),
                  timings={"target_load": loaded.load_seconds[0]}))


def _keep(residency: Residency, request: Request, cancel: Cancel, emit: Emit) -> None:
    """A chat's /save: the conversation's state into the prompt cache (for --resume)."""
    from localspec.api import Generation

    config = _config(request)
    with _lease(residency, request, config, cancel, emit) as loaded:
        cache = residency.prompt_cache(request.prompt_cache, request.prompt_cache_limit)
        kept = False
        if cache is not None and request.prompt.messages:
            generation = Generation(loaded.target, loaded.draft, request.prompt.messages, config,
                                    residency.profiles(request.profiles), prompt_cache=cache)
            kept = generation.prime()
        emit(Done(model=loaded.target_name, kept=kept))


_HANDLERS: dict[str, Callable[[Residency, Request, Cancel, Emit], None]] = {
    "generate": _generate, "open": _open, "keep": _keep}


# ---------------------------------------------------------------- a call in this process


class LocalCall:
    """A call run in this process, on a residency of its own or one it is given (a chat's, kept
    for the session): in a worker thread, so that the main thread stays free for Ctrl-C and
    SIGTERM while it loads and generates. Iterate over :meth:`events`; :meth:`cancel` stops it."""

    resident = False

    def __init__(self, request: Request, residency: Residency | None = None) -> None:
        self.own = residency is None
        self.residency = residency or Residency()
        self.cancel_event = Cancel()
        self._events: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(request,), name="localspec-call", daemon=True)
        self._thread.start()

    def _run(self, request: Request) -> None:
        try:
            run(self.residency, request, self.cancel_event, self._events.put)
        finally:
            if self.own:
                self.residency.close()
            self._events.put(None)

    def events(self) -> Iterator[Any]:
        """The call's events as they come (the main thread waits in short slices: signals run)."""
        while True:
            try:
                event = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            if event is None:
                return
            yield event

    def cancel(self, reason: str) -> None:
        self.cancel_event.set(reason)

    def abandon(self, code: int) -> None:
        """The user stopped the call before its output: leave now. A load or prefill in the worker
        cannot be stopped half-way, and a process must not finalise under it: exit at once."""
        self.cancel("interrupted")
        self._thread.join(0.05)
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def close(self) -> None:
        self._thread.join()


