"""The ASGI app: routes, limits, authentication, and errors as OpenAI-style JSON.

Every client is treated as possibly hostile: the body is read with a size and a time limit
before anything else happens, JSON nesting and the number of messages are bounded, the queue in
front of the pair is bounded (its queue on the residency), and every failure is a specific 4xx
(or a logged 500 for a bug), never a generation held hostage. localspec's errors map to HTTP statuses in one
place, :data:`HTTP_STATUS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response as HTTPResponse
from starlette.routing import Route

from localspec.api import Response, applied_config
from localspec.errors import (
    ConfigError,
    DependencyError,
    FetchError,
    LocalspecError,
    ModelError,
    PromptError,
    RemoteError,
    RequestError,
    VerifierError,
)
from localspec.generation import END
from localspec.prompt import Prompt
from localspec.server import ServerLimits, schemas
from localspec.server.jobs import Job, Pair
from localspec.server.responses import ModelCard, ModelList, ResponseBuilder, error_body
from localspec.settings.generation import DEFAULTS, GenerationConfig

log = logging.getLogger(__name__)

PING_SECONDS = 15.0  # a keep-alive comment line (": ping") on a stream quiet this long, for proxies' idle timeouts
STREAM_SHUTDOWN_GRACE = 2.0  # seconds a stream may take to end by itself when the server stops (uvicorn waits 3)
ROUTES_HELP = "GET /v1/models, POST /v1/chat/completions, POST /v1/completions"
HTTP_STATUS: dict[type[LocalspecError], int] = {  # the first class an error is an instance of
    RequestError: 400,  # or the status the error carries
    ConfigError: 400, PromptError: 400,  # settings, prompts and messages the client chose
    RemoteError: 502,  # or the status it carries (503: unreachable): the server's upstream failed
    ModelError: 500, VerifierError: 500, FetchError: 500, DependencyError: 500,  # the server's own failures
}


def status_of(exc: BaseException) -> int:
    if isinstance(exc, (RequestError, RemoteError)):
        return exc.status
    return next((code for cls, code in HTTP_STATUS.items() if isinstance(exc, cls)), 500)


def json_response(body: BaseModel, status_code: int = 200, headers: Mapping[str, str] | None = None) -> HTTPResponse:
    """A JSON response whose body is one of the response models (.responses)."""
    return HTTPResponse(body.model_dump_json(), status_code=status_code, headers=headers,
                        media_type="application/json")


def error_response(exc: BaseException, chat: bool) -> HTTPResponse:
    """An OpenAI-style error response for an exception raised before any output."""
    status = status_of(exc)
    if status >= 500 and not isinstance(exc, RequestError):
        return json_response(error_body(f"generation failed: {exc}", error_type="server_error"), status)
    param = getattr(exc, "param", None)
    if isinstance(exc, PromptError):
        param = exc.param or ("messages" if chat else "prompt")
    return json_response(error_body(str(exc), param), status)


# ---------------------------------------------------------------- reading a request


async def read_body(request: Request, limits: ServerLimits) -> bytes:
    """The body, at most max_body_bytes, within body_timeout seconds (413, 408 otherwise)."""
    declared = request.headers.get("content-length")
    too_big = f"this server takes request bodies of at most {limits.max_body_bytes} bytes (--max-body-bytes)"
    if declared is not None and (not declared.isdigit() or int(declared) > limits.max_body_bytes):
        raise RequestError(f"the request body is {declared} bytes; {too_big}", status=413)
    chunks: list[bytes] = []
    size = 0

    async def collect() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise RequestError(f"the request body is larger than allowed; {too_big}", status=413)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), limits.body_timeout)
    except ClientDisconnect:  # the client's doing, not the server's: no traceback, nobody to answer
        raise RequestError("the client closed the connection before its whole body arrived", status=499) from None
    except asyncio.TimeoutError:
        raise RequestError(f"the request body did not arrive within {limits.body_timeout:g} s", status=408) from None
    return b"".join(chunks)


def nesting(value: Any) -> int:
    """The nesting depth of a parsed JSON value (a scalar is 0, [] or {} is 1)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json(data: bytes, limits: ServerLimits, chat: bool) -> Any:
    too_deep = f"the request body nests deeper than {limits.max_nesting} levels (--max-nesting)"
    try:
        body = schemas.decode_json(data)  # duplicate keys, NaN and Infinity refused
    except RecursionError:
        raise RequestError(too_deep) from None
    except ValueError as exc:  # also bytes that are not UTF-8
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if nesting(body) > limits.max_nesting:
        raise RequestError(too_deep)
    messages = body.get("messages") if chat and isinstance(body, dict) else None
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise RequestError(f"'messages' holds {len(messages)} messages; this server takes at most "
                           f"{limits.max_messages} (--max-messages)", "messages", status=413)
    return body


def authorized(request: Request, limits: ServerLimits) -> bool:
    """'Authorization: Bearer <key>': the scheme in any case (RFC 7235), the key compared as the
    bytes the client sent with the key's UTF-8 bytes (so a non-ASCII key matches)."""
    if limits.api_key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    sent = token.strip().encode("latin-1", "replace")  # starlette decodes header bytes as latin-1
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, limits.api_key.encode("utf-8"))


# ---------------------------------------------------------------- responding


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
        event = await job.get()
        if event is END:
            return out, error
        if isinstance(event, BaseException):
            error = event
        else:
            out.append(event)


def _finish_reason(response: Response) -> str:
    """OpenAI's finish reason of a last response: a generation stopped early (the server shuts
    down) ends as one cut by a limit."""
    return "length" if response.finish_reason in (None, "cancelled") else response.finish_reason


def _event(body: BaseModel | str) -> ServerSentEvent:
    """One `data:` event: a response model as JSON, or a bare string ("[DONE]")."""
    return ServerSentEvent(body if isinstance(body, str) else body.model_dump_json(), sep="\n")


def _sse_response(job: Job, events: AsyncIterator[ServerSentEvent]) -> HTTPResponse:
    """A Server-Sent-Events response (sse-starlette) that stops the job when the client
    disconnects: at once when the disconnect is seen, and when the event generator is closed. A
    stream quiet for PING_SECONDS gets a comment line, which SSE clients (OpenAI's) skip. When
    the server stops, the generation ends after its current step and the stream
    ends by itself, with its final chunks and [DONE], within STREAM_SHUTDOWN_GRACE seconds."""

    async def client_left(message: Any) -> None:
        job.cancel.set("gone")

    # with sse-starlette's X-Accel-Buffering: no (proxies pass each event on at once)
    return EventSourceResponse(events, headers={"Cache-Control": "no-cache"}, sep="\n", ping=PING_SECONDS,
                               ping_message_factory=lambda: ServerSentEvent(comment="ping", sep="\n"),
                               client_close_handler_callable=client_left,
                               shutdown_grace_period=STREAM_SHUTDOWN_GRACE)


async def _events(job: Job, first: Any, reply: ResponseBuilder) -> AsyncIterator[ServerSentEvent]:
    try:
        if reply.chat:
            yield _event(reply.chunk(None, role=True))
        event = first
        last: Response | None = None
        while event is not END:
            if isinstance(event, BaseException):
                log.warning("stream of %s ended by an error: %s", reply.id, event)
                error_type = "server_error" if status_of(event) >= 500 else "invalid_request_error"
                yield _event(error_body(str(event), error_type=error_type))
                return
            last = event
            if event.content:  # the text without tool-call markup (all of it, without tools)
                yield _event(reply.chunk(event.content))
            if event.finish_reason:
                for chunk in reply.tool_call_chunks(event.tool_calls) + \
                        reply.final_chunks(_finish_reason(event), event.stats):
                    yield _event(chunk)
            event = await job.get()
        if last is not None and last.finish_reason is None:  # stopped early (the server shuts down)
            for chunk in reply.final_chunks("length", last.stats):
                yield _event(chunk)
        yield _event("[DONE]")
    finally:
        job.cancel.set("gone")


async def _respond_stream(request: Request, job: Job, reply: ResponseBuilder) -> HTTPResponse:
    """An SSE response once the first token is there (an error before it: a JSON error response)."""
    first = await _unless_disconnected(request, job.get())
    if isinstance(first, BaseException):
        return error_response(first, reply.chat)
    if first is END:
        return error_response(RuntimeError("no output"), reply.chat)
    return _sse_response(job, _events(job, first, reply))


async def _respond_full(request: Request, job: Job, reply: ResponseBuilder) -> HTTPResponse:
    responses, error = await _unless_disconnected(request, _collect(job))
    if error is not None or not responses:
        if responses:  # an error after some output: the output is kept, the error reported
            log.warning("%s ended by an error after %d tokens: %s", reply.id, len(responses), error)
        else:
            return error_response(error or RuntimeError("no output"), reply.chat)
    last = responses[-1]
    text = "".join(r.content for r in responses)
    # finish_reason None or cancelled: the server is shutting down (or an error) ended the generation early
    return json_response(reply.full(text, _finish_reason(last), last.stats, last.tool_calls))


# ---------------------------------------------------------------- the app


def create_app(pair: Pair, *, model_id: str, defaults: GenerationConfig = DEFAULTS,
               limits: ServerLimits = ServerLimits()) -> Starlette:
    """The ASGI app serving one pair kept on a residency (its draft None: no draft model; n-gram
    drafts or none). `defaults`: the settings of what a request leaves out."""
    created = int(time.time())
    has_draft = pair.spec.draft is not None

    card = ModelCard(id=model_id, created=created)

    async def list_models(request: Request) -> HTTPResponse:
        return json_response(ModelList(data=[card]))

    async def get_model(request: Request) -> HTTPResponse:
        name = request.path_params["name"]
        if name != model_id:
            return json_response(error_body(f"model {name!r} does not exist; this server serves {model_id!r}",
                                            "model"), 404)
        return json_response(card)

    async def health(request: Request) -> HTTPResponse:
        """What the residency holds: the status type `localspec ps` shows too."""
        return HTTPResponse(json.dumps(pair.residency.status().to_json()), media_type="application/json")

    async def generate(request: Request, chat: bool) -> HTTPResponse:
        req = schemas.parse(parse_json(await read_body(request, limits), limits, chat), chat)
        # compiling a constraint follows its grammar's start (up to ~1 s for a regex the lexer cannot
        # follow): in a thread, so the event loop goes on serving the other clients meanwhile
        config = await asyncio.to_thread(req.config, defaults)
        if isinstance(req, schemas.ChatRequest):
            prompt: Prompt = req.prompt()
            tools = await asyncio.to_thread(req.toolset)
        else:
            prompt, tools = req.prompt_value(), None
        reply = ResponseBuilder(chat, req.include_usage, applied_config(config, has_draft), model_id)
        job = Job(prompt, config, asyncio.get_running_loop(), tools)
        pair.submit(job)
        log.info("%s: %s", reply.id, "stream" if req.stream else "request")
        try:
            return await (_respond_stream if req.stream else _respond_full)(request, job, reply)
        except Disconnected:
            job.cancel.set("gone")
            log.info("%s: the client disconnected", reply.id)
            return HTTPResponse(status_code=499)
        except BaseException:
            job.cancel.set("gone")
            raise

    def endpoint(chat: bool) -> Callable[[Request], Awaitable[HTTPResponse]]:
        async def handle(request: Request) -> HTTPResponse:
            try:
                return await generate(request, chat)
            except LocalspecError as exc:
                return error_response(exc, chat)
            except Exception as exc:  # noqa: BLE001 - a bug, not the client's fault: log it, answer JSON
                return await internal_error(request, exc)
        return handle

    async def http_error(request: Request, exc: Exception) -> HTTPResponse:
        assert isinstance(exc, HTTPException)
        method, path = request.method, request.url.path
        if exc.status_code == 404 and path.rstrip("/") == "/v1/responses":
            message = ("OpenAI's Responses API (/v1/responses) is not supported; localspec serves Chat "
                       f"Completions, tool calls included: use POST /v1/chat/completions ({ROUTES_HELP})")
        elif exc.status_code == 404:
            message = f"unknown route {method} {path}; this server offers {ROUTES_HELP}"
        elif exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            message = f"method {method} is not allowed on {path}" + (f"; use {allow}" if allow else "")
        else:
            message = str(exc.detail)
        return json_response(error_body(message), exc.status_code, exc.headers)

    async def internal_error(request: Request, exc: Exception) -> HTTPResponse:
        log.error("internal error on %s %s", request.method, request.url.path,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return json_response(error_body(f"internal server error: {type(exc).__name__}", error_type="server_error"), 500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(pair.residency.end, "the server is stopping")

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
    app.router.redirect_slashes = False  # /v1/models/ is a 404, not a redirect to follow
    app.add_middleware(_BearerAuth, limits=limits)
    app.state.pair = pair
    app.state.model_id = model_id
    return app


class _BearerAuth:
    """With an API key: every route but /health needs "Authorization: Bearer <key>" (401 otherwise)."""

    def __init__(self, app: Any, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not authorized(Request(scope), self.limits):
            response = json_response(error_body("a valid API key is required: send 'Authorization: Bearer <key>' "
                                                "(the key given to localspec serve --api-key)",
                                                code="invalid_api_key"),
                                     401, {"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
