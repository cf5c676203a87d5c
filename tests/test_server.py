"""The OpenAI-compatible server on the tiny models: the real openai client against uvicorn in a
background thread, lossless at temperature 0 end to end, OpenAI-style errors for bad input, a
client that disconnects mid-stream stops its generation, concurrent clients queue, and the
`localspec serve` command (help, a missing model, a real run stopped with Ctrl-C)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from click.testing import CliRunner
from openai import OpenAI

from localspec import server
from localspec.api import generate, stream_generate
from localspec.cli import cli
from localspec.model import Model

from conftest import load

PROMPT = "def add(a, b): return a"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
N = 12  # max_tokens of most requests
CTX = 2048  # the served models' context (long enough for a generation a disconnect interrupts)
# the server's defaults: greedy, always draft (the planner of plan=auto may decline on tiny models)
DEFAULTS = dict(temperature=0.0, max_tokens=N, plan="fixed", num_draft_tokens=4)
TIMEOUT = 30.0


class Served:
    def __init__(self, url: str, worker: server.ModelWorker) -> None:
        self.url = url
        self.worker = worker
        self.http = httpx.Client(base_url=url, timeout=TIMEOUT)
        self.openai = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def served(tiny_paths: tuple[Path, Path]) -> Iterator[Served]:
    """uvicorn serving its own instances of the tiny pair on a free port."""
    import uvicorn

    target, draft = load(tiny_paths[0], n_ctx=CTX), load(tiny_paths[1], n_ctx=CTX)
    app = server.create_app(target, draft, model_id="tiny-pair", defaults=DEFAULTS)
    sock = server.bind_socket("127.0.0.1", 0)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    s = Served(server.base_url(sock), app.state.worker)
    yield s
    s.http.close()
    uv.should_exit = True
    thread.join(10)
    assert not thread.is_alive()
    sock.close()
    target.close()
    draft.close()


def reference(target: Model, prompt, max_tokens: int = N) -> tuple[str, int]:
    """The target-only greedy text and its token count (what every lossless setting must give)."""
    responses = list(stream_generate(target, None, prompt, max_tokens=max_tokens, temperature=0))
    assert generate(target, None, prompt, max_tokens=max_tokens, temperature=0) == \
        "".join(r.text for r in responses)
    return "".join(r.text for r in responses), len(responses)


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
    text, n_tokens = reference(tiny_target, MESSAGES)
    r = served.openai.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=N,
                                              temperature=0, extra_body=extra)
    assert r.object == "chat.completion" and r.model == "tiny-pair"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == ("length" if n_tokens == N else "stop")
    assert r.usage.completion_tokens == n_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + n_tokens
    assert_spec(r.model_extra["speculative"], verifier=extra["verifier"], drafter="model", plan="fixed",
                tree=extra.get("tree"))
    assert r.model_extra["speculative"]["target_passes"] < n_tokens  # drafts were accepted


def test_chat_stream(served: Served, tiny_target: Model) -> None:
    text, n_tokens = reference(tiny_target, MESSAGES)
    chunks = list(served.openai.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=dict(verifier="traversal", tree="2x2")))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length" if n_tokens == N else "stop"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == n_tokens
    assert_spec(last.model_extra["speculative"], verifier="traversal", tree=[2, 2])


def test_completion_and_stream(served: Served, tiny_target: Model) -> None:
    text, n_tokens = reference(tiny_target, PROMPT)
    r = served.openai.completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == text
    assert r.usage.completion_tokens == n_tokens
    assert_spec(r.model_extra["speculative"], verifier="block", num_draft_tokens=4, tree=None)

    chunks = list(served.openai.completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0,
                                                   stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert_spec(chunks[-1].model_extra["speculative"], verifier="block")


def test_raw_sse_format(served: Served) -> None:
    r = served.http.post("/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert "speculative" in json.loads(events[-3][len("data: "):])


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
    ("/chat/completions", b"[1, 2]", "JSON object", None),
    ("/chat/completions", {"model": "x"}, "'messages' is required", "messages"),
    ("/chat/completions", {"messages": "hello"}, "'messages' must be a non-empty list", "messages"),
    ("/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content", "messages[0].content"),
    ("/chat/completions", {"messages": MESSAGES, "n": 2}, "'n' must be 1", "n"),
    ("/chat/completions", {"messages": MESSAGES, "verifier": "nope"}, "'verifier' must be one of", "verifier"),
    ("/chat/completions", {"messages": MESSAGES, "verifier": "block", "tree": [2, 2]},
     "verifier 'block' verifies one chain", "verifier"),
    ("/chat/completions", {"messages": MESSAGES, "max_tokens": -1}, "'max_tokens' must be an integer >= 1",
     "max_tokens"),
    ("/chat/completions", {"messages": MESSAGES, "temperature": -0.5}, "'temperature' must be a number >= 0",
     "temperature"),
    ("/chat/completions", {"messages": MESSAGES, "tree": "3xa"}, "not a branching list", "tree"),
    ("/chat/completions", {"messages": MESSAGES, "top_p": 0}, "'top_p' must be a number in (0, 1]", "top_p"),
    ("/chat/completions", {"messages": MESSAGES, "stream": "yes"}, "'stream' must be true or false", "stream"),
    ("/completions", {"prompt": 42}, "'prompt' must be a string", "prompt"),
    ("/completions", {"prompt": PROMPT, "logprobs": 3}, "'logprobs' is not supported", "logprobs"),
    ("/completions", {"prompt": "hello world " * 1000}, "context holds 2048", "prompt"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hello world " * 1000}], "stream": True},
     "context holds 2048", "messages"),
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


def test_internal_errors_are_json_500(served: Served, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    def broken_parse(*args, **kwargs):
        raise RuntimeError("parser bug")

    def broken_stream(*args, **kwargs):
        yield from ()
        raise RuntimeError("engine bug")

    body = {"prompt": PROMPT, "max_tokens": 2}
    with monkeypatch.context() as m:
        m.setattr(server, "parse_request", broken_parse)
        r = served.http.post("/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "Traceback" not in r.text
    with monkeypatch.context() as m:
        m.setattr(server, "stream_generate", broken_stream)
        r = served.http.post("/completions", json=body)
        assert r.status_code == 500 and "engine bug" in r.json()["error"]["message"]
    assert any("generation failed" in rec.message for rec in caplog.records)
    assert served.http.post("/completions", json=body).status_code == 200  # and the server goes on


# ---------------------------------------------------------------- disconnects and concurrency


def test_disconnect_mid_stream_stops_generation(served: Served, tiny_target: Model) -> None:
    max_tokens = CTX - 100  # far more than one chunk: the generation must be cut short
    stopped = served.worker.stopped_early
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "num_draft_tokens": 0}
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as client:
        with client.stream("POST", "/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            # the event loop answers while the model generates
            health = served.http.get(served.url.removesuffix("/v1") + "/health", timeout=5).json()
            assert health["busy"] is True and health["model"] == "tiny-pair"
    deadline = time.monotonic() + TIMEOUT
    while served.worker.stopped_early == stopped or served.worker.busy.locked():
        assert time.monotonic() < deadline, "the generation of a disconnected client kept running"
        time.sleep(0.01)
    # the lock is free and the caches are reusable: the next request is lossless
    text, _ = reference(tiny_target, PROMPT)
    r = served.openai.completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0, timeout=10)
    assert r.choices[0].text == text


def test_disconnect_non_streaming(served: Served, tiny_target: Model) -> None:
    """A non-streaming client that gives up (a timeout) does not keep the model busy."""
    stopped = served.worker.stopped_early
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/completions", timeout=0.1,
                   json={"prompt": PROMPT, "max_tokens": CTX - 100, "num_draft_tokens": 0})
    deadline = time.monotonic() + TIMEOUT
    while served.worker.stopped_early == stopped or served.worker.busy.locked():
        assert time.monotonic() < deadline, "the generation of a disconnected client kept running"
        time.sleep(0.01)


def test_concurrent_clients(served: Served, tiny_target: Model) -> None:
    text, _ = reference(tiny_target, MESSAGES, max_tokens=16)
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
    assert results == {i: text for i in range(4)}


# ---------------------------------------------------------------- the command


def test_serve_help() -> None:
    r = CliRunner().invoke(cli, ["serve", "--help"])
    assert r.exit_code == 0
    for text in ("OpenAI-compatible", "--host", "--port", "--verifier", "/v1/chat/completions", "curl",
                 "base_url="):
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
    sock = server.bind_socket("127.0.0.1", 0)
    sock.listen()
    try:
        port = sock.getsockname()[1]
        r = CliRunner().invoke(cli, ["serve", "-m", "/nonexistent.gguf", "--port", str(port)])
        assert r.exit_code != 0 and f"cannot listen on 127.0.0.1:{port}" in r.output
        assert "Traceback" not in r.output
    finally:
        sock.close()


def test_serve_command_runs_and_stops(tiny_paths: tuple[Path, Path]) -> None:
    """The real command in a subprocess: it announces the URL, answers, and Ctrl-C stops it cleanly."""
    proc = subprocess.Popen([sys.executable, "-m", "localspec", "serve", "-m", str(tiny_paths[0]),
                             "-d", str(tiny_paths[1]), "--port", "0", "--ctx-size", "4096", "--threads", "1",
                             "-t", "0", "-n", "5"],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
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
