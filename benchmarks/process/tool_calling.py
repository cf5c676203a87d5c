"""Tool-calling benchmark: OpenAI-style tool calls as users run them, whole process.

Two tables, each alternating localspec's default settings (warm: the cost profile a first run
left) with the target alone (``-d none -k 0``), fresh processes, T = 0, medians:

* **CLI**: one ``localspec --tools FILE --tool-choice CHOICE --json`` process per run, for a few tasks (a single call, a
  call with several typed arguments, two calls in parallel); columns: the calls made, whether
  they are valid for the functions' schemas, forced % (tokens the grammar forces), tokens per
  target pass, whole-process seconds and the ratio.
* **Server round trip**: ``localspec serve`` started fresh, then the official ``openai`` client
  sends the weather request (``tool_choice`` left out: ``auto``), runs the "tool" and sends its result back
  for the final answer (without the tools: see docs/server.md), then the server stops: seconds from spawning the
  server to the final answer, and the ratio. The transcript of the first default round trip is
  printed too (docs/server.md quotes it).

    python benchmarks/tool_calling.py                 # both tables, 3 repeats
    python benchmarks/tool_calling.py --repeat 5 --no-server --tool-choice required

Progress goes to stderr, the markdown to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from benchmarks.common.host import host_header
from benchmarks.common.options import checked_args, progress, task_options
from benchmarks.common.runs import TARGET_ALONE, Run, localspec

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
EVENT = {"type": "function", "function": {
    "name": "create_event", "description": "Add an event to the user's calendar",
    "parameters": {"type": "object", "properties": {
        "title": {"type": "string"}, "date": {"type": "string", "description": "YYYY-MM-DD"},
        "start_hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "attendees": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "date", "start_hour", "attendees"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search_code", "description": "Search the repository for a string",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                   "required": ["query"], "additionalProperties": False}}}


@dataclass(frozen=True)
class Task:
    prompt: str
    tools: tuple[dict, ...]


TASKS = {
    "weather": Task("What's the weather like in Paris today?", (WEATHER, SEARCH)),
    "event": Task("Put a meeting called 'Quarterly review' with Alice and Bob in my calendar on 2026-12-03 "
                  "at 14:00.", (EVENT, WEATHER)),
    "parallel": Task("What's the weather in Paris and in Tokyo? Use celsius.", (WEATHER,)),
}
TOOL_RESULT = {"city": "Paris", "temperature": 8, "unit": "celsius", "conditions": "light rain"}


def _valid(calls: list[dict], tools: Sequence[dict]) -> bool:
    """Every call names a tool and its arguments are valid for its schema (jsonschema)."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    try:
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    except (KeyError, ValueError, jsonschema.ValidationError):
        return False
    return bool(calls)


def _forced_share(run: Run) -> float:
    kinds = run.data["stats"]["accepted_by_kind"]
    return kinds.get("forced", 0) / max(run.tokens, 1)


def cli_row(name: str, task: Task, args: argparse.Namespace, root: Path) -> str:
    tools_file = root / f"{name}.json"
    tools_file.write_text(json.dumps(list(task.tools)), encoding="utf-8")
    common = ["-n", str(args.tokens), "-t", "0", "--seed", "1", "--tools", str(tools_file),
              "--tool-choice", args.tool_choice]
    progress(f"{name}: warm-up")
    localspec(common, task.prompt, root / "warm", args.threads)
    default: list[Run] = []
    alone: list[Run] = []
    for r in range(args.repeat):
        progress(f"{name}: {r + 1}/{args.repeat}")
        default.append(localspec(common, task.prompt, root / "warm", args.threads))
        alone.append(localspec([*common, *TARGET_ALONE], task.prompt, root / "alone", args.threads))
    med = statistics.median
    calls = default[0].data.get("tool_calls") or []
    shown = "; ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in calls) or "(none)"
    valid = all(_valid(r.data.get("tool_calls") or [], task.tools) for r in default + alone)
    same = all(r.data.get("tool_calls") and [c["function"] for c in r.data["tool_calls"]] ==
               [c["function"] for c in calls] for r in default + alone)
    return (f"| {name} | `{shown}` | {'yes' if valid else 'NO'}{'' if same else ' (calls differ)'} | "
            f"{med(r.tokens for r in default):.0f} | {100 * med(_forced_share(r) for r in default):.0f} | "
            f"{med(r.data['stats']['block_efficiency'] for r in default):.2f} | "
            f"{med(r.wall for r in default):.2f} | {med(r.wall for r in alone):.2f} | "
            f"**{med(r.wall for r in alone) / med(r.wall for r in default):.2f}×** |")


CLI_HEADER = ["| task | calls (default's) | valid | tokens | forced % | tokens/pass | default s | "
              "target alone s | **default vs alone** |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]


# ---------------------------------------------------------------- the server round trip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, server: subprocess.Popen, timeout: float = 300.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"localspec serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("localspec serve did not become ready")


def round_trip(extra: Sequence[str], profile_dir: Path, args: argparse.Namespace) -> tuple[float, list[dict]]:
    """Seconds from spawning `localspec serve` to the final answer of the weather round trip, and
    the transcript (the messages, the model's replies)."""
    import openai

    port = _free_port()
    env = dict(os.environ, LOCALSPEC_PROFILE_DIR=str(profile_dir))
    cmd = [sys.executable, "-m", "localspec", "serve", "--port", str(port), "-t", "0", "--seed", "1",
           *(["--threads", str(args.threads)] if args.threads else []), *extra]
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", server)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        messages: list[dict] = [{"role": "user", "content": TASKS["weather"].prompt}]
        sent = cast("list[ChatCompletionMessageParam]", messages)  # the same list, typed as openai's client takes it
        first = client.chat.completions.create(model="default", messages=sent,
                                               tools=[cast("ChatCompletionToolParam", WEATHER)], max_tokens=args.tokens)
        reply = first.choices[0].message
        messages.append(reply.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        for call in reply.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(TOOL_RESULT)})
        # the result goes back without the tools: with them in the prompt again, the default 1.5B
        # coder model calls again instead of answering (docs/server.md)
        final = client.chat.completions.create(model="default", messages=sent, max_tokens=args.tokens)
        seconds = time.perf_counter() - t0
        messages.append({"role": "assistant", "content": final.choices[0].message.content,
                         "finish_reason": final.choices[0].finish_reason})
        messages[1]["finish_reason"] = first.choices[0].finish_reason
        return seconds, messages
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def server_rows(args: argparse.Namespace, root: Path) -> tuple[list[str], list[dict]]:
    progress("server round trip: warm-up")
    _, transcript = round_trip([], root / "warm", args)
    default, alone = [], []
    for r in range(args.repeat):
        progress(f"server round trip: {r + 1}/{args.repeat}")
        default.append(round_trip([], root / "warm", args)[0])
        alone.append(round_trip(list(TARGET_ALONE), root / "alone", args)[0])
    med = statistics.median
    rows = ["| round trip | default s | target alone s | **default vs alone** |", "| --- | ---: | ---: | ---: |",
            f"| weather: call, tool result, answer | {med(default):.2f} | {med(alone):.2f} | "
            f"**{med(alone) / med(default):.2f}×** |"]
    return rows, transcript


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    task_options(p, TASKS, tokens=200, per="answer")
    p.add_argument("--tool-choice", choices=("auto", "required"), default="auto",
                   help="tool_choice of the CLI tasks (default auto, as clients send it; the round trip "
                        "always leaves it out)")
    p.add_argument("--no-server", action="store_true", help="skip the server round trip")
    return checked_args(p, argv, TASKS)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="localspec-tools-") as tmp:
        print("\n".join(host_header()))
        print()
        rows = [cli_row(name, TASKS[name], args, Path(tmp)) for name in args.tasks]
        print("\n".join(CLI_HEADER + rows))
        if not args.no_server:
            table, transcript = server_rows(args, Path(tmp))
            print()
            print("\n".join(table))
            print("\nTranscript (first default round trip):\n")
            print("```json")
            print("\n".join(json.dumps(m, ensure_ascii=False) for m in transcript))
            print("```")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
