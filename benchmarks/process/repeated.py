"""Repeated work, where earlier calls can help: one schema over eight documents, one file edited
four times, a five-turn chat. Each set is a script's sequence of calls: for localspec, fresh
client processes served by the resident service (its drafts from earlier calls, its held
contexts and prompt cache at work; a chat is one ``localspec chat`` process, its replies calls);
for ``llama-server`` (the target alone, and each draft-free n-gram mode, which keeps what it saw
across requests) a fresh ``curl`` per request on the same rendered prompts, the server started
for the set and kept running through it, restarted each round. Every set's prompts are the same
on every side (the chat's conversation is each side's own, from the same turns).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.common.llama_tools import Server
from benchmarks.common.runs import Run
from benchmarks.common.schemas import TASKS, gbnf

INVOICE = TASKS["invoice"]
CUSTOMERS = (("Northwind Traders Ltd.", "42 Harbour Street, Portsmouth PO1 3AX, United Kingdom", "GBP"),
             ("Contoso GmbH", "Hauptstrasse 12, 10115 Berlin, Germany", "EUR"),
             ("Fabrikam Inc.", "500 Market Street, San Francisco CA 94105, USA", "USD"),
             ("Tailspin Toys SARL", "8 rue de la Paix, 75002 Paris, France", "EUR"),
             ("Wide World Importers", "77 King Street, Manchester M2 4LQ, United Kingdom", "GBP"),
             ("Adventure Works LLC", "1200 Pine Avenue, Seattle WA 98101, USA", "USD"),
             ("Litware SpA", "Via Roma 5, 00184 Roma, Italy", "EUR"),
             ("Proseware Pty", "3 George Street, Sydney NSW 2000, Australia", "USD"))
ITEMS = ("Ergonomic office chair (model EC-400)", "Standing desk frame (SD-2)", "27-inch monitor (M27Q)",
         "Wireless keyboard (K380)", "Laptop stand (LS-10)", "Noise-cancelling headset (H700)",
         "Desk lamp (DL-3)", "Docking station (DS-90)")


def invoices() -> list[str]:
    """Eight invoices, each asked for as the same schema's JSON."""
    out = []
    for i, ((name, address, currency), item) in enumerate(zip(CUSTOMERS, ITEMS, strict=True)):
        quantity, price = 3 + i * 2, 40 + 17 * i
        out.append(f"Extract the invoice's fields as JSON.\n\nINVOICE INV-2024-{871 + i:04d}\nDate: 2024-05-{10 + i}\n"
                   f"Bill to: {name}, {address}\nItems: {quantity} x {item} @ {price:.2f} {currency}\n"
                   f"Total due: {quantity * price:.2f} {currency}\nPayment terms: Net 30\n"
                   f"Questions: accounts@{name.split()[0].lower()}.example\n")
    return out


FILE = ('import statistics\n\n\ndef summarize(values):\n    """Mean, median and spread of a list of numbers."""\n'
        '    if not values:\n        raise ValueError("no values")\n    mean = statistics.mean(values)\n'
        '    median = statistics.median(values)\n    spread = max(values) - min(values)\n'
        '    return {"mean": mean, "median": median, "spread": spread}\n\n\n'
        'def load(path):\n    with open(path) as handle:\n        return [float(line) for line in handle if line.strip()]\n\n\n'
        'def report(path):\n    values = load(path)\n    stats = summarize(values)\n'
        '    for key, value in stats.items():\n        print(f"{key}: {value:.2f}")\n')
EDITS = (("Rename the function `summarize` to `describe` and show the whole file.", "summarize", "describe"),
         ("Rename the variable `spread` to `value_range` and show the whole file.", "spread", "value_range"),
         ("Rename the parameter `path` to `filename` and show the whole file.", "path", "filename"),
         ("Rename the variable `stats` to `summary` and show the whole file.", "stats =", "summary ="))


def edits() -> list[str]:
    """One file edited four times: each request shows the file as the earlier edits left it."""
    out, text = [], FILE
    for request, old, new in EDITS:
        out.append(f"{request}\n\n```python\n{text}```")
        text = text.replace(old, new)
        if old == "stats =":
            text = text.replace("stats.items()", "summary.items()")
    return out


CHAT = ("Write a Python function that checks whether a string is a palindrome.",
        "Make it ignore case and spaces, and show the whole function.",
        "Add type hints and a docstring, and show the whole function.",
        "Write three pytest tests for it.",
        "Rename the function to `is_mirror` everywhere and show the function and the tests.")

SETS = ("schema", "edit", "chat")


@dataclass
class SetRun:
    """A set's wall time (every call, spawn to exit) and what it generated."""

    wall: float
    tokens: int
    texts: list[str]


def localspec_set(name: str, call: Callable[..., Run], chat: Callable[[Sequence[str]], Run], tag: str) -> SetRun:
    """The set as localspec runs it: `call(text, schema=...)` one later call, `chat(turns)` a chat."""
    if name == "chat":
        run = chat([f"{CHAT[0]} ({tag})", *CHAT[1:]])
        return SetRun(run.wall, 0, [run.stdout])
    runs = [call(text, schema=INVOICE.schema) for text in invoices_tagged(tag)] if name == "schema" else \
        [call(text) for text in edits_tagged(tag)]
    return SetRun(sum(r.wall for r in runs), sum(r.tokens for r in runs), [r.data.get("text", "") for r in runs])


def server_set(name: str, server: Server, render: Callable[[list[dict]], str], tokens: int, tag: str) -> SetRun:
    """The set as a script asks llama-server: a fresh curl per request, on the same rendered prompts."""
    grammar = gbnf(INVOICE.schema) if name == "schema" else None
    if name == "chat":
        messages: list[dict] = []
        runs = []
        for turn in [f"{CHAT[0]} ({tag})", *CHAT[1:]]:
            messages.append({"role": "user", "content": turn})
            run = server.request(render(messages), tokens)
            runs.append(run)
            messages.append({"role": "assistant", "content": run.data.get("content", "")})
        return SetRun(sum(r.wall for r in runs), sum(r.tokens for r in runs), [r.data.get("content", "") for r in runs])
    texts = invoices_tagged(tag) if name == "schema" else edits_tagged(tag)
    runs = [server.request(render([{"role": "user", "content": t}]), tokens, grammar) for t in texts]
    return SetRun(sum(r.wall for r in runs), sum(r.tokens for r in runs), [r.data.get("content", "") for r in runs])


def invoices_tagged(tag: str) -> list[str]:
    """The invoices of a round (its tag: no round's prompts are an earlier round's)."""
    return [text.replace("Extract the invoice's fields", f"({tag}) Extract the invoice's fields") for text in invoices()]


def edits_tagged(tag: str) -> list[str]:
    return [f"({tag}) {text}" for text in edits()]


def table(results: dict[str, dict[str, list[SetRun]]]) -> list[str]:
    """A row per set: each side's median wall time and localspec's ratios (higher: localspec faster;
    "-" where llama.cpp's side was not run)."""
    lines = ["| set | calls | localspec s | llama-server alone s | best n-gram mode s (mode) | vs llama-server alone | "
             "vs its best n-gram mode |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, got in results.items():
        walls = {side: statistics.median(r.wall for r in runs) for side, runs in got.items()}
        ours, alone = walls["localspec"], walls.get("server alone")
        modes = {k: v for k, v in walls.items() if k.startswith("server ngram")}
        best = min(modes, key=modes.__getitem__) if modes else None
        calls = {"schema": 8, "edit": 4, "chat": 5}[name]
        row = f"| {name} | {calls} | {ours:.2f} | " + (f"{alone:.2f}" if alone else "-")
        row += f" | {modes[best]:.2f} ({best.removeprefix('server ')})" if best else " | -"
        row += f" | **{alone / ours:.2f}×**" if alone else " | -"
        row += f" | **{modes[best] / ours:.2f}×** |" if best else " | - |"
        lines.append(row)
    return lines


def dump(results: dict[str, dict[str, list[SetRun]]]) -> str:
    return json.dumps({k: {s: [r.wall for r in v] for s, v in got.items()} for k, got in results.items()})
