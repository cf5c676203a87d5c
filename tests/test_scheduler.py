"""Many calls at once on one loaded pair (localspec.decoding.scheduler): every call is a slot of the
target's step loop, and each round puts every slot's work into one decode per model.

What is guaranteed and tested here: each call gives what it gives alone (greedy: equal up to a
near-tie no wider than the batch-shape noise measured on this build; with a seed: the same draws,
so the same text where the build's logits do not depend on the batch), a cancelled call leaves
the others untouched, a long prompt is prefilled in bounded chunks between the others' steps, a new
call takes the slot that shares the longest prefix with its prompt, every slot's KV cache holds
exactly its committed tokens after every round, and a batched step is lossless for each slot.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from localspec.api import Generation, generate, stream_generate
from localspec.decoding import scheduler as sched
from localspec.decoding.scheduler import Scheduler
from localspec.llama.model import Model
from localspec.llama.sequence import KVSequence, Part
from localspec.settings.generation import GenerationConfig

from conftest import load
from greedy import assert_greedy_equal, batch_noise, near_tie

PROMPTS = ["def add(a, b): return a", "class Stack:\n    def push(self, x):", "import os\nprint(os.",
           "for i in range(10):\n    print(", "x = [1, 2, 3]\ny = x +"]


@pytest.fixture(scope="module")
def pair(tiny_paths: tuple[Path, Path]) -> Iterator[tuple[Model, Model]]:
    with load(tiny_paths[0], n_ctx=2048, batch_size=1024) as target, load(tiny_paths[1], n_ctx=2048, batch_size=1024) as draft:
        yield target, draft


@pytest.fixture(scope="module")
def tolerance(pair: tuple[Model, Model]) -> float:
    """The near-tie this build allows: measured (a context decoded alone and inside batches)."""
    target, _ = pair
    return near_tie(batch_noise(target, target.tokenize(PROMPTS[0] * 3)))


def alone(target: Model, draft: Model | None, prompt: str, **kw: Any) -> list[int]:
    return [r.token for r in stream_generate(target, draft, prompt, **kw) if r.token is not None]


def at_once(target: Model, draft: Model | None, prompts: list[str], **kw: Any) -> list[list[int]]:
    """Each prompt's tokens, all generated at once from threads of their own."""
    out: list[list[int]] = [[] for _ in prompts]
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        out[i] = alone(target, draft, prompts[i], **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_the_noise_measure_sees_a_batch_that_changes_logits() -> None:
    """batch_noise is the largest difference of a row decoded alone and inside a batch; a wrong row
    (negative control) is a difference of whole logits."""
    from greedy import row_difference

    row = np.linspace(-3, 3, 50, dtype=np.float32)
    assert row_difference(row, row.copy()) == 0.0
    assert row_difference(row, np.roll(row, 1)) > 0.1


@pytest.mark.parametrize("kw", [dict(num_draft_tokens=0), dict(drafter="ngram"), dict(drafter="model", plan="fixed"),
                                dict(drafter="model", tree=(2, 1), verifier="traversal", plan="fixed")],
                         ids=["target-alone", "ngram", "model-chain", "model-tree"])
def test_calls_at_once_each_give_what_they_give_alone(pair: tuple[Model, Model], tolerance: float, kw: dict) -> None:
    target, draft = pair
    prompts = PROMPTS[:4]
    want = [alone(target, draft, p, temperature=0, max_tokens=24, **kw) for p in prompts]
    got = at_once(target, draft, prompts, temperature=0, max_tokens=24, **kw)
    for p, g, w in zip(prompts, got, want):
        assert_greedy_equal(target, p, g, w, f"{kw}: a call beside others differs from alone", tol=tolerance)
    assert target.scheduler is not None and max(target.scheduler.decodes) >= 2  # decodes held several slots


def test_a_seeded_sampled_call_repeats_beside_others(pair: tuple[Model, Model], tolerance: float) -> None:
    """--seed with --plan fixed repeats whatever runs beside it: the same draws each step (each
    call its own random stream); the same tokens where the build's logits are batch-independent."""
    target, draft = pair
    kw = dict(temperature=0.8, seed=7, max_tokens=24, drafter="model", plan="fixed", num_draft_tokens=3)
    want = alone(target, draft, PROMPTS[0], **kw)
    got = at_once(target, draft, [PROMPTS[0]] * 3, **kw)
    if tolerance == 0.0:  # this build's logits do not depend on the batch: exact repeats
        assert got == [want] * 3
    else:  # draws are the same; a token may differ only where a near-tie of the sampled row flips
        assert all(g[:4] == want[:4] for g in got), (got, want)


def test_a_cancelled_call_leaves_the_others_untouched(pair: tuple[Model, Model], tolerance: float) -> None:
    target, draft = pair
    want = [alone(target, draft, p, temperature=0, max_tokens=40, drafter="model") for p in PROMPTS[:3]]
    stop = threading.Event()
    responses: list[list[Any]] = [[], [], []]

    def run(i: int) -> None:
        for r in stream_generate(target, draft, PROMPTS[i], temperature=0, max_tokens=40, drafter="model",
                                 cancel=stop if i == 1 else None):
            responses[i].append(r)
            if i == 1 and len(responses[i]) == 5:
                stop.set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    cancelled = responses[1]
    assert cancelled[-1].finish_reason == "cancelled" and 5 <= len(cancelled) < 40
    kept = [r.token for r in cancelled if r.token is not None]
    assert kept == want[1][: len(kept)] or near_tie_somewhere(target, PROMPTS[1], kept, want[1], tolerance)
    for i in (0, 2):
        assert_greedy_equal(target, PROMPTS[i], [r.token for r in responses[i] if r.token is not None], want[i],
                            "a call beside a cancelled one differs", tol=tolerance)


def near_tie_somewhere(target: Model, prompt: str, got: list[int], want: list[int], tol: float) -> bool:
    try:
        assert_greedy_equal(target, prompt, got, want[: len(got)], tol=tol)
    except AssertionError:
        return False
    return True


class DecodeLog:
    """The target's decodes, each as (tokens of steps, tokens of prompt fills)."""

    def __init__(self, target: Model, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decodes: list[tuple[int, int]] = []
        real = Model.decode_parts

        def decode_parts(model: Model, parts: list[Part]) -> int:
            if model is target:
                fills = sum(len(p.tokens) for p in parts if p.outputs == "last" and len(p.tokens) > 1)
                self.decodes.append((sum(len(p.tokens) for p in parts) - fills, fills))
            return real(model, parts)

        monkeypatch.setattr(Model, "decode_parts", decode_parts)

    def shared(self) -> list[tuple[int, int]]:
        """The decodes that held another call's step and a prompt's chunk."""
        return [(s, f) for s, f in self.decodes if s and f]


def long_prefill_beside_a_call(target: Model, monkeypatch: pytest.MonkeyPatch) -> tuple[DecodeLog, int]:
    """A call generating; another call's 1,500-token prompt arrives. The log of the target's
    decodes and how many tokens the first call got while the second's prompt was prefilled (the
    first call runs until the second's first token: the two overlap whatever the machine's speed)."""
    target.clear()  # no slot holds the prompt from an earlier test
    log = DecodeLog(target, monkeypatch)
    long_prompt = " ".join(f"w{i % 97}" for i in range(700))
    assert len(target.tokenize(long_prompt)) > 1200
    started, during, first_token = threading.Event(), threading.Event(), threading.Event()
    counted = [0]

    def short() -> None:
        for _ in stream_generate(target, None, PROMPTS[0], temperature=0, max_tokens=1500, num_draft_tokens=0,
                                 cancel=first_token):
            started.set()
            if during.is_set() and not first_token.is_set():
                counted[0] += 1

    t = threading.Thread(target=short)
    t.start()
    assert started.wait(60)
    during.set()
    for _ in stream_generate(target, None, long_prompt, temperature=0, max_tokens=2, num_draft_tokens=0):
        first_token.set()
    t.join(120)
    return log, counted[0]


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_steps(pair: tuple[Model, Model],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    target, _ = pair
    log, interleaved = long_prefill_beside_a_call(target, monkeypatch)
    shared = log.shared()
    assert shared, log.decodes  # the prompt went in beside the other call's steps
    assert max(f for _, f in shared) <= sched.PREFILL_CHUNK
    assert interleaved >= 3  # the first call went on generating while the prompt was prefilled


def test_negative_control_one_big_prefill_stalls_the_other(pair: tuple[Model, Model],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    target, _ = pair
    monkeypatch.setattr(sched, "PREFILL_CHUNK", 100_000)
    log, _ = long_prefill_beside_a_call(target, monkeypatch)
    assert max((f for _, f in log.shared()), default=0) > 256, log.decodes  # the check above would fail


def test_a_new_call_takes_the_slot_that_shares_the_longest_prefix(pair: tuple[Model, Model]) -> None:
    target, _ = pair
    config = GenerationConfig.from_options(temperature=0, max_tokens=4, num_draft_tokens=0)
    doc = "def helper(x):\n    return x * 2\n" * 8
    first = Generation(target, None, doc + "# one", config, prompt_cache=False)
    list(first)
    other = Generation(target, None, "print('unrelated')", config, prompt_cache=False)
    list(other)
    assert other.slot != first.slot  # nothing shared: the slot used least recently
    follow = Generation(target, None, doc + "# two", config, prompt_cache=False)
    list(follow)
    assert follow.slot == first.slot
    assert follow.engine.stats().cached_tokens >= len(target.tokenize(doc)) - 2


def test_a_prompt_mostly_held_by_a_slot_takes_it_and_the_rest_is_parked(pair: tuple[Model, Model]) -> None:
    """llama-server's slot similarity: a slot holding more than half of a new prompt is taken even
    when that is a small part of its own context (a chat template's opening, shared by every new
    question); the context it loses is parked first and comes back for a call that continues it."""
    target, _ = pair
    config = GenerationConfig.from_options(temperature=0, max_tokens=4, num_draft_tokens=0)
    opening = "# a shared opening line\n" * 6
    long_tail = "def helper(x):\n    return x * 2\n" * 12
    first = Generation(target, None, opening + long_tail + "# one", config, prompt_cache=False)
    list(first)
    question = Generation(target, None, opening + "# a new question", config, prompt_cache=False)
    list(question)
    assert question.slot == first.slot
    assert question.engine.stats().cached_tokens >= len(target.tokenize(opening)) - 2
    again = Generation(target, None, opening + long_tail + "# two", config, prompt_cache=False)
    list(again)
    assert again.engine.stats().cached_tokens >= len(target.tokenize(opening + long_tail)) - 2


def test_negative_control_a_slot_holding_less_than_half_of_a_prompt_is_not_taken(pair: tuple[Model, Model]) -> None:
    target, _ = pair
    config = GenerationConfig.from_options(temperature=0, max_tokens=4, num_draft_tokens=0)
    opening = "# a shared opening line\n" * 2
    first = Generation(target, None, opening + "def helper(x):\n    return x * 2\n" * 12, config, prompt_cache=False)
    list(first)
    question = Generation(target, None, opening + "print('a question much longer than the opening') " * 4, config,
                          prompt_cache=False)
    list(question)
    assert question.slot != first.slot


def kv_holds_its_tokens(target: Model) -> list[str]:
    """Every slot's cache holds exactly its committed tokens as its first sequence id and nothing
    in its others (the KV invariant); what does not."""
    wrong = []
    for seq in target.sequences:
        top = target.seq_pos_max(seq.base)
        if top + 1 != seq.n_cached:
            wrong.append(f"slot {seq.slot}: the cache holds positions up to {top}, the sequence says {seq.n_cached}")
        for s in range(1, seq.span):
            if target.seq_pos_max(seq.base + s) != -1:
                wrong.append(f"slot {seq.slot}: sequence {seq.base + s} was left with cells")
    return wrong


def test_every_slots_cache_holds_its_tokens_after_every_round(pair: tuple[Model, Model],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = pair
    problems: list[str] = []
    real = Scheduler._round

    def checked(self: Scheduler) -> None:
        real(self)
        if self.target is target and all(not isinstance(s.pending, (sched.Fill, sched.passes.Step))
                                         for s in self.slots):
            problems.extend(kv_holds_its_tokens(target))

    monkeypatch.setattr(Scheduler, "_round", checked)
    at_once(target, draft, PROMPTS[:4], temperature=0.7, seed=3, max_tokens=30, drafter="model", tree=(2, 2),
            verifier="traversal", plan="fixed")
    assert not problems, problems[:5]
    held = max(target.sequences, key=lambda seq: seq.n_cached)  # the last call's slot (the others parked)
    assert held.n_cached > 0
    target.seq_cp(held.base, held.base + 1)  # negative control: a branch left behind
    assert kv_holds_its_tokens(target)
    target.seq_rm(held.base + 1)


def test_more_calls_than_slots_wait_their_turn(pair: tuple[Model, Model], tolerance: float) -> None:
    target, _ = pair
    prompts = (PROMPTS * 2)[: target.n_slots + 2]
    got = at_once(target, None, prompts, temperature=0, max_tokens=10, num_draft_tokens=0)
    for p, g in zip(prompts, got):
        assert_greedy_equal(target, p, g, alone(target, None, p, temperature=0, max_tokens=10, num_draft_tokens=0),
                            tol=tolerance)


def test_a_cancel_during_a_long_prefill_stops_it_at_once(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's prefill stops within a graph node once its cancel is set (llama.cpp's abort
    callback), and the slot is usable right after; stopping only between decodes (negative
    control) waits for the whole chunk."""
    import tiny_models as tiny

    path = tiny.write_tiny_model(tiny_dir / "wide.gguf", seed=5, n_embd=512, n_layer=4, n_head=8, n_ff=1536)
    with load(path, n_ctx=2048, batch_size=2048, threads=2) as model:
        prompt = [3 + (i * 7) % 300 for i in range(1900)]
        took_alone = _timed_prefill(model, prompt, monkeypatch, cancel=False)
        assert took_alone > 0.5, "the prefill is too fast to tell"
        stopped_after = _timed_prefill(model, prompt, monkeypatch, cancel=True)
        assert stopped_after < 0.5, (stopped_after, took_alone)
        assert generate(model, None, prompt[:50], max_tokens=3, temperature=0)  # the slot is usable again
        monkeypatch.setattr(model, "stop_decoding", lambda: None)
        late = _timed_prefill(model, prompt, monkeypatch, cancel=True)
        assert late > 0.5 or late > 0.5 * took_alone, (late, took_alone)


def _timed_prefill(model: Model, prompt: list[int], monkeypatch: pytest.MonkeyPatch, cancel: bool) -> float:
    """Seconds from the start of the prompt's long decode, plus 0.1 s, to the generation's end when
    its cancel is set then (`cancel`), else the whole generation's seconds."""
    stop, long_decode = threading.Event(), threading.Event()
    real = Model.decode_parts

    def decode_parts(m: Model, parts: list[Part]) -> int:
        if m is model and sum(len(p.tokens) for p in parts) > 1000:
            long_decode.set()
        return real(m, parts)

    monkeypatch.setattr(Model, "decode_parts", decode_parts)
    model.clear()
    cancelled_at: list[float] = []

    def cancel_soon() -> None:
        long_decode.wait(60)
        time.sleep(0.1)
        cancelled_at.append(time.perf_counter())
        stop.set()

    if cancel:
        threading.Thread(target=cancel_soon, daemon=True).start()
    t0 = time.perf_counter()
    last = list(stream_generate(model, None, prompt, max_tokens=1, temperature=0, cancel=stop, prompt_cache=False,
                                plan="fixed"))
    ended = time.perf_counter()
    monkeypatch.setattr(Model, "decode_parts", real)
    if not cancel:
        return ended - t0
    assert last[-1].finish_reason == "cancelled"
    return ended - cancelled_at[0]
