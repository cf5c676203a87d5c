"""The GPU check's feature steps (benchmarks/gpu_check.py): constrained output, a tool call, the
server round trip and the prompt cache's save and restore of device-resident KV, on tiny models
with every layer offloaded (see steps.py for the framework)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any, Iterator

from localspec.api import stream_generate
from localspec.llama.model import Model

from benchmarks.gpu.steps import EXACT, NEAR_TIE, Context, StepFailed, greedy_difference, tokens_of

# ---------------------------------------------------------------- constrained output and a tool call

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


def schema_problem(text: str) -> str | None:
    """Why `text` is not an instance of SCHEMA (None: it is)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON ({exc}): {text[:80]!r}"
    if not isinstance(value, dict) or set(value) != {"name", "n"}:
        return f"not an object with exactly name and n: {text[:80]!r}"
    if not isinstance(value["name"], str) or not 1 <= len(value["name"]) <= 6:
        return f"name is not a string of 1 to 6 characters: {text[:80]!r}"
    if isinstance(value["n"], bool) or not isinstance(value["n"], int) or not 0 <= value["n"] <= 99:
        return f"n is not an integer in [0, 99]: {text[:80]!r}"
    return None


def step_constrained(ctx: Context) -> tuple[str, dict]:
    """A JSON schema, speculating with the draft: every answer is valid, and at T = 0 the
    constrained speculative output is the constrained target alone's."""
    target, draft = ctx.model("f32_target", **EXACT), ctx.model("f32_draft", **EXACT)
    kw = dict(json_schema=SCHEMA, max_tokens=60, verifier="block", num_draft_tokens=4, drafter="model")
    faults, texts = [], []
    for seed in range(ctx.scale.seeds):
        rs = list(stream_generate(target, draft, "data:", seed=seed, temperature=1.0, plan="fixed", **kw))
        text = "".join(r.text for r in rs)
        texts.append(text)
        problem = schema_problem(text) or (None if rs[-1].constraint_satisfied else "constraint not satisfied")
        if problem:
            faults.append(f"seed {seed}: {problem}")
    spec = tokens_of(target, draft, "data:", temperature=0, **kw)
    plain = tokens_of(target, None, "data:", temperature=0, json_schema=SCHEMA, max_tokens=60, num_draft_tokens=0)
    verdict, gap = greedy_difference(target, "data:", spec, plain, NEAR_TIE["f32"])
    data = {"answers": texts, "greedy": verdict, "gap": gap}
    if verdict not in ("equal", "near-tie"):
        faults.append(f"T = 0: {verdict}")
    if faults:
        raise StepFailed("; ".join(faults), data)
    return f"{len(texts)} sampled answers valid for the schema, T = 0 {verdict} (e.g. {texts[0]})", data


TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


def step_tool_call(ctx: Context) -> tuple[str, dict]:
    """tool_choice "required" on the tool-calling tiny pair: each answer is a call of get_time with valid arguments."""
    target = ctx.model("tools_target", ctx_size=2048)
    draft = ctx.model("tools_draft", ctx_size=2048)
    messages = [{"role": "user", "content": "what time is it?"}]
    calls, faults = [], []
    for seed in range(ctx.scale.seeds):
        rs = list(stream_generate(target, draft, messages, tools=[TIME_TOOL], tool_choice="required", seed=seed,
                                  parallel_tool_calls=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                  max_tokens=200))
        last = rs[-1]
        got = [(c.name, c.arguments) for c in last.tool_calls]
        calls.append(got)
        args = [json.loads(a) for _, a in got] if got else []
        if last.finish_reason != "tool_calls" or not got or any(n != "get_time" for n, _ in got) or any(
                a.get("zone") not in ("utc", "cet") or set(a) != {"zone"} for a in args):
            faults.append(f"seed {seed}: finish {last.finish_reason}, calls {got}")
    if faults:
        raise StepFailed("; ".join(faults), {"calls": calls})
    return f"{len(calls)} answers, each a valid call (e.g. {calls[0][0][0]}({calls[0][0][1]}))", {"calls": calls}


# ---------------------------------------------------------------- the server


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """uvicorn serving `app` on a free port in a thread (tests/serving.py's); yields the base URL."""
    import uvicorn

    from localspec.server import ServerLimits
    from localspec.server.run import base_url, bind_socket, uvicorn_config

    sock = bind_socket("127.0.0.1", 0)
    uv = uvicorn.Server(uvicorn_config(app, ServerLimits()))
    thread = threading.Thread(target=uv.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise StepFailed("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield base_url(sock)
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()


def step_server(ctx: Context) -> tuple[str, dict]:
    """A chat completion through the OpenAI-compatible server (plain and streamed, T = 0): both
    equal the target alone's greedy answer."""
    import httpx

    from localspec.settings.generation import GenerationConfig
    from localspec.server.app import create_app
    from localspec.server.jobs import Pair

    messages = [{"role": "user", "content": "hello there"}]
    defaults = GenerationConfig.from_options(temperature=0.0, max_tokens=24, plan="fixed", num_draft_tokens=4,
                                             drafter="model")
    target, draft = ctx.model("f32_target", **EXACT), ctx.model("f32_draft", **EXACT)
    app = create_app(Pair.adopting(target, draft, "gpu-check"), model_id="gpu-check", defaults=defaults)
    with serving(app) as url, httpx.Client(base_url=url, timeout=120) as http:
        models = http.get("/models").json()
        body = {"model": "gpu-check", "messages": messages}
        plain = http.post("/chat/completions", json=body)
        pieces = []
        with http.stream("POST", "/chat/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:]).get("choices", []):
                        pieces.append((choice.get("delta") or {}).get("content") or "")
    if plain.status_code != 200:
        raise StepFailed(f"HTTP {plain.status_code}: {plain.text[:300]}")
    text = plain.json()["choices"][0]["message"]["content"]
    want = "".join(r.text for r in stream_generate(target, None, messages, temperature=0, max_tokens=24,
                                                   num_draft_tokens=0))
    data = {"models": [m["id"] for m in models.get("data", [])], "text": text, "streamed": "".join(pieces),
            "target_alone": want, "speculative": plain.json().get("speculative")}
    if text != data["streamed"]:
        raise StepFailed(f"streamed text differs from the plain answer: {data['streamed']!r} vs {text!r}", data)
    if text != want:
        raise StepFailed(f"the served answer differs from the target alone's: {text!r} vs {want!r}", data)
    return f"200, plain = streamed = target alone ({len(text)} characters)", data


# ---------------------------------------------------------------- the prompt cache

DOC = "def add(a, b):\n    return a + b\n\n" * 6 + "\nQ: what does add do?"


def step_prompt_cache(ctx: Context) -> tuple[str, dict]:
    """Save and restore of GPU-resident KV state (Q4_K_M pair's target, F16 KV): the restored cells are
    the saved ones byte for byte, and the output after a restore (same model; a fresh load) is unchanged."""
    from localspec.api import Generation
    from localspec.settings.generation import GenerationConfig
    from localspec.decoding.profiles import Profiles
    from localspec.llama.prompt_cache import PromptCache

    settings = GenerationConfig.from_options(temperature=0.0, max_tokens=12, drafter="ngram", plan="fixed",
                                             num_draft_tokens=4)
    cache = PromptCache(ctx.work / "prompt-cache")
    cache.clear()

    def run(model: Model, prompt: list[int]) -> tuple[list[int], Any]:
        g = Generation(model, None, prompt, settings, Profiles.in_memory(), cache)
        return [r.token for r in g if r.token is not None], g

    model = ctx.model("q4_k_m_target")
    prompt = model.tokenize(DOC)
    model.clear()
    first, g = run(model, prompt)
    entries = cache.entries()
    if g.restored != 0 or len(entries) != 1:
        raise StepFailed(f"the first run restored {g.restored} tokens and left {len(entries)} entries (want 0, 1)")
    model.clear()
    restored = cache.restore(model, prompt + prompt[-1:])  # a longer prompt takes the whole entry
    identical = model.seq_state() == cache.load(entries[0])
    model.clear()
    again, g2 = run(model, prompt)
    with Model(ctx.path("q4_k_m_target"), model.options) as fresh:
        third, g3 = run(fresh, prompt)
    # a restored run decodes the prompt's last token alone, a cold one within the prefill's batch:
    # their text differs only where the target's two best tokens tie in the last bits
    data = {"prompt_tokens": len(prompt), "restored": restored, "bit_identical": identical,
            "restored_same_model": g2.restored, "restored_fresh_model": g3.restored,
            "same_text_as_cold": again == first,
            "entry_bytes": entries[0].size if hasattr(entries[0], "size") else None}
    faults = []
    if restored != len(prompt) or not identical:
        faults.append(f"restore gave {restored} tokens (want {len(prompt)}), state identical: {identical}")
    if g2.restored != len(prompt) - 1 or g3.restored != len(prompt) - 1:
        faults.append(f"a later run restored {g2.restored} tokens, a fresh load {g3.restored} (want {len(prompt) - 1})")
    if third != again:
        faults.append("the same restore gave another output in a fresh load")
    if faults:
        raise StepFailed("; ".join(faults), data)
    return f"{restored} tokens restored bit for bit; output unchanged after a restore and in a fresh load", data
