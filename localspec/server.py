"""An OpenAI-compatible HTTP server (Starlette + uvicorn, the optional extra ``localspec[server]``).

    GET  /v1/models             the loaded model
    POST /v1/chat/completions   messages -> chat.completion (or chat.completion.chunk events)
    POST /v1/completions        prompt   -> text_completion (or text_completion events)

One target/draft pair is loaded once and shared. Requests queue for a single worker thread, so
only one generation touches the models at a time while the event loop stays responsive; a
client that disconnects stops its generation between steps. Speculative settings are extension
parameters of the request body (``extra_body`` in the openai client): top_k, min_p, verifier,
num_draft_tokens, paths, tree, drafter, plan. Every response carries a ``speculative`` object
with the settings used and the acceptance statistics.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import math
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence

import click

from localspec import __version__
from localspec.api import DRAFTERS, Response, stream_generate, target_alone_without_draft
from localspec.engine import PLANS, ConfigError, GenerationStats, SpecConfig
from localspec.model import Model, ModelError
from localspec.verifier import METHODS as VERIFIERS, VerifierError

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response as HTTPResponse

log = logging.getLogger(__name__)

USER_ERRORS = (ConfigError, ModelError, VerifierError)
FINGERPRINT = f"localspec-{__version__}"
ROUTES_HELP = "GET /v1/models, POST /v1/chat/completions, POST /v1/completions"
# settings a request may leave out; the serve command replaces them with its options
BUILTIN_DEFAULTS: dict[str, Any] = dict(
    max_tokens=256, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=None, verifier="block",
    num_draft_tokens=4, paths=1, tree=None, drafter="model", plan="auto")
# OpenAI parameters this server cannot honour: accepted only at their no-op values
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "best_of": lambda v: v in (None, 1),
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v,
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
}


def require_server_deps() -> None:
    """Raise a click error naming the extra to install when Starlette or uvicorn is missing."""
    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise click.ClickException(f"the server needs {' and '.join(missing)}: "
                                   "pip install 'localspec[server]'")


# ---------------------------------------------------------------- request parsing


class RequestError(ValueError):
    """A bad request: an OpenAI-style error with the HTTP status and the parameter at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True)
class GenRequest:
    """A parsed completion request."""

    chat: bool
    prompt: Any  # a string, a list of token ids, or chat messages
    settings: dict  # keyword arguments of stream_generate
    stream: bool = False
    include_usage: bool = False


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(body: dict, name: str, default: Any, *, low: float | None = None, high: float | None = None,
            low_open: bool = False, integer: bool = False, what: str = "") -> Any:
    """body[name] checked to be a (finite, integer) number in range; default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    rng = what or (f">= {low}" if high is None else f"in {'(' if low_open else '['}{low}, {high}]")
    ok = _is_number(value) and math.isfinite(value) and (not integer or float(value).is_integer())
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        raise RequestError(f"'{name}' must be {kind} {rng}, got {value!r}", name)
    return int(value) if integer else float(value)


def _choice(body: dict, name: str, default: str, choices: Sequence[str]) -> str:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str) or value not in choices:
        raise RequestError(f"'{name}' must be one of {', '.join(choices)}, got {value!r}", name)
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false, got {value!r}", name)
    return value


def parse_tree(value: Any, param: str = "tree") -> tuple[int, ...] | None:
    """A draft tree as a list of branching factors ([3, 2, 1]) or a string ("3x2x1")."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = [int(x) for x in value.lower().replace(",", "x").split("x")]
        except ValueError:
            raise RequestError(f"'{param}' {value!r} is not a branching list such as \"3x2x1\" or [3, 2, 1]",
                               param) from None
    if not isinstance(value, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in value):
        raise RequestError(f"'{param}' must be a list of integers such as [3, 2, 1] or a string such as "
                           f"\"3x2x1\", got {value!r}", param)
    if any(b < 1 for b in value):
        raise RequestError(f"'{param}': every branching factor must be >= 1, got {value!r}", param)
    return tuple(value)


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise RequestError(f"'stop' must be a string or a list of strings, got {value!r}", "stop")


def _seed(body: dict, default: int | None) -> int | None:
    seed = _number(body, "seed", default, low=-1, integer=True,
                   what=">= 0 (or -1 or null for a random seed)")
    return None if seed is None or seed < 0 else seed


def _check_unsupported(body: dict) -> None:
    for name, is_noop in UNSUPPORTED.items():
        if name in body and not is_noop(body[name]):
            raise RequestError(f"'{name}' is not supported by localspec's server", name)
    n = body.get("n")
    if n is not None and (not _is_number(n) or n != 1):
        raise RequestError(f"'n' must be 1 (one completion per request), got {n!r}", "n")


def _content(value: Any, where: str) -> str:
    """A message's content: a string or a list of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise RequestError(f"'{where}' must be a string or a list of text parts "
                       f"({{\"type\": \"text\", \"text\": ...}}), got {value!r}", where)


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("'messages' is required: a list of {\"role\": ..., \"content\": ...} objects",
                           "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"'messages' must be a non-empty list of {{\"role\", \"content\"}} objects, "
                           f"got {messages!r}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"'messages[{i}]' must be an object with 'role' and 'content', got {m!r}",
                               f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"'messages[{i}].role' must be a non-empty string, got {role!r}",
                               f"messages[{i}].role")
        out.append({"role": role, "content": _content(m.get("content"), f"messages[{i}].content")})
    return out


def parse_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("'prompt' is required: a string", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)  # token ids
    raise RequestError(f"'prompt' must be a string (or a list of token ids), got {prompt!r}", "prompt")


def parse_settings(body: dict, defaults: dict, *, draft_loaded: bool, n_batch: int) -> dict:
    """Keyword arguments of stream_generate from the request body and the server defaults."""
    d = {**BUILTIN_DEFAULTS, **defaults}
    max_tokens = _number(body, "max_completion_tokens", None, low=1, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", d["max_tokens"], low=1, integer=True)
    settings = dict(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", d["temperature"], low=0, what=">= 0 (0: greedy)"),
        top_k=_number(body, "top_k", d["top_k"], low=0, integer=True, what=">= 0 (0: off)"),
        top_p=_number(body, "top_p", d["top_p"], low=0, high=1, low_open=True),
        min_p=_number(body, "min_p", d["min_p"], low=0, high=1),
        seed=_seed(body, d["seed"]),
        stop=_stop(body),
        verifier=_choice(body, "verifier", d["verifier"], tuple(VERIFIERS)),
        num_draft_tokens=_number(body, "num_draft_tokens", d["num_draft_tokens"], low=0, high=64, integer=True),
        paths=_number(body, "paths", d["paths"], low=1, high=16, integer=True),
        tree=parse_tree(body["tree"]) if body.get("tree") is not None else d["tree"],
        drafter=_choice(body, "drafter", d["drafter"], DRAFTERS),
        plan=_choice(body, "plan", d["plan"], PLANS),
    )
    spec = SpecConfig(verifier=settings["verifier"], num_draft_tokens=settings["num_draft_tokens"],
                      paths=settings["paths"], tree=settings["tree"], plan=settings["plan"])
    try:
        spec.validate(settings["drafter"], n_batch)
    except ConfigError as exc:
        raise RequestError(str(exc), _config_param(str(exc))) from None
    return target_alone_without_draft(settings, draft_loaded)


def _config_param(message: str) -> str | None:
    """The request parameter a ConfigError message is about (best effort)."""
    for name in ("verifier", "tree", "paths", "num_draft_tokens", "drafter", "plan"):
        if name in message:
            return name
    return None


def parse_request(body: Any, *, chat: bool, defaults: dict, draft_loaded: bool, n_batch: int) -> GenRequest:
    """Validate a /v1/chat/completions or /v1/completions body; RequestError names what is wrong."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError(f"'model' must be a string, got {body['model']!r}", "model")
    _check_unsupported(body)
    prompt = parse_messages(body) if chat else parse_prompt(body)
    settings = parse_settings(body, defaults, draft_loaded=draft_loaded, n_batch=n_batch)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object, got {options!r}", "stream_options")
    include_usage = _bool(options or {}, "include_usage")
    return GenRequest(chat, prompt, settings, _bool(body, "stream"), include_usage)


# ---------------------------------------------------------------- the worker


@dataclass
class Job:
    """One generation: the worker thread emits ("token", Response), ("error", exc), then ("end", None)
    into the event loop's queue; setting `cancel` stops it between steps."""

    prompt: Any
    settings: dict
    loop: asyncio.AbstractEventLoop
    cancel: threading.Event = field(default_factory=threading.Event)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def emit(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone: nobody is listening
            self.cancel.set()

    async def get(self) -> tuple[str, Any]:
        return await self.events.get()


class ModelWorker:
    """Runs jobs one at a time, in arrival order, on one thread that owns the models."""

    def __init__(self, target: Model, draft: Model | None) -> None:
        self.target = target
        self.draft = draft
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.busy = threading.Lock()  # held while a generation touches the models
        self.finished = 0  # generations run to their end (finish reason or error)
        self.stopped_early = 0  # generations stopped because the client left or the server stops

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed:
                raise RequestError("the server is shutting down", status=503)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="localspec-worker", daemon=True)
                self._thread.start()
            self._jobs.put(job)

    def pending(self) -> int:
        return self._jobs.qsize()

    def stop(self) -> None:
        """Make the running generation end after its current step and refuse queued and new jobs
        (safe in a signal handler: takes no lock)."""
        self._closed = True

    def close(self, timeout: float = 30.0) -> bool:
        """stop(), then wait for the worker thread. True when no generation is running."""
        with self._lock:
            self._closed = True
            thread = self._thread
            self._jobs.put(None)
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("a generation is still running after %.0f s", timeout)
                return False
        return True

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._closed:
                job.emit("error", RequestError("the server is shutting down", status=503))
            elif not job.cancel.is_set():
                with self.busy:
                    self._run(job)
            job.emit("end", None)

    def _run(self, job: Job) -> None:
        stream = stream_generate(self.target, self.draft, job.prompt, **job.settings)
        try:
            for r in stream:
                job.emit("token", r)
                if r.finish_reason is None and (job.cancel.is_set() or self._closed):
                    log.info("generation stopped after %d tokens (client gone or shutdown)",
                             r.stats.generated_tokens)
                    self.stopped_early += 1
                    return
            self.finished += 1
        except USER_ERRORS as exc:
            self.finished += 1
            job.emit("error", exc)
        except Exception as exc:  # noqa: BLE001 - reported to the client as a 500 and logged
            self.finished += 1
            log.exception("generation failed")
            job.emit("error", exc)
        finally:
            stream.close()  # between steps: the engine keeps its KV caches consistent


# ---------------------------------------------------------------- response objects


def speculative_info(settings: dict, stats: GenerationStats) -> dict:
    tree = settings.get("tree")
    return {
        "verifier": settings["verifier"], "drafter": settings["drafter"], "plan": settings["plan"],
        "num_draft_tokens": settings["num_draft_tokens"], "paths": settings["paths"],
        "tree": list(tree) if tree else None,
        "block_efficiency": stats.block_efficiency, "acceptance_rate": stats.acceptance_rate,
        "target_passes": stats.target_passes, "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens, "accept_histogram": list(stats.accept_histogram),
        "verifier_share": stats.verifier_share, "tokens_per_second": stats.tokens_per_second,
    }


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


@dataclass
class Reply:
    """Builds the OpenAI objects of one request."""

    req: GenRequest
    model_id: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.req.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id,
                "system_fingerprint": FINGERPRINT}

    def full(self, text: str, finish: str, stats: GenerationStats) -> dict:
        if self.req.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("chat.completion" if self.req.chat else "text_completion"),
                "choices": [choice], "usage": usage(stats),
                "speculative": speculative_info(self.req.settings, stats)}

    def chunk(self, text: str | None, finish: str | None = None, *, role: bool = False) -> dict:
        if self.req.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        out = {**self._head("chat.completion.chunk" if self.req.chat else "text_completion"), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def final_chunks(self, finish: str, stats: GenerationStats) -> list[dict]:
        spec = speculative_info(self.req.settings, stats)
        last = {**self.chunk(None, finish), "speculative": spec}
        if not self.req.include_usage:
            return [last]
        head = self._head("chat.completion.chunk" if self.req.chat else "text_completion")
        return [last, {**head, "choices": [], "usage": usage(stats), "speculative": spec}]


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


# ---------------------------------------------------------------- the ASGI app


class Disconnected(Exception):
    """The client went away while its request waited or ran."""


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, or raise Disconnected as soon as the client leaves (the body must be read)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise Disconnected


async def _collect(job: Job) -> tuple[list[Response], BaseException | None]:
    """Every event of a job until its end."""
    out: list[Response] = []
    error = None
    while True:
        kind, value = await job.get()
        if kind == "token":
            out.append(value)
        elif kind == "error":
            error = value
        else:
            return out, error


def _error_response(exc: BaseException, produced: bool, chat: bool) -> HTTPResponse:
    from starlette.responses import JSONResponse

    if isinstance(exc, RequestError):
        return JSONResponse(error_body(str(exc), exc.param), status_code=exc.status)
    if isinstance(exc, USER_ERRORS) and not produced:
        message = str(exc)
        param = ("messages" if chat else "prompt") if ("prompt" in message or "chat" in message) \
            else _config_param(message)
        return JSONResponse(error_body(message, param), status_code=400)
    return JSONResponse(error_body(f"generation failed: {exc}", kind="server_error"), status_code=500)


def _sse_response(job: Job, body: AsyncIterator[bytes]) -> HTTPResponse:
    """A Server-Sent-Events response that stops the job when the client disconnects."""
    import anyio
    from starlette.responses import StreamingResponse

    class SSEResponse(StreamingResponse):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:  # listen for the disconnect whatever ASGI spec version the server speaks
                async with anyio.create_task_group() as tg:
                    async def stream() -> None:
                        with contextlib.suppress(OSError):
                            await self.stream_response(send)
                        tg.cancel_scope.cancel()

                    tg.start_soon(stream)
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()
            finally:
                job.cancel.set()  # a no-op once the generation has ended

    return SSEResponse(body, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(job: Job, first: tuple[str, Any], reply: Reply) -> AsyncIterator[bytes]:
    try:
        if reply.req.chat:
            yield sse(reply.chunk(None, role=True))
        kind, value = first
        last: Response | None = None
        while kind != "end":
            if kind == "token":
                last = value
                if value.text:
                    yield sse(reply.chunk(value.text))
                if value.finish_reason:
                    for chunk in reply.final_chunks(value.finish_reason, value.stats):
                        yield sse(chunk)
            elif kind == "error":
                log.warning("stream of %s ended by an error: %s", reply.id, value)
                kind_name = "invalid_request_error" if isinstance(value, USER_ERRORS) else "server_error"
                yield sse(error_body(str(value), kind=kind_name))
                return
            kind, value = await job.get()
        if last is not None and last.finish_reason is None:  # stopped early (the server shuts down)
            for chunk in reply.final_chunks("length", last.stats):
                yield sse(chunk)
        yield b"data: [DONE]\n\n"
    finally:
        job.cancel.set()


async def _read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None


async def _respond_stream(request: Request, job: Job, reply: Reply) -> HTTPResponse:
    """An SSE response once the first token is there (an error before it: a JSON error response)."""
    first = await _unless_disconnected(request, job.get())
    if first[0] == "error":
        return _error_response(first[1], produced=False, chat=reply.req.chat)
    return _sse_response(job, _events(job, first, reply))


async def _respond_full(request: Request, job: Job, reply: Reply) -> HTTPResponse:
    from starlette.responses import JSONResponse

    responses, error = await _unless_disconnected(request, _collect(job))
    if error is not None or not responses:
        return _error_response(error or RuntimeError("no output"), produced=bool(responses), chat=reply.req.chat)
    last = responses[-1]
    text = "".join(r.text for r in responses)
    # finish_reason None: the server is shutting down and ended the generation early
    return JSONResponse(reply.full(text, last.finish_reason or "length", last.stats))


def create_app(target: Model, draft: Model | None, *, model_id: str, defaults: dict | None = None) -> Starlette:
    """The ASGI app serving one loaded target/draft pair (draft None: target alone or n-gram drafts).
    `defaults`: stream_generate settings for what a request leaves out (max_tokens, temperature,
    top_k, top_p, min_p, seed, verifier, num_draft_tokens, paths, tree, drafter, plan)."""
    require_server_deps()
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response as PlainResponse
    from starlette.routing import Route

    defaults = dict(defaults or {})
    unknown = set(defaults) - set(BUILTIN_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown default settings: {', '.join(sorted(unknown))}")
    if defaults.get("tree") is not None:
        defaults["tree"] = parse_tree(list(defaults["tree"]) if not isinstance(defaults["tree"], str)
                                      else defaults["tree"])
    worker = ModelWorker(target, draft)
    created = int(time.time())

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "localspec"}

    async def list_models(request: Request) -> HTTPResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def get_model(request: Request) -> HTTPResponse:
        name = request.path_params["name"]
        if name != model_id:
            return JSONResponse(error_body(f"model {name!r} does not exist; this server serves {model_id!r}",
                                           "model"), status_code=404)
        return JSONResponse(model_card())

    async def health(request: Request) -> HTTPResponse:
        return JSONResponse({"status": "ok", "model": model_id, "queued": worker.pending(),
                             "busy": worker.busy.locked()})

    async def generate(request: Request, chat: bool) -> HTTPResponse:
        req = parse_request(await _read_json(request), chat=chat, defaults=defaults,
                            draft_loaded=draft is not None, n_batch=target.n_batch)
        reply = Reply(req, model_id)
        job = Job(req.prompt, req.settings, asyncio.get_running_loop())
        worker.submit(job)
        log.info("%s: %s, %d queued", reply.id, "stream" if req.stream else "request", worker.pending())
        try:
            return await (_respond_stream if req.stream else _respond_full)(request, job, reply)
        except Disconnected:
            job.cancel.set()
            log.info("%s: the client disconnected", reply.id)
            return PlainResponse(status_code=499)
        except BaseException:
            job.cancel.set()
            raise

    def endpoint(chat: bool) -> Callable[[Request], Awaitable[HTTPResponse]]:
        async def handle(request: Request) -> HTTPResponse:
            try:
                return await generate(request, chat)
            except RequestError as exc:
                return JSONResponse(error_body(str(exc), exc.param), status_code=exc.status)
            except Exception as exc:  # noqa: BLE001 - a bug, not the client's fault: log it, answer JSON
                return await internal_error(request, exc)
        return handle

    async def http_error(request: Request, exc: Exception) -> HTTPResponse:
        assert isinstance(exc, HTTPException)
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            message = f"unknown route {method} {path}; this server offers {ROUTES_HELP}"
        elif exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            message = f"method {method} is not allowed on {path}" + (f"; use {allow}" if allow else "")
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(message), status_code=exc.status_code, headers=exc.headers)

    async def internal_error(request: Request, exc: Exception) -> HTTPResponse:
        log.error("internal error on %s %s", request.method, request.url.path,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}", kind="server_error"),
                            status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(worker.close)

    app = Starlette(
        routes=[
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{name:path}", get_model, methods=["GET"]),
            Route("/v1/chat/completions", endpoint(True), methods=["POST"]),
            Route("/v1/completions", endpoint(False), methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
    app.state.worker = worker
    app.state.model_id = model_id
    return app


# ---------------------------------------------------------------- running it


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port (port 0: a free one); a click error when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                                   "choose another --port or --host") from None
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def serve(target: Model, draft: Model | None, *, model_id: str, host: str = "127.0.0.1", port: int = 8080,
          defaults: dict | None = None, verbose: bool = False, sock: socket.socket | None = None) -> bool:
    """Serve until interrupted (Ctrl-C: a graceful shutdown, waiting at most 3 s for open requests).
    Returns True when no generation is left running, so the models may be closed."""
    require_server_deps()
    import uvicorn

    app = create_app(target, draft, model_id=model_id, defaults=defaults)
    sock = sock or bind_socket(host, port)
    config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                            lifespan="on", timeout_graceful_shutdown=3)
    worker: ModelWorker = app.state.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            worker.stop()  # open responses end after the current step, with what they have
            super().handle_exit(sig, frame)

    stopped = False
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        sock.close()
        stopped = worker.close()
    return stopped


def model_id_of(name: str) -> str:
    """The id /v1/models reports: a registry name as is, a GGUF path by its file stem."""
    return Path(name).stem if name.lower().endswith(".gguf") else name
