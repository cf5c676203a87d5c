"""Many calls at once on one pair: K clients, each with its own new question, against the servers
users would run instead.

Per K (clients at once) and temperature, each configuration serves a round of K clients at once,
each asking its new questions in turn (four requests a round at least: one client asks four;
the same questions for every configuration; every server started afresh each round, localspec's
prompt cache empty, a warm-up request first, not timed), --repeat rounds alternated between the
configurations, medians:

* ``localspec serve`` (the default pair, its defaults: slots for K calls) through its
  ``/v1/chat/completions``, streamed (time to first token from the first content delta);
* the command line, ``K × localspec`` at once (as ``xargs -P K localspec ...``), the per-user
  service resident (started by a warm-up call);
* llama.cpp's ``llama-server`` (built natively from the vendored llama.cpp; the target alone,
  the GGUF's own chat template with ``--jinja``, as localspec renders it) with ``-np 1``, with
  ``-np K`` and with its default slots, each slot holding the context localspec's slots hold.

The grounded set is four clients editing four files (the answer copies its file: drafts pay).
Tables: aggregate generated tokens per second over the round (all tokens / the round's wall
time), p50/p95 time to first token and per-request time, and localspec over the best llama-server
configuration at that K.

    python benchmarks/concurrency.py                          # K = 1, 2, 4, 8; T = 0 and 0.8
    python benchmarks/concurrency.py --clients 1,4 --temperatures 0 --repeat 1 --no-cli
    python benchmarks/concurrency.py --held-cells            # what an idle slot's cells cost the others

Progress goes to stderr, the markdown tables to stdout.
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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common.host import host_header
from benchmarks.common.llama_tools import completion_flags, native_llama_tools
from benchmarks.common.options import progress
from benchmarks.common.target import default_target

MAX_TOKENS = 96
ROUND_REQUESTS = 4  # requests a round makes at least (each client's in turn)
CTX = 4096  # context per slot, on both sides
TASKS = ("reverses a string", "checks whether a year is a leap year", "merges two sorted lists", "counts vowels",
         "flattens a nested list", "returns the n-th prime", "parses an ISO date", "computes a moving average",
         "finds duplicates in a list", "converts Celsius to Fahrenheit", "validates an email address",
         "chunks a list into pieces of n", "computes the GCD of two numbers", "rotates a matrix",
         "deduplicates a list keeping order", "capitalises every word", "sums the digits of a number",
         "computes a factorial iteratively", "finds the longest word in a sentence", "transposes a matrix",
         "checks for balanced brackets", "returns the median of a list", "counts word frequencies",
         "converts a Roman numeral to an integer", "groups anagrams", "computes Fibonacci numbers",
         "removes punctuation from text", "checks whether a number is a power of two", "zips two lists into a dict",
         "finds the second largest number", "pads a string on the left", "computes compound interest")
_FILES = {
    "js": "function totalPrice(items, taxRate) {\n  let total = 0;\n  for (const item of items) {\n"
          "    if (item.quantity <= 0) {\n      continue;\n    }\n    total += item.price * item.quantity;\n  }\n"
          "  const tax = total * taxRate;\n  return Math.round((total + tax) * 100) / 100;\n}\n",
    "py": "def parse_config(path):\n    result = {}\n    with open(path) as handle:\n        for line in handle:\n"
          "            line = line.strip()\n            if not line or line.startswith('#'):\n                continue\n"
          "            key, value = line.split('=', 1)\n            result[key.strip()] = value.strip()\n"
          "    return result\n",
    "go": "func countWords(lines []string) map[string]int {\n\tcounts := make(map[string]int)\n"
          "\tfor _, line := range lines {\n\t\tfor _, word := range strings.Fields(line) {\n"
          "\t\t\tword = strings.ToLower(word)\n\t\t\tcounts[word]++\n\t\t}\n\t}\n\treturn counts\n}\n",
    "sql": "SELECT customers.name, orders.total\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n"
           "WHERE orders.created_at >= '2024-01-01'\nORDER BY orders.total DESC\nLIMIT 10;\n",
}
_EDITS = ("Rename the first variable to a longer, clearer name and show the whole code:",
          "Add a short comment above the first line and show the whole code:",
          "Change the indentation to four spaces and show the whole code:",
          "Add a blank line before the return and show the whole code:")


def new_question(round_: int, n: int, temperature: float) -> str:
    """The round's n-th question, one no earlier request of the round asked (nor of the two rounds
    before it: a round asks at most 8)."""
    task = TASKS[(round_ * 8 + n + (16 if temperature else 0)) % len(TASKS)]
    return f"Write a Python function that {task}. Keep it short."


def new_questions(clients: int, temperature: float) -> Callable[[int], list[list[str]]]:
    """A round's new questions: each client's, asked one after another, at least ROUND_REQUESTS in
    the round (one client alone asks four questions in turn: one request is too few to time)."""
    per_client = max(1, ROUND_REQUESTS // clients)
    return lambda round_: [[new_question(round_, c * per_client + j, temperature) for j in range(per_client)]
                           for c in range(clients)]


def grounded_question(round_: int, client: int) -> str:
    name = list(_FILES)[client % len(_FILES)]
    return f"{_EDITS[(round_ + client) % len(_EDITS)]}\n\n{_FILES[name]}"


@dataclass
class Result:
    """One request: seconds to its first token and to its end, tokens generated."""

    ttft: float
    total: float
    tokens: int


@dataclass
class Round:
    wall: float
    results: list[Result] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return sum(r.tokens for r in self.results) / self.wall


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {proc.stderr.read().decode()[-1500:] if proc.stderr else ''}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not come up in {timeout:.0f} s")


class Http:
    """A server with OpenAI's /v1/chat/completions, started for one round."""

    def __init__(self, cmd: list[str], port: int, health: str, what: str, env: dict[str, str] | None = None) -> None:
        self.url, self.what = f"http://127.0.0.1:{port}", what
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     env=env)
        wait_healthy(self.url + health, self.proc, what)

    def ask(self, question: str, temperature: float, seed: int) -> Result:
        import httpx

        body = {"model": "x", "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
                "temperature": temperature, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
        t0, first, tokens = time.perf_counter(), None, 0
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=1800) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        total = time.perf_counter() - t0
        return Result(first if first is not None else total, total, tokens)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def localspec_server(k: int, env: dict[str, str]) -> Http:
    port = free_port()
    cmd = [sys.executable, "-m", "localspec", "serve", "--port", str(port), "--parallel", str(max(k, 4)),
           "--max-queue", "64"]
    return Http(cmd, port, "/health", "localspec serve", env)


def llama_server(bindir: Path, slots: int | None) -> Http:
    """llama-server with `slots` slots (None: its default), each with CTX tokens."""
    port = free_port()
    n = slots or 4
    cmd = [str(bindir / "llama-server"), "-m", str(default_target()), "--port", str(port), "--jinja",
           "-c", str(CTX * n), *(["-np", str(slots)] if slots else []), *completion_flags()[4:]]
    return Http(cmd, port, "/health", f"llama-server -np {slots or 'default'}")


def cli_ask(question: str, temperature: float, seed: int, env: dict[str, str]) -> Result:
    """One `localspec` process served by the resident service; its first token came when the
    generation's decode began (its --json timings: the process's wall time less the decode's)."""
    cmd = [sys.executable, "-m", "localspec", "--json", "-t", str(temperature), "--seed", str(seed),
           "-n", str(MAX_TOKENS), "-u", question]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, stdin=subprocess.DEVNULL)
    total = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"localspec failed: {out.stderr[-1500:]}")
    data = json.loads(out.stdout)
    return Result(total - data["timings"].get("decode", 0.0), total, data["usage"]["completion_tokens"])


def run_round(ask: Callable[[str, float, int], Result], questions: Sequence[Sequence[str]],
              temperature: float) -> Round:
    """The K clients at once (a thread each), each asking its questions in turn; the round's wall
    time and each result."""
    results: list[list[Result]] = [[] for _ in questions]
    errors: list[BaseException] = []
    start = threading.Barrier(len(questions) + 1)

    def one(i: int) -> None:
        start.wait()
        try:
            for j, question in enumerate(questions[i]):
                results[i].append(ask(question, temperature, 1000 + 10 * i + j))
        except BaseException as exc:  # noqa: BLE001 - reported after the round
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return Round(time.perf_counter() - t0, [r for client in results for r in client])


def configurations(k: int, bindir: Path | None, cli: bool, env: dict[str, str]) -> dict[str, Callable[[], Http | None]]:
    """Each configuration's way to start what serves a round (None: the command line's service)."""
    out: dict[str, Callable[[], Http | None]] = {"localspec serve": lambda: localspec_server(k, env)}
    if cli:
        out["localspec CLI"] = lambda: None
    if bindir is not None:
        out["llama-server -np 1"] = lambda: llama_server(bindir, 1)
        if k > 1:
            out[f"llama-server -np {k}"] = lambda: llama_server(bindir, k)
        out["llama-server default"] = lambda: llama_server(bindir, None)
    return out


def measure_round(name: str, start: Callable[[], Http | None], questions: list[list[str]], temperature: float,
                  env: dict[str, str]) -> Round:
    """One round of one configuration: what serves it started afresh (localspec with an empty
    prompt cache of its own: nothing saved by another configuration or round), warmed up, then the
    K clients at once; stopped after."""
    env["LOCALSPEC_PROMPT_CACHE"] = tempfile.mkdtemp(prefix="prompts-", dir=env["XDG_RUNTIME_DIR"])
    server = start()
    try:
        if server is None:  # the command line: the service is started (and warmed) by a call
            ask: Callable[[str, float, int], Result] = lambda q, t, s: cli_ask(q, t, s, env)  # noqa: E731
        else:
            ask = server.ask
        ask("Say hello.", 0.0, 1)  # warm-up, not timed (loads, kernel checks, first prefill)
        result = run_round(ask, questions, temperature)
    finally:
        if server is not None:
            server.close()
        else:
            subprocess.run([sys.executable, "-m", "localspec", "stop", "--all"], env=env, capture_output=True)
    progress(f"{name}: {result.throughput:.1f} tok/s")
    return result


def measure(label: str, configs: dict[str, Callable[[], Http | None]], questions: Callable[[int], list[list[str]]],
            temperature: float, repeat: int, env: dict[str, str]) -> list[dict[str, float | str]]:
    """Each configuration's rounds, alternated (round r of every configuration, then round r + 1;
    every configuration asked the same new questions in a round); a row per configuration."""
    rounds: dict[str, list[Round]] = {name: [] for name in configs}
    for r in range(repeat):
        for name, start in configs.items():
            rounds[name].append(measure_round(f"{name} {label} round {r + 1}/{repeat}", start, questions(r),
                                              temperature, env))
    return [row(name, rs) for name, rs in rounds.items()]


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def row(name: str, rounds: list[Round]) -> dict[str, float | str]:
    results = [x for r in rounds for x in r.results]
    return {"config": name, "tps": statistics.median(r.throughput for r in rounds),
            "ttft50": pct([x.ttft for x in results], 0.5), "ttft95": pct([x.ttft for x in results], 0.95),
            "req50": pct([x.total for x in results], 0.5), "req95": pct([x.total for x in results], 0.95)}


def table(title: str, rows: list[dict]) -> list[str]:
    best = max((r["tps"] for r in rows if str(r["config"]).startswith("llama-server")), default=0.0)
    lines = [f"### {title}", "", "| configuration | aggregate tok/s | vs best llama-server | TTFT p50 / p95 s | "
             "request p50 / p95 s |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = f"{r['tps'] / best:.2f}×" if best and str(r["config"]).startswith("localspec") else ""
        lines.append(f"| {r['config']} | {r['tps']:.1f} | {ratio} | {r['ttft50']:.2f} / {r['ttft95']:.2f} | "
                     f"{r['req50']:.2f} / {r['req95']:.2f} |")
    return lines + [""]


def held_cells(held: Sequence[int] = (4000, 1000, 250, 0), rounds: int = 7) -> list[str]:
    """What cells another slot holds cost a call's attention (the unified cache attends over every
    used cell): a slot's step (one token at a ~100-token context) and its 100-token prefill, with
    another slot holding `held` cells (its saved state restored and trimmed each time), medians of
    `rounds` alternated rounds; in this process, the default target with localspec's defaults."""
    from localspec.api import load_model
    from localspec.llama.sequence import Part

    model = load_model(str(default_target()), ctx_size=max(held) + 512)
    context = model.tokenize("Write a Python function that reverses a string. " * 10)[:100]
    other, own = model.sequences[1], model.sequences[0]
    model.prefill(model.tokenize("def f(x):\n    return x * 2\n" * 600)[: max(held)], 0, seq_ids=(other.base,))
    state = model.seq_state(other.base)
    times: dict[int, list[tuple[float, float]]] = {n: [] for n in held}
    for _ in range(rounds):
        for n in held:
            model.clear_memory()
            if n:
                model.set_seq_state(state, other.base)
                model.seq_rm(other.base, n, -1)
            t0 = time.perf_counter()
            model.prefill(context, 0, seq_ids=(own.base,))
            t1 = time.perf_counter()
            for i in range(4):
                model.decode_parts([Part([context[i]], [len(context) + i], [(own.base,)], "all")])
            times[n].append((t1 - t0, (time.perf_counter() - t1) / 4))
    base_prefill = statistics.median(p for p, _ in times[0])
    base_step = statistics.median(s for _, s in times[0])
    lines = ["### What cells held by another slot cost a call", "",
             "| cells another slot holds | 100-token prefill | a step at a 100-token context |", "| ---: | ---: | ---: |"]
    for n in sorted(held):
        prefill, step = statistics.median(p for p, _ in times[n]), statistics.median(s for _, s in times[n])
        lines.append(f"| {n} | {prefill * 1e3:.0f} ms ({prefill / base_prefill:.2f}×) | "
                     f"{step * 1e3:.1f} ms ({step / base_step:.2f}×) |")
    model.close()
    return lines + [""]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,2,4,8", help="K values, comma-separated")
    p.add_argument("--temperatures", default="0,0.8")
    p.add_argument("--repeat", type=int, default=2, help="rounds per cell (medians)")
    p.add_argument("--no-llama", action="store_true", help="skip llama-server (no native build)")
    p.add_argument("--no-cli", action="store_true", help="skip the command line's rounds")
    p.add_argument("--no-grounded", action="store_true", help="skip the grounded set")
    p.add_argument("--held-cells", action="store_true", help="only what cells held by an idle slot cost the others")
    args = p.parse_args(argv)
    if args.held_cells:
        print("\n".join(host_header() + held_cells()))
        return
    ks = [int(k) for k in args.clients.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    bindir = None if args.no_llama else native_llama_tools()
    with tempfile.TemporaryDirectory(prefix="ls-conc-") as tmp:
        env = dict(os.environ, XDG_RUNTIME_DIR=tmp, LOCALSPEC_KEEP_ALIVE="10m")
        out = host_header()
        for temperature in temps:
            for k in ks:
                rows = measure(f"K={k} T={temperature:g}", configurations(k, bindir, not args.no_cli, env),
                               new_questions(k, temperature), temperature, args.repeat, env)
                out += table(f"K = {k} clients at once, T = {temperature:g}, new questions", rows)
                progress("\n".join(out[-len(rows) - 4:]))
            if not args.no_grounded:
                rows = measure(f"grounded T={temperature:g}", configurations(4, bindir, not args.no_cli, env),
                               lambda r: [[grounded_question(r, c)] for c in range(4)], temperature, args.repeat, env)
                out += table(f"Grounded: four clients editing four files, T = {temperature:g}", rows)
                progress("\n".join(out[-len(rows) - 4:]))
        print("\n".join(out))


if __name__ == "__main__":
    main()
