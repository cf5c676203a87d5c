"""The async API (localspec.api.astream_generate, agenerate): the same responses as the sync API,
several tasks on one pair at once, cancelling the task cancels the generation, and the event
loop is never blocked by decoding (the steps run on the pair's scheduler thread)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from localspec.api import agenerate, astream_generate, generate, stream_generate
from localspec.llama.model import Model

from conftest import load
from greedy import assert_greedy_equal

PROMPTS = ["def add(a, b): return a", "class Stack:\n    def push(self, x):", "import os\nprint(os."]


@pytest.fixture(scope="module")
def target(tiny_paths: tuple[Path, Path]) -> Iterator[Model]:
    with load(tiny_paths[0], n_ctx=4096) as model:
        yield model


def test_agenerate_is_generate(target: Model) -> None:
    want = generate(target, None, PROMPTS[0], max_tokens=16, temperature=0)
    assert asyncio.run(agenerate(target, None, PROMPTS[0], max_tokens=16, temperature=0)) == want


def test_tasks_at_once_each_give_what_they_give_alone(target: Model) -> None:
    want = [[r.token for r in stream_generate(target, None, p, max_tokens=20, temperature=0) if r.token is not None]
            for p in PROMPTS]

    async def tokens(prompt: str) -> list[int]:
        return [r.token async for r in astream_generate(target, None, prompt, max_tokens=20, temperature=0)
                if r.token is not None]

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(tokens(p) for p in PROMPTS)))

    got = asyncio.run(main())
    for p, g, w in zip(PROMPTS, got, want, strict=True):
        assert_greedy_equal(target, p, g, w)


def test_cancelling_the_task_stops_the_generation(target: Model) -> None:
    """The task that iterates is cancelled mid-generation: the generation stops within a step and
    its slot is free again. Negative control: an uncancelled one runs to its max_tokens."""
    seen: list[Any] = []

    async def consume(limit: int) -> None:
        async for r in astream_generate(target, None, "ab", max_tokens=3000, temperature=1.0, seed=1,
                                        num_draft_tokens=0, regex="[a-z ]{3000,}"):  # no end before 3000
            seen.append(r)
            if len(seen) == limit:
                await asyncio.sleep(10)  # where it is cancelled

    async def main() -> None:
        task = asyncio.create_task(consume(20))
        while len(seen) < 20 and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while target.scheduler.in_use()[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert target.scheduler.in_use() == (0, 0)
    done = asyncio.run(agenerate(target, None, "ab", max_tokens=40, temperature=1.0, seed=1, num_draft_tokens=0,
                                 regex="[a-z ]{3000,}"))
    assert len(done) >= 30  # negative control: uncancelled, it ran on


def loop_stall(work: Any) -> float:
    """The longest time the loop went without running a 10 ms ticker while `work` (a coroutine
    function) ran."""
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.01)

    async def main() -> None:
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)  # ticking
        await work()
        ticks.append(time.perf_counter())
        tick.cancel()

    asyncio.run(main())
    return max(b - a for a, b in zip(ticks, ticks[1:]))


def test_the_event_loop_is_never_blocked_by_decoding(target: Model) -> None:
    """While three generations run, the loop's ticker keeps ticking. Negative control: the same
    generations decoded on the loop's own thread stall it for whole generations."""
    async def streams() -> None:
        await asyncio.gather(*(agenerate(target, None, p, max_tokens=400, temperature=0) for p in PROMPTS))

    async def on_the_loop() -> None:
        for p in PROMPTS:
            generate(target, None, p, max_tokens=400, temperature=0)

    blocked = loop_stall(on_the_loop)
    free = loop_stall(streams)
    assert free < blocked / 3, (free, blocked)


def test_a_thread_cancel_event_stops_a_stream(target: Model) -> None:
    stop = threading.Event()

    async def main() -> list[Any]:
        out = []
        async for r in astream_generate(target, None, "ab", max_tokens=3000, temperature=1.0, seed=2, cancel=stop,
                                        num_draft_tokens=0, regex="[a-z ]{3000,}"):
            out.append(r)
            if len(out) == 10:
                threading.Timer(0.0, stop.set).start()
        return out

    out = asyncio.run(main())
    assert out[-1].finish_reason == "cancelled" and 10 <= len(out) < 3000
