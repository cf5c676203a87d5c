"""The OpenAI-compatible server on the tiny models: the real openai client against uvicorn in a
background thread, lossless at temperature 0 end to end, OpenAI-style errors for bad input, a
client that disconnects mid-stream stops its generation, concurrent clients queue, and the
`localspec serve` command (help, a missing model, a real run stopped with Ctrl-C), and clients
that are hostile or broken: oversized and deeply nested bodies, too many messages, clients that
send nothing or send slowly, a full queue, a missing API key; after each the server goes on."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from click.testing import CliRunner
from openai import OpenAI

from localspec.cli import cli
from localspec.settings.generation import GenerationConfig
from localspec.llama.model import Model
from localspec.server import ServerLimits, jobs, schemas
from localspec.core.cancel import Cancel
from localspec.core.residency import Residency
from localspec.core.status import PairStatus
from localspec.loading import Loaded
from localspec.server.app import create_app
from localspec.server.run import bind_socket, uvicorn_config
import tiny_models as tiny
from children import popen

from conftest import QUANTIZATIONS, load
from greedy import assert_greedy_text
from serving import uvicorn_server, uvicorn_thread

PROMPT = "def add(a, b): return a"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
N = 12  # max_tokens of most requests
CTX = 2048  # the served models' context (long enough for a generation a disconnect interrupts)
# the server's defaults: greedy, always draft (the planner of plan=auto may decline on tiny models)
DEFAULTS = GenerationConfig.from_options(temperature=0.0, max_tokens=N, plan="fixed", num_draft_tokens=4,
                                         drafter="model")
# small limits, so the tests of hostile clients are quick
LIMITS = ServerLimits(max_body_bytes=64 * 1024, max_messages=32, max_nesting=16, max_queue=8,
                      header_timeout=1.0, body_timeout=1.0)
TIMEOUT = 30.0


class Served:
    def __init__(self, url: str, pair: jobs.Pair) -> None:
        self.url = url
        self.pair = pair
        # the server closes a connection idle for header_timeout (1 s here): the clients must
        # not reuse one that old, or a request can race the close (as with any keep-alive server)
        pool = httpx.Limits(keepalive_expiry=LIMITS.header_timeout / 2)
        self.http = httpx.Client(base_url=url, timeout=TIMEOUT, limits=pool)
        self.openai = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT,
                             http_client=httpx.Client(timeout=TIMEOUT, limits=pool))

    def pair_status(self) -> PairStatus:
        (pair,) = self.pair.residency.status().pairs
        return pair

    def wait_idle(self, calls: int) -> None:
        """Until a generation that began with `calls` calls served has ended (its client left)."""
        deadline = time.monotonic() + TIMEOUT
        while (state := self.pair_status()).calls == calls or state.state != "idle":
            assert time.monotonic() < deadline, "the generation of a disconnected client kept running"
            time.sleep(0.01)


@contextlib.contextmanager
def serving(target: Model, draft: Model) -> Iterator[Served]:
    """uvicorn serving these models on a free port, in a background thread (closes them after)."""
    residency = Residency()
    pair = jobs.Pair(residency, residency.adopt(Loaded(target, draft, "tiny-pair")), LIMITS.max_queue)
    app = create_app(pair, model_id="tiny-pair", defaults=DEFAULTS, limits=LIMITS)
    with uvicorn_thread(app, LIMITS) as url:
        s = Served(url, pair)
        yield s
        s.http.close()
    assert residency.close(timeout=10)


@pytest.fixture(scope="module")
def served(tiny_paths: tuple[Path, Path]) -> Iterator[Served]:
    """The tiny F32 pair, served (the server's own instances of the models)."""
    with serving(load(tiny_paths[0], n_ctx=CTX), load(tiny_paths[1], n_ctx=CTX)) as s:
        yield s


@pytest.fixture(scope="module", params=QUANTIZATIONS)
def served_quantized(request: pytest.FixtureRequest,
                     quantized_paths: dict[str, tuple[Path, Path]]) -> Iterator[tuple[Served, Model]]:
    """A pair quantized by llama.cpp, served through the default CPU kernels; with a target of
    its own for the reference greedy text."""
    target, draft = quantized_paths[request.param]
    with load(target) as reference, serving(load(target, n_ctx=CTX), load(draft, n_ctx=CTX)) as s:
        yield s, reference


def same_greedy(target: Model, prompt, text: str, max_tokens: int = N) -> None:
    """`text` is the target-only greedy text (what every lossless setting must give, up to a
    near-tie of the target's logits: tests/greedy.py)."""
    assert_greedy_text(target, prompt, text, max_tokens)


def assert_spec(spec: dict, **expected) -> None:
    for key in ("verifier", "drafter", "plan", "num_draft_tokens", "paths", "tree", "block_efficiency",
                "acceptance_rate", "target_passes", "drafted_tokens", "accepted_tokens", "accept_histogram",
                "verifier_share", "tokens_per_second"):
        assert key in spec, key
    for key, value in expected.items():
        assert spec[key] == value, (key, spec[key], value)
    assert spec["drafted_tokens"] > 0 and spec["block_efficiency"] >= 1.0
    assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["drafted_tokens"])
    assert sum(spec["accept_histogram"]) <= spec["target_passes"]


# ---------------------------------------------------------------- happy paths


def test_models(served: Served) -> None:
    models = served.openai.models.list()
    assert [m.id for m in models.data] == ["tiny-pair"]
    raw = served.http.get("/models").json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"
    assert served.openai.models.retrieve("tiny-pair").id == "tiny-pair"


@pytest.mark.parametrize("extra", [dict(verifier="block"), dict(verifier="traversal", tree=[2, 2])],
                         ids=["block", "traversal-2x2"])
def test_chat_lossless(served: Served, tiny_target: Model, extra: dict) -> None:
    r = served.openai.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=N,
                                              temperature=0, extra_body=extra)
    assert r.object == "chat.completion" and r.model == "tiny-pair"
    assert r.choices[0].message.role == "assistant"
    same_greedy(tiny_target, MESSAGES, r.choices[0].message.content)
    n_tokens = r.usage.completion_tokens
    assert 1 <= n_tokens <= N and r.choices[0].finish_reason == ("length" if n_tokens == N else "stop")
    assert r.usage.total_tokens == r.usage.prompt_tokens + n_tokens
    assert_spec(r.model_extra["speculative"], verifier=extra["verifier"], drafter="model", plan="fixed",
                tree=extra.get("tree"))
    assert r.model_extra["speculative"]["target_passes"] < n_tokens  # drafts were accepted


@pytest.mark.parametrize("extra", [dict(verifier="block"), dict(verifier="traversal", tree=[2, 2])],
                         ids=["block", "traversal-2x2"])
def test_chat_lossless_on_quantized_models(served_quantized: tuple[Served, Model], extra: dict) -> None:
    """The kernels users run (Q4_K_M, Q4_0, Q8_0 weights): greedy speculation through the server
    gives the target's own greedy text."""
    served, reference = served_quantized
    r = served.openai.chat.completions.create(model="x", messages=MESSAGES, max_tokens=N, temperature=0,
                                              extra_body=extra)
    same_greedy(reference, MESSAGES, r.choices[0].message.content)
    assert r.model_extra["speculative"]["drafted_tokens"] > 0


def test_chat_stream(served: Served, tiny_target: Model) -> None:
    chunks = list(served.openai.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=dict(verifier="traversal", tree="2x2")))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    same_greedy(tiny_target, MESSAGES, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    last = chunks[-1]
    n_tokens = last.usage.completion_tokens
    assert last.choices == [] and 1 <= n_tokens <= N
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length" if n_tokens == N else "stop"]
    assert_spec(last.model_extra["speculative"], verifier="traversal", tree=[2, 2])


def test_completion_and_stream(served: Served, tiny_target: Model) -> None:
    r = served.openai.completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.object == "text_completion"
    same_greedy(tiny_target, PROMPT, r.choices[0].text)
    assert 1 <= r.usage.completion_tokens <= N
    assert_spec(r.model_extra["speculative"], verifier="block", num_draft_tokens=4, tree=None)

    chunks = list(served.openai.completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0,
                                                   stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text  # the same batches: the same text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert_spec(chunks[-1].model_extra["speculative"], verifier="block")


def test_raw_sse_format(served: Served) -> None:
    r = served.http.post("/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert "speculative" in json.loads(events[-3][len("data: "):])


def test_sse_headers_and_keep_alive_pings(served: Served, tiny_target: Model,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """sse-starlette's framing: OpenAI's headers, and on a quiet stream keep-alive pings as comment
    lines, which the openai client skips (the text is the same)."""
    from localspec.server import app as app_module

    from localspec.decoding.engine import Engine

    steps = Engine.steps

    def slow_steps(self: Engine, *args):  # type: ignore[no-untyped-def]
        time.sleep(0.02)  # quiet spells four pings long, however fast the machine
        return (yield from steps(self, *args))

    monkeypatch.setattr(app_module, "PING_SECONDS", 0.005)
    monkeypatch.setattr(Engine, "steps", slow_steps)
    body = {"prompt": PROMPT, "max_tokens": 20, "stream": True, "num_draft_tokens": 0}
    r = served.http.post("/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
    events = r.text.split("\n\n")
    assert ": ping" in events
    data = [e for e in events if e != ": ping"]  # a ping may also fall between [DONE] and the close
    assert data[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in data[:-2])
    text = "".join(json.loads(e[len("data: "):])["choices"][0]["text"] for e in data[:-2])
    chunks = served.openai.completions.create(model="x", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                              extra_body={"num_draft_tokens": 0})
    assert "".join(c.choices[0].text for c in chunks) == text


def test_an_error_mid_stream_is_an_error_event(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    from localspec.decoding.engine import Engine
    from localspec.errors import ModelError

    real, calls = Engine.steps, []

    def failing_later(self: Engine, *args):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) > 2:
            raise ModelError("llama_decode failed with code -3")
        return (yield from real(self, *args))

    monkeypatch.setattr(Engine, "steps", failing_later)
    r = served.http.post("/completions", json={"prompt": PROMPT, "max_tokens": N, "stream": True,
                                               "num_draft_tokens": 0})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert len(events) >= 2 and "data: [DONE]" not in events
    error = json.loads(events[-1][len("data: "):])["error"]
    assert error == {"message": "llama_decode failed with code -3", "type": "server_error", "param": None,
                     "code": None}


SLOW_DECODE_MS = 10.0  # each llama_decode made this much slower: a known floor under the timings


def timings_problems(body: dict, wall_ms: float) -> list[str]:
    """What is wrong with a response's `timings` (llama-server's): each field against the usage
    and `speculative` beside it (test_timings.check_llama_timings), and against time itself, with
    every decode SLOW_DECODE_MS slower: the prompt (not cached) took at least one decode, every
    target pass but the first one (which may come with the prompt's), and all of it fits in the
    request's wall time."""
    from test_timings import check_llama_timings

    timings = body["timings"]
    problems = check_llama_timings(timings, body)
    passes = body["speculative"]["target_passes"] - 1
    if not SLOW_DECODE_MS <= timings["prompt_ms"] <= wall_ms:
        problems.append(f"prompt_ms {timings['prompt_ms']} outside [{SLOW_DECODE_MS}, {wall_ms}]")
    if not SLOW_DECODE_MS * passes <= timings["predicted_ms"] <= wall_ms:
        problems.append(f"predicted_ms {timings['predicted_ms']} outside [{SLOW_DECODE_MS * passes}, {wall_ms}]")
    return problems


@pytest.fixture
def slow_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Model.decode_parts

    def slow(self: Model, *args: Any, **kwargs: Any) -> int:
        time.sleep(SLOW_DECODE_MS / 1e3)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Model, "decode_parts", slow)


def fresh_prompt() -> str:
    """A prompt no earlier request left in the KV cache (so its processing is timed)."""
    import random

    return PROMPT + " " + " ".join(random.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(12))


def test_timings_as_llama_server_sends_them(served: Served, slow_decodes: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Full responses (chat and text) carry llama-server's `timings` beside `speculative`, in its
    units: consistent with both, and in milliseconds by the clock. Negative control: a unit slip
    (seconds for milliseconds) is caught."""
    from localspec.decoding.stats import GenerationStats
    from test_timings import seconds_slip

    def request(path: str, body: dict, drafts: bool = True) -> list[str]:
        started = time.perf_counter()
        r = served.http.post(path, json={"max_tokens": N, **body})
        wall_ms = 1e3 * (time.perf_counter() - started)
        assert r.status_code == 200, r.text
        data = r.json()
        drafted = data["speculative"]["drafted_tokens"]
        assert (drafted > 0) == drafts and data["timings"].get("draft_n") == (drafted or None)  # as llama-server
        return timings_problems(data, wall_ms)

    assert request("/completions", {"prompt": fresh_prompt()}) == []
    chat = [{"role": "user", "content": fresh_prompt()}]
    assert request("/chat/completions", {"messages": chat}) == []
    assert request("/completions", {"prompt": fresh_prompt(), "num_draft_tokens": 0}, drafts=False) == []

    monkeypatch.setattr(GenerationStats, "timings", seconds_slip)
    assert request("/completions", {"prompt": fresh_prompt()})


def test_timings_in_the_last_chunks_of_a_stream(served: Served, slow_decodes: None) -> None:
    """A stream's final chunk (and, with include_usage, the usage chunk after it: the last one)
    carries `timings`; the chunks before do not."""
    started = time.perf_counter()
    chunks = list(served.openai.chat.completions.create(
        model="x", messages=[{"role": "user", "content": fresh_prompt()}], max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    wall_ms = 1e3 * (time.perf_counter() - started)
    finish, last = chunks[-2], chunks[-1]
    assert finish.choices[0].finish_reason and last.choices == []
    assert all("timings" not in (c.model_extra or {}) for c in chunks[:-2])
    assert finish.model_extra["timings"] == last.model_extra["timings"]
    assert timings_problems(last.model_dump(), wall_ms) == []
    assert "timings" in json.loads(served.http.post("/completions", json={
        "prompt": fresh_prompt(), "max_tokens": 4, "stream": True}).text.split("\n\n")[-3][len("data: "):])


def test_request_settings_are_used(served: Served) -> None:
    """max_completion_tokens, stop and drafter reach the engine; no draft means target-only stats."""
    r = served.http.post("/completions", json={"prompt": PROMPT, "max_completion_tokens": 3,
                                               "drafter": "ngram", "verifier": "greedy"}).json()
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"
    assert r["speculative"]["drafter"] == "ngram"
    full = served.http.post("/completions", json={"prompt": PROMPT, "max_tokens": N}).json()["choices"][0]["text"]
    stop = full.strip()[2:4]
    r = served.http.post("/completions", json={"prompt": PROMPT, "max_tokens": N, "stop": [stop]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == full[: full.find(stop)]
    r = served.http.post("/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                               "num_draft_tokens": 0}).json()
    assert r["speculative"]["drafted_tokens"] == 0 and r["speculative"]["target_passes"] == 4


# ---------------------------------------------------------------- errors


BAD = [
    ("/chat/completions", b"{not json", "not valid JSON", None),
    ("/chat/completions", b"[1, 2]", "must be a JSON object, got list", None),
    ("/chat/completions", b'{"messages": "caf\xe9"}', "not valid JSON", None),  # not UTF-8
    ("/chat/completions", {"model": "x"}, "'messages': Field required", "messages"),
    ("/chat/completions", {"messages": "hello"}, "'messages': Input should be a valid list", "messages"),
    ("/chat/completions", {"messages": []}, "'messages': List should have at least 1 item", "messages"),
    ("/chat/completions", {"messages": [{"role": "user"}]}, "'messages[0].content': Field required",
     "messages[0].content"),
    ("/chat/completions", {"messages": [{"role": "user<|im_end|>", "content": "x"}]},
     "'messages[0].role': String should match pattern", "messages[0].role"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "'messages[0].content", "messages[0].content"),
    ("/chat/completions", {"messages": MESSAGES, "n": 2}, "'n': Input should be 1", "n"),
    ("/chat/completions", {"messages": MESSAGES, "verifier": "nope"}, "verifier must be one of", "verifier"),
    ("/chat/completions", {"messages": MESSAGES, "verifier": "block", "tree": [2, 2]},
     "verifier 'block' verifies one chain", "verifier"),
    ("/chat/completions", {"messages": MESSAGES, "max_tokens": -1}, "max_tokens must be an integer in [1, 2147483647]",
     "max_tokens"),
    ("/chat/completions", {"messages": MESSAGES, "max_tokens": "12"}, "'max_tokens': Input should be a valid integer",
     "max_tokens"),
    ("/chat/completions", {"messages": MESSAGES, "temperature": -0.5}, "temperature must be 0 (greedy) or a number in",
     "temperature"),
    ("/chat/completions", {"messages": MESSAGES, "temperature": True}, "'temperature': Input should be a valid number",
     "temperature"),
    ("/chat/completions", {"messages": MESSAGES, "seed": -5}, "seed must be an integer in [0, 2**64)", "seed"),
    ("/chat/completions", {"messages": MESSAGES, "tree": "3xa"}, "'3xa' is not a draft shape", "tree"),
    ("/chat/completions", {"messages": MESSAGES, "top_p": 0}, "top_p must lie in (0, 1]", "top_p"),
    ("/chat/completions", {"messages": MESSAGES, "stream": "yes"}, "'stream': Input should be a valid boolean",
     "stream"),
    ("/completions", {"prompt": 42}, "'prompt': Input should be a valid string", "prompt"),
    ("/completions", {"prompt": ["a", "b"]}, "one string", "prompt"),
    ("/completions", {"prompt": PROMPT, "logprobs": 3}, "'logprobs' is not supported", "logprobs"),
    ("/completions", {"prompt": "hello world " * 1000}, "context holds 2048", "prompt"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hello world " * 1000}], "stream": True},
     "context holds 2048", "messages"),
    ("/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format.type 'xml'",
     "response_format"),
    ("/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}}}},
     "/properties/a/pattern", "response_format"),
    ("/completions", {"prompt": PROMPT, "json_schema": {"type": "nonsense"}}, "JSON schema", "json_schema"),
    ("/completions", {"prompt": PROMPT, "grammar": "root ::= undefined"}, "GBNF", "grammar"),
    ("/completions", {"prompt": PROMPT, "grammar": 'root ::= "a"', "json_schema": {"type": "object"}},
     "give one constraint", "grammar"),
    ("/completions", {"prompt": PROMPT, "response_format": {"type": "json_object"}, "stop": ["x"]},
     "stop strings cannot be combined with a constraint", "stop"),
    # constraints llguidance cannot follow: refused before the first token (never a 500 mid-generation)
    ("/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#"}}}}, "no output can match it", "response_format"),
    ("/completions", {"prompt": PROMPT, "json_schema": {"type": "object", "properties": {"a": {"$ref": "#"}},
                                                        "required": ["a"]}}, "parser limits", "json_schema"),
    ("/completions", {"prompt": PROMPT, "grammar": 'root ::= root "a"'}, "no output can match it", "grammar"),
    ("/completions", {"prompt": PROMPT, "grammar": "%llguidance {}\nstart: /a{1000000}/"}, "lexer limits", "grammar"),
    ("/completions", {"prompt": PROMPT, "grammar": "%llguidance {}\nstart: <s> A\nA: /[a&&b]/", "stream": True},
     "cannot be used with this model's vocabulary", "grammar"),  # found with the model's vocabulary, in the worker
]


@pytest.mark.parametrize("path,body,message,param", BAD, ids=[f"{i}-{b[2][:24]}" for i, b in enumerate(BAD)])
def test_bad_request(served: Served, path: str, body, message: str, param: str | None) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = served.http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert message in error["message"], error
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] is None


def test_openai_client_sees_bad_request(served: Served) -> None:
    import openai

    with pytest.raises(openai.BadRequestError, match="tree"):
        served.openai.chat.completions.create(model="x", messages=MESSAGES,
                                              extra_body={"verifier": "gbv", "tree": [2, 2]})


def test_unknown_route_and_method(served: Served) -> None:
    r = served.http.get("/nowhere")
    assert r.status_code == 404 and "unknown route GET /v1/nowhere" in r.json()["error"]["message"]
    r = served.http.get("/chat/completions")
    assert r.status_code == 405 and "use POST" in r.json()["error"]["message"]
    assert served.http.get("/models/other").status_code == 404
    r = served.http.post("/chat/completions/", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404  # a trailing slash is another route, not a redirect to follow


def test_a_field_named_twice_is_refused(served: Served) -> None:
    body = b'{"prompt": "hi", "max_tokens": 2, "max_tokens": 3}'
    r = served.http.post("/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_internal_errors_are_json_500(served: Served, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    from localspec.decoding.engine import Engine

    def broken_parse(*args, **kwargs):
        raise RuntimeError("parser bug")

    def broken_steps(*args, **kwargs):
        yield from ()
        raise RuntimeError("engine bug")

    body = {"prompt": PROMPT, "max_tokens": 2}
    with monkeypatch.context() as m:
        m.setattr(schemas, "parse", broken_parse)
        r = served.http.post("/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "Traceback" not in r.text
    with monkeypatch.context() as m:
        m.setattr(Engine, "steps", broken_steps)
        r = served.http.post("/completions", json=body)
        assert r.status_code == 500 and "engine bug" in r.json()["error"]["message"]
    assert any("failed" in rec.message and rec.exc_info for rec in caplog.records)  # a bug is logged with its traceback
    assert served.http.post("/completions", json=body).status_code == 200  # and the server goes on


# ---------------------------------------------------------------- disconnects and concurrency


def test_disconnect_mid_stream_stops_generation(served: Served, tiny_target: Model) -> None:
    max_tokens = CTX - 100  # far more than one chunk: the generation must be cut short
    calls = served.pair_status().calls
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "num_draft_tokens": 0}
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as client:
        with client.stream("POST", "/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            # the event loop answers while the model generates
            health = served.http.get(served.url.removesuffix("/v1") + "/health", timeout=5).json()
            (pair,) = health["pairs"]  # the core's status, as `localspec ps` shows it
            assert pair["state"] == "busy" and pair["name"] == "tiny-pair" and health["pid"] == os.getpid()
    served.wait_idle(calls)
    # the lock is free and the caches are reusable: the next request is lossless
    r = served.openai.completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0, timeout=10)
    same_greedy(tiny_target, PROMPT, r.choices[0].text)


def test_disconnect_non_streaming(served: Served, tiny_target: Model) -> None:
    """A non-streaming client that gives up (a timeout) does not keep the model busy."""
    calls = served.pair_status().calls
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/completions", timeout=0.1,
                   json={"prompt": PROMPT, "max_tokens": CTX - 100, "num_draft_tokens": 0})
    served.wait_idle(calls)


def test_concurrent_clients(served: Served, tiny_target: Model) -> None:
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            c = OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=TIMEOUT)
            extra = dict(verifier="traversal", tree=[2, 2]) if i % 2 else dict(verifier="block")
            if i == 3:
                stream = c.chat.completions.create(model="x", messages=MESSAGES, max_tokens=16, temperature=0,
                                                   stream=True, extra_body=extra)
                results[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            else:
                r = c.chat.completions.create(model="x", messages=MESSAGES, max_tokens=16, temperature=0,
                                              extra_body=extra)
                results[i] = r.choices[0].message.content
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors and not any(t.is_alive() for t in threads)
    assert sorted(results) == [0, 1, 2, 3]
    for text in results.values():
        same_greedy(tiny_target, MESSAGES, text, 16)


# ---------------------------------------------------------------- the command


def test_serve_help() -> None:
    r = CliRunner().invoke(cli, ["serve", "--help"])
    assert r.exit_code == 0
    for text in ("OpenAI-compatible", "--host", "--port", "--verifier", "/v1/chat/completions", "curl",
                 "base_url=", "--api-key", "--max-body-bytes", "--header-timeout", "no authentication"):
        assert text in r.output, text


def test_serve_missing_model() -> None:
    r = CliRunner().invoke(cli, ["serve", "-m", "/nonexistent.gguf", "-d", "none", "--port", "0"])
    assert r.exit_code != 0
    assert "/nonexistent.gguf" in r.output and "Traceback" not in r.output
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit)


def test_serve_without_server_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    r = CliRunner().invoke(cli, ["serve", "-m", "/nonexistent.gguf"])
    assert r.exit_code != 0 and "pip install 'localspec[server]'" in r.output and "uvicorn" in r.output


def test_serve_port_taken() -> None:
    sock = bind_socket("127.0.0.1", 0)
    sock.listen()
    try:
        port = sock.getsockname()[1]
        r = CliRunner().invoke(cli, ["serve", "-m", "/nonexistent.gguf", "--port", str(port)])
        assert r.exit_code != 0 and f"cannot listen on 127.0.0.1:{port}" in r.output
        assert "Traceback" not in r.output
    finally:
        sock.close()


def test_serve_host_that_does_not_resolve() -> None:
    r = CliRunner().invoke(cli, ["serve", "-m", "/nonexistent.gguf", "--host", "not a host", "--port", "0"])
    assert r.exit_code == 2 and "--host" in r.output and "--port" not in r.output.split("Error")[-1]
    assert "Traceback" not in r.output


def test_serve_command_runs_and_stops(tiny_paths: tuple[Path, Path]) -> None:
    """The real command in a subprocess: it announces the URL, answers, and Ctrl-C stops it cleanly."""
    proc = popen([sys.executable, "-m", "localspec", "serve", "-m", str(tiny_paths[0]),  # SIGINT: as Ctrl-C
                  "-d", str(tiny_paths[1]), "--port", "0", "--ctx-size", "4096", "--threads", "1",
                  "-t", "0", "-n", "5"],
                 stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    watchdog = threading.Timer(60, proc.kill)  # a hang fails the test instead of blocking it
    watchdog.start()
    try:
        line = proc.stderr.readline()
        m = re.match(r"localspec: serving (\S+) on (http://127\.0\.0\.1:\d+/v1)$", line.strip())
        assert m, line
        assert m.group(1) == tiny_paths[0].stem
        deadline = time.monotonic() + 10
        while True:
            try:
                r = httpx.post(m.group(2) + "/completions", json={"prompt": PROMPT}, timeout=TIMEOUT)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "the server did not start listening"
                time.sleep(0.05)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
        # Ctrl-C during a long stream: it ends at once, with what was generated, and the server stops
        body = {"prompt": PROMPT, "max_tokens": 4000, "stream": True, "num_draft_tokens": 0}
        with httpx.stream("POST", m.group(2) + "/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGINT)
            events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        final = json.loads(events[-2][len("data: "):])
        assert final["choices"][0]["finish_reason"] == "length"
        assert final["speculative"]["target_passes"] < 4000
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "server stopped" in err and "Traceback" not in err
    assert out == ""


# ---------------------------------------------------------------- hostile and broken clients


def raw_request(url: str, data: bytes, wait: float = TIMEOUT) -> bytes:
    """Send raw bytes on a new connection; everything the server answers until it closes (or `wait`)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=wait) as sock:
        if data:
            sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def test_oversized_bodies_are_refused_at_once(served: Served) -> None:
    big = {"prompt": "x" * (LIMITS.max_body_bytes + 10)}
    t0 = time.perf_counter()
    r = served.http.post("/completions", json=big)
    assert r.status_code == 413 and "at most 65536 bytes (--max-body-bytes)" in r.json()["error"]["message"]
    # without a Content-Length (a chunked upload): counted while read, refused past the limit
    chunks = (b"x" * 8192 for _ in range(2 * LIMITS.max_body_bytes // 8192))
    r = served.http.post("/completions", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 5
    assert served.http.get("/models").status_code == 200  # and the server goes on


def test_too_many_messages_and_deep_nesting_are_refused(served: Served) -> None:
    many = {"messages": [{"role": "user", "content": "hi"}] * (LIMITS.max_messages + 1)}
    r = served.http.post("/chat/completions", json=many)
    assert r.status_code == 413 and r.json()["error"]["param"] == "messages"
    assert "at most 32 (--max-messages)" in r.json()["error"]["message"]
    for depth in (LIMITS.max_nesting + 1, 5000):  # beyond the limit, and beyond Python's recursion limit
        deep = b'{"prompt": "a", "x": ' + b"[" * depth + b"]" * depth + b"}"
        r = served.http.post("/completions", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nests deeper than 16 levels" in r.json()["error"]["message"], r.text
    assert served.http.post("/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_clients_that_send_nothing_or_slowly_are_timed_out(served: Served) -> None:
    t0 = time.perf_counter()
    assert raw_request(served.url, b"") == b""  # connects, sends nothing: closed after header_timeout
    slow_head = raw_request(served.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never ends its head
    assert slow_head == b"" and time.perf_counter() - t0 < 2 * LIMITS.header_timeout + 3
    t0 = time.perf_counter()
    slow_body = raw_request(served.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                        b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    assert slow_body.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in slow_body
    assert time.perf_counter() - t0 < LIMITS.body_timeout + 3
    assert served.http.get("/models").status_code == 200


@contextlib.contextmanager
def bare_uvicorn(routes: list) -> Iterator[tuple[tuple[str, int], Any]]:
    """A Starlette app of `routes` served as localspec serves (run.uvicorn_config), in a thread:
    (its address, its run.HeadTimeoutApp)."""
    import asyncio

    from starlette.applications import Starlette

    from localspec.server import run

    with uvicorn_server(Starlette(routes=routes), LIMITS) as (uv, sock):
        assert issubclass(uv.config.http, asyncio.Protocol) and isinstance(uv.config.app, run.HeadTimeoutApp)
        yield sock.getsockname()[:2], uv.config.app


def read_response(conn, until: bytes) -> bytes:
    answer = b""
    while not answer.endswith(until):
        chunk = conn.recv(65536)
        assert chunk, answer  # closed mid-request
        answer += chunk
    return answer


def slow_send(conn, data: bytes) -> None:
    with contextlib.suppress(OSError):
        for byte in data:
            conn.sendall(bytes([byte]))
            time.sleep(0.1)


def test_the_head_timeout_starts_again_after_each_response_and_spares_slow_requests() -> None:
    """The head timer (compat.timed_protocol) wraps uvicorn's protocol and stops at the blank line that
    ends a head: a request running longer than header_timeout is not cut. After the response
    (run.HeadTimeoutApp finds the connection by the client's address) it starts again: a
    kept-alive connection that sends its next head a byte at a time is closed, and so is one that
    sends blank lines a byte at a time (they are no head: the timer runs on)."""
    import asyncio
    import socket

    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def slow(request) -> PlainTextResponse:
        await asyncio.sleep(1.5 * LIMITS.header_timeout)
        return PlainTextResponse("done")

    with bare_uvicorn([Route("/slow", slow)]) as (address, _):
        for second_head in (b"GET /slow HTTP/1.1\r\nHost: x\r\n", b"\r\n" * 40):
            with socket.create_connection(address, timeout=TIMEOUT) as conn:
                conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = read_response(conn, b"done")
                assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" not in answer.lower()
                t0 = time.perf_counter()
                slow_send(conn, second_head)
                rest = b"".join(iter(lambda: conn.recv(65536), b""))  # to the close
                assert rest == b"" or rest.startswith(b"HTTP/1.1 400"), rest  # closed (h11 may refuse blank lines first)
                assert time.perf_counter() - t0 < LIMITS.header_timeout + 1


def test_a_response_whose_connection_is_not_found_closes_it() -> None:
    """Where HeadTimeoutApp cannot find the request's connection (here: forgotten by the request
    before), the response says Connection: close and the connection ends with it, so no second
    head can come slowly; negative control: found, the connection stays open for the next request."""
    import socket

    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    served: list = []

    async def forget(request) -> PlainTextResponse:  # its own connection was found before this runs
        served[0].connections.clear()
        return PlainTextResponse("forgot")

    with bare_uvicorn([Route("/forget", forget)]) as (address, app):
        served.append(app)
        with socket.create_connection(address, timeout=TIMEOUT) as conn:
            conn.sendall(b"GET /forget HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"connection: close" not in read_response(conn, b"forgot").lower()
            conn.sendall(b"GET /forget HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection: kept alive
            assert b"connection: close" in read_response(conn, b"forgot").lower()  # now not found
            assert conn.recv(65536) == b""  # closed with the response


def test_a_stopped_server_leaves_the_streams_of_the_next_alone(tiny_paths: tuple[Path, Path]) -> None:
    """sse-starlette watches for uvicorn shutting down, per thread and process-wide: a server
    stopped in this process must not end the streams of a server started after it."""
    body = {"prompt": PROMPT, "max_tokens": N, "stream": True}
    for _ in range(2):
        with serving(load(tiny_paths[0], n_ctx=CTX), load(tiny_paths[1], n_ctx=CTX)) as s:
            events = s.http.post("/completions", json=body).text.split("\n\n")
            assert events[-2:] == ["data: [DONE]", ""]


def test_keep_alive_requests_are_not_delayed(served: Served) -> None:
    """Responses on a kept-alive connection are not held back by Nagle's algorithm waiting for the
    client's delayed ACK (~40 ms on Linux each, ~12x the work); a cheap request takes ~1-3 ms."""
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as client:
        client.get("/models")  # open the connection
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            assert client.get("/models").status_code == 200
            times.append(time.perf_counter() - t0)
    median = sorted(times)[len(times) // 2]
    assert median < 0.020, f"median keep-alive request {median * 1e3:.1f} ms"


def test_a_full_queue_is_refused(tiny_paths: tuple[Path, Path]) -> None:
    """Calls beyond the pair's slots wait in its queue on the core, which is bounded: past
    max_queue waiting calls, a 503 at once."""
    from localspec.errors import RequestError

    residency = Residency()
    spec = residency.adopt(Loaded(load(tiny_paths[0], parallel=2), None, "t"))
    waited: list[bool] = []

    def wait_turn() -> None:
        with residency.lease(spec, Cancel(), max_queue=1):
            waited.append(True)

    with residency.lease(spec, Cancel(), max_queue=1), residency.lease(spec, Cancel(), max_queue=1):  # both slots
        assert residency.status().pairs[0].generating == 2 and residency.status().pairs[0].queued == 0
        second = threading.Thread(target=wait_turn)
        second.start()
        deadline = time.monotonic() + 5
        while residency.status().pairs[0].queued != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(RequestError, match="the server is busy: 1 requests are waiting") as info:
            with residency.lease(spec, Cancel(), max_queue=1):
                pass
        assert info.value.status == 503
    second.join(10)
    assert waited == [True]  # the one that waited had its turn
    assert residency.close(timeout=10)


def test_api_key_is_required_when_given(tiny_target: Model) -> None:
    import openai
    from starlette.testclient import TestClient

    app = create_app(jobs.Pair.adopting(tiny_target, None, "tiny"), model_id="tiny", limits=ServerLimits(api_key="sekret"))
    with TestClient(app) as client:
        r = client.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert client.get("/health").status_code == 200  # a liveness probe needs no key
        oa = OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=client, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            oa.models.list()


# ---------------------------------------------------------------- whose fault an error is


def test_a_lone_surrogate_is_the_clients_error(served: Served) -> None:
    body = '{"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi \\ud800 there"}]}'
    r = served.http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "lone surrogate U+D800" in err["message"]
    r = served.http.post("/completions", content='{"model": "x", "max_tokens": 4, "prompt": "\\udfff"}',
                         headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_model_and_remote_failures_are_the_servers(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp failing is a 500 that blames no request field; an RPC server failing is a 502
    (503 when unreachable): never a 400 naming `messages`."""
    from localspec.decoding.engine import Engine
    from localspec.errors import ModelError, RemoteError

    for exc, status in ((ModelError("llama_decode failed with code -3"), 500),
                        (RemoteError("llama_decode failed with code -1 on the RPC server(s) h:1"), 502),
                        (RemoteError("cannot reach the RPC server at h:1", status=503), 503)):
        def fail(*args: object, _exc: Exception = exc, **kwargs: object) -> None:
            raise _exc

        monkeypatch.setattr(Engine, "steps", fail)
        r = served.http.post("/chat/completions", json={"model": "x", "messages": MESSAGES, "max_tokens": 4})
        assert r.status_code == status, (exc, r.text)
        assert r.json()["error"]["type"] == "server_error" and r.json()["error"].get("param") is None
    monkeypatch.undo()
    assert served.http.post("/chat/completions", json={"model": "x", "messages": MESSAGES,
                                                       "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("field,value", [("repeat_penalty", 1.3), ("mirostat", 2), ("typical_p", 0.5),
                                         ("dry_multiplier", 0.8), ("ignore_eos", True)])
def test_samplers_the_server_lacks_are_refused_not_ignored(served: Served, field: str, value) -> None:
    r = served.http.post("/chat/completions", json={"model": "x", "messages": MESSAGES, "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    ok = served.http.post("/chat/completions", json={"model": "x", "messages": MESSAGES, "max_tokens": 2,
                                                     "repeat_penalty": 1.0})
    assert ok.status_code == 200  # the no-op value is accepted


def test_serve_refuses_a_draft_that_cannot_draft_for_the_target(tiny_paths: tuple[Path, Path], tmp_path: Path) -> None:
    other = tiny.make_mismatched_draft(tmp_path)
    r = CliRunner().invoke(cli, ["serve", "-m", str(tiny_paths[0]), "-d", str(other), "--port", "0"])
    assert r.exit_code == 1 and "cannot draft for target" in r.output and "Traceback" not in r.output


def test_api_key_scheme_and_encoding(tiny_paths: tuple[Path, Path]) -> None:
    """RFC 7235: the scheme is case-insensitive; a non-ASCII key matches when sent as UTF-8."""
    from starlette.testclient import TestClient

    key = "clé-секрет"
    app = create_app(jobs.Pair.adopting(load(tiny_paths[0]), None, "tiny"), model_id="tiny", defaults=DEFAULTS,
                     limits=ServerLimits(api_key=key))
    with TestClient(app) as client:
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = client.get("/v1/models", headers=[(b"authorization", f"{scheme} {key}".encode())])
            assert r.status_code == 200, scheme
        assert client.get("/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/v1/models", headers={"authorization": f"Basic {key}".encode()}).status_code == 401
        assert client.get("/v1/models").status_code == 401


def test_a_client_that_hangs_up_mid_body_is_no_internal_error(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    import socket

    host, port = served.url.split("//")[1].split("/")[0].rsplit(":", 1)
    with caplog.at_level("INFO"):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 500\r\n\r\n{\"model\": \"x\", ")
            time.sleep(0.2)
        time.sleep(0.5)
    assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert served.http.get("/models").status_code == 200


# ---------------------------------------------------------------- no field silently ignored (issue 24)

# every OpenAI chat/completions field that would change the text, llama.cpp's and other servers'
# samplers, misspellings and unknown fields: a 400 naming the field unless sent as null or a no-op
NOT_HONOURED = [
    ("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"50": 10}), ("logprobs", True),
    ("top_logprobs", 2), ("best_of", 3), ("tool_choice", "required"),
    ("functions", [{}]), ("function_call", {"name": "f"}), ("modalities", ["audio"]), ("audio", {"voice": "x"}),
    ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "high"), ("verbosity", "low"),
    ("web_search_options", {}), ("min_tokens", 5), ("lenience", 0.5), ("n_predict", 5), ("samplers", ["top_k"]),
    ("xtc_threshold", 0.5), ("dry_base", 2), ("mirostat_tau", 3), ("typical", 0.5), ("max_token", 3),
    ("temprature", 0.5), ("foo", 1), ("prompt", "x"),
]


@pytest.mark.parametrize("field,value", NOT_HONOURED, ids=[f for f, _ in NOT_HONOURED])
def test_fields_the_server_cannot_honour_are_refused_by_name(served: Served, field: str, value) -> None:
    r = served.http.post("/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_misspelt_fields_name_the_right_one(served: Served) -> None:
    for wrong, right in (("max_token", "max_tokens"), ("n_predict", "max_tokens"), ("temprature", "temperature"),
                         ("typical", "typical_p")):
        r = served.http.post("/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, wrong: 1})
        assert f"'{right}'" in r.json()["error"]["message"], (wrong, r.text)
    r = served.http.post("/completions", json={"prompt": PROMPT, "max_tokens": 2, "messages": MESSAGES})
    assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"]


NO_OPS = [("foo", None), ("n", 1), ("logit_bias", {}), ("presence_penalty", 0), ("tool_choice", "none"),
          ("tool_choice", "auto"), ("modalities", ["text"]), ("user", "bob"), ("store", False),
          ("metadata", {"a": "b"}), ("service_tier", "auto"), ("prompt_cache_key", "k"), ("cache_prompt", True),
          ("parallel_tool_calls", True), ("stream_options", {"include_usage": True})]


@pytest.mark.parametrize("field,value", NO_OPS, ids=[f"{f}={v!r}" for f, v in NO_OPS])
def test_fields_that_do_not_change_the_text_are_accepted(served: Served, field: str, value) -> None:
    r = served.http.post("/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, field: value})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("message", [{"name": "bob"}, {"tool_calls": [{}]}, {"tool_call_id": "x"}, {"audio": {"id": "a"}}],
                         ids=lambda m: next(iter(m)))
def test_message_fields_the_template_cannot_render_are_refused(served: Served, message: dict) -> None:
    body = {"messages": [{"role": "user", "content": "hi", **message}], "max_tokens": 2}
    r = served.http.post("/chat/completions", json=body)
    field = next(iter(message))
    assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[0].{field}", r.text
    ok = {"messages": [{"role": "user", "content": "hi", field: None}], "max_tokens": 2}
    assert served.http.post("/chat/completions", json=ok).status_code == 200


# values a lower layer cannot represent, JSON numbers JSON cannot carry, wrong types: 400 naming the field
OUT_OF_RANGE = [
    ({"max_tokens": 2**31}, "max_tokens"), ({"max_tokens": 10**30}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"), ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 3}, "max_completion_tokens"),
    ({"seed": 2**64}, "seed"), ({"seed": 10**40}, "seed"), ({"seed": 1e3}, "seed"), ({"temperature": 10**400}, "temperature"),
    ({"top_p": 10**400}, "top_p"), ({"top_k": 10**30}, "top_k"), ({"num_draft_tokens": 2**40}, "num_draft_tokens"),
    ({"paths": 10**30}, "paths"), ({"tree": "9" * 5000}, "tree"), ({"tree": [10**30]}, "tree"), ({"tree": []}, "tree"),
    ({"tree": ""}, "tree"), ({"tree": "x".join(["1"] * 200)}, "tree"), ({"tree": [1] * 5000}, "tree"),
    ({"tree": [2] * 6, "verifier": "traversal"}, "tree"), ({"stop": [str(i) for i in range(17)]}, "stop"),
    ({"stop": "x" * 300}, "stop"), ({"stop": [5]}, "stop"), ({"model": 5}, "model"), ({"user": 5}, "user"),
    ({"stream": None}, "stream"), ({"stream": 1}, "stream"), ({"n": 0}, "n"),
]


@pytest.mark.parametrize("fields,param", OUT_OF_RANGE, ids=[f"{i}-{p}" for i, (_, p) in enumerate(OUT_OF_RANGE)])
def test_values_out_of_range_are_400_naming_the_field(served: Served, fields: dict, param: str) -> None:
    r = served.http.post("/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert len(r.json()["error"]["message"]) < 600


@pytest.mark.parametrize("raw,param", [
    (b'"temperature": NaN', "temperature"), (b'"top_p": Infinity', "top_p"), (b'"temperature": -Infinity', "temperature"),
    (b'"temperature": 1e400', "temperature"), (b'"foo": NaN', "foo"), (b'"stop": "\\ud800"', "stop"),
    (b'"max_tokens": ' + b"9" * 5000, None),
], ids=["nan", "inf", "-inf", "1e400", "nan-unknown", "surrogate-stop", "5000-digits"])
def test_json_the_request_cannot_use_is_400(served: Served, raw: bytes, param: str | None) -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ' + raw + b"}"
    r = served.http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_decode_json_refuses_duplicate_keys() -> None:
    """app.parse_json's decoder: a field given twice is an error, not "the last one wins"; NaN and
    Infinity literals decode, for schemas.parse to refuse naming the field (the test above)."""
    from localspec.errors import RequestError

    assert schemas.decode_json(b'{"a": 1, "b": [1.5, {"c": null}]}') == {"a": 1, "b": [1.5, {"c": None}]}
    with pytest.raises(RequestError, match="names 'max_tokens' twice") as info:
        schemas.decode_json(b'{"max_tokens": 2, "max_tokens": 3}')
    assert info.value.param == "max_tokens"
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        assert not math.isfinite(schemas.decode_json(b'{"t": ' + literal + b"}")["t"])


# ---------------------------------------------------------------- structured output

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                                           "level": {"enum": ["low", "high"]}},
          "required": ["name", "ok", "level"], "additionalProperties": False}


def test_response_format_json_schema_and_object(served: Served) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = served.openai.chat.completions.create(model="x", messages=MESSAGES, max_tokens=80, temperature=0.7, seed=2,
                                              response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    assert list(value) == ["name", "ok", "level"] and value["level"] in ("low", "high")
    r = served.http.post("/completions", json={"prompt": PROMPT, "max_tokens": 100, "temperature": 0,
                                               "response_format": {"type": "json_object"}}).json()
    choice = r["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    r = served.http.post("/completions", json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0.5, "seed": 1,
                                               "grammar": 'root ::= "def " [a-z] [a-z]? "():"'}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"].startswith("def ")
    r = served.http.post("/completions", json={"prompt": PROMPT, "max_tokens": 80, "temperature": 0.5, "seed": 1,
                                               "json_schema": PERSON, "stream": False}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and list(json.loads(r["choices"][0]["text"])) == list(PERSON["properties"])


def test_openai_parse_with_a_pydantic_model(served: Served) -> None:
    """client.chat.completions.parse(response_format=Model): the reply parses into the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=6)
        ok: bool
        level: Literal["low", "high"]

    r = served.openai.chat.completions.parse(model="x", messages=MESSAGES, max_tokens=80, temperature=0.7, seed=3,
                                             response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.level in ("low", "high")


def test_each_server_has_its_own_table_of_connections() -> None:
    """Two servers in one process (as the tests run them) never find each other's connections: a
    client may reach both from the same address, and re-arming the other server's connection would
    close it mid-request."""
    from starlette.applications import Starlette

    first, second = uvicorn_config(Starlette(), LIMITS), uvicorn_config(Starlette(), LIMITS)
    assert first.app.connections is first.http.connections
    assert second.app.connections is second.http.connections
    assert first.http.connections is not second.http.connections
