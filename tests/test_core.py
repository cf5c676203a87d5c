"""The residency core in one process, on the tiny models: pairs loaded once whoever asks, a queue
per pair, the least recently used idle pair unloaded for room, cancellation while waiting and
between steps, the one status type, and the typed request a service reads (pydantic)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from localspec.settings.generation import GenerationConfig
from localspec.settings.models import PairOptions
from localspec.core.calls import Done, Failed, Note, Prompt, Request, Text, event_json, event_of
from localspec.core.pairs import ModelFile, PairSpec
from localspec.core.cancel import Cancel, Cancelled
from localspec.core.residency import Residency
from localspec.core.run import LocalCall, run
from localspec.core.status import CoreStatus
from localspec.core.wire import Malformed, parse_request, parse_status
from localspec.errors import RequestError


def request_for(args: list[str], text: str, kind: str = "generate", **settings: Any) -> Request:
    """The Request of a call with these -m/-d and load flags (the tests' command lines)."""
    flags = dict(zip(args[::2], args[1::2]))
    options = PairOptions.from_flags({"ctx_size": int(flags.get("--ctx-size", 1024)),
                                      "threads": int(flags.get("--threads", 1)),
                                      "cache_type": flags.get("--cache-type", "f32")})
    draft = flags.get("-d")
    spec = PairSpec(ModelFile.at(flags["-m"]), ModelFile.at(draft) if draft and draft != "none" else None,
                    flags["-m"], False, options)
    config = GenerationConfig.from_options(**{"temperature": 0, **settings})
    return Request(kind, spec, config.options(), Prompt(text=text, chat=False), None, 0, "/tmp/unused-profiles",
                   60.0, 3)


def spec_of(path: Path, ctx: int = 512, parallel: int | None = None) -> PairSpec:
    return PairSpec(ModelFile.at(path), None, str(path), False,
                    PairOptions.from_flags({"ctx_size": ctx, "threads": 1, "cache_type": "f32", "parallel": parallel}))


def hold(residency: Residency, spec: PairSpec, **kw: Any) -> tuple[threading.Event, threading.Thread, list]:
    """A call that leases `spec` in a thread and keeps it until the event is set."""
    release, got = threading.Event(), []

    def body() -> None:
        with residency.lease(spec, Cancel(), **kw) as loaded:
            got.append(loaded)
            release.wait(30)

    thread = threading.Thread(target=body)
    thread.start()
    deadline = time.monotonic() + 30
    while not got:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    return release, thread, got


def test_concurrent_calls_load_a_pair_once(tiny_paths: tuple[Path, Path]) -> None:
    """Eight calls for one pair at once: one loads it, the others wait in its queue and find it
    loaded. Negative control: the load times say who loaded it (a second load would show)."""
    residency = Residency()
    spec = spec_of(tiny_paths[0])
    loads: list[float] = []

    def call() -> None:
        with residency.lease(spec, Cancel()) as loaded:
            loads.append(loaded.load_seconds[0])

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(loads) == 8 and sum(1 for s in loads if s > 0) == 1, loads
    (pair,) = residency.status().pairs
    assert pair.calls == 8 and pair.state == "idle"
    assert residency.close()


def test_the_least_recently_used_idle_pair_makes_room(tiny_paths: tuple[Path, Path]) -> None:
    """max_loaded 3, a fourth pair: the idle one used least recently goes (told), not another;
    negative control: with room for three, nothing is unloaded."""
    residency = Residency()
    a, b, c, d = (spec_of(tiny_paths[0], ctx) for ctx in (256, 512, 1024, 2048))
    notes: list[str] = []
    memory = {}  # the KV cache differs by context size: the pairs' memory tells them apart
    for spec in (a, b, a, c):  # a used again after b: b is the least recently used
        with residency.lease(spec, Cancel(), keep_alive=60, max_loaded=3, notify=notes.append):
            pass
        memory.setdefault(spec.options.target.ctx_size, residency.status().pairs[-1].memory_bytes)
    assert len(residency.status().pairs) == 3 and not notes  # the control
    with residency.lease(d, Cancel(), keep_alive=60, max_loaded=3, notify=notes.append):
        pass
    memory[2048] = residency.status().pairs[-1].memory_bytes
    assert len(notes) == 1 and "unloaded" in notes[0]
    assert sorted(p.memory_bytes for p in residency.status().pairs) == sorted(memory[n] for n in (256, 1024, 2048))
    assert residency.close()


def test_memory_makes_room_too(tiny_paths: tuple[Path, Path]) -> None:
    """When a pair would not fit the memory available, idle ones are unloaded first; where
    nothing else is loaded it loads anyway (the load itself says when it cannot)."""
    room = {"bytes": 10 << 30}
    residency = Residency(memory=lambda: room["bytes"])
    a, b = spec_of(tiny_paths[0], 256), spec_of(tiny_paths[0], 512)
    with residency.lease(a, Cancel(), keep_alive=60):
        pass
    with residency.lease(b, Cancel(), keep_alive=60):
        pass
    assert len(residency.status().pairs) == 2  # the control: memory enough
    room["bytes"] = 1
    notes: list[str] = []
    with residency.lease(spec_of(tiny_paths[0], 1024), Cancel(), keep_alive=60, notify=notes.append):
        pass
    assert len(residency.status().pairs) == 1 and len(notes) == 2
    assert residency.close()


def test_a_busy_pair_in_the_way_is_waited_for(tiny_paths: tuple[Path, Path]) -> None:
    """max_loaded 1 and the loaded pair busy: a call on another pair waits, told why, and loads
    when the busy one is done (which is then unloaded); it can be cancelled while it waits."""
    residency = Residency()
    a, b = spec_of(tiny_paths[0], 256), spec_of(tiny_paths[0], 512)
    release, thread, _ = hold(residency, a, keep_alive=60)
    notes: list[str] = []
    cancel = Cancel()
    waiting = threading.Thread(target=lambda: pytest.raises(Cancelled, _lease, residency, b, cancel, notes))
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive() and any("waiting for" in n and "LOCALSPEC_MAX_LOADED=1" in n for n in notes), notes
    cancel.set("interrupted")
    waiting.join(5)
    assert not waiting.is_alive()
    got: list[Any] = []
    later = threading.Thread(target=lambda: got.append(_lease(residency, b, Cancel(), [])))
    later.start()
    time.sleep(0.3)
    assert not got  # the control: it waits while a is busy
    release.set()
    thread.join(10)
    later.join(30)
    assert got and [p.target for p in residency.status().pairs] == [str(tiny_paths[0])]
    assert residency.status().pairs[0].calls == 1  # b's, a fresh pair
    assert residency.close()


def _lease(residency: Residency, spec: PairSpec, cancel: Cancel, notes: list[str]) -> bool:
    with residency.lease(spec, cancel, keep_alive=60, max_loaded=1, notify=notes.append):
        return True


def test_a_queued_call_is_cancelled_at_once(tiny_paths: tuple[Path, Path]) -> None:
    """A call waiting for a pair whose one slot is taken ends at once when cancelled."""
    residency = Residency()
    spec = spec_of(tiny_paths[0], parallel=1)
    release, thread, _ = hold(residency, spec)
    cancel = Cancel()
    outcome: list[Any] = []

    def queued() -> None:
        try:
            with residency.lease(spec, cancel, notify=lambda text: outcome.append(text)):
                outcome.append("had it")
        except Cancelled as exc:
            outcome.append(("cancelled", str(exc)))

    waiting = threading.Thread(target=queued)
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive() and "waiting for 1 earlier call" in outcome[0]  # the control: it waits
    t0 = time.monotonic()
    cancel.set("interrupted")
    waiting.join(5)
    assert outcome[-1] == ("cancelled", "interrupted") and time.monotonic() - t0 < 1
    release.set()
    thread.join(10)
    assert residency.status().pairs[0].queued == 0
    assert residency.close()


def test_a_generation_stops_between_steps(tiny_paths: tuple[Path, Path]) -> None:
    """The call's cancel, set mid-generation, ends it after the current step with what it has
    (Done says why). Negative control: uncancelled, it runs to max_tokens."""
    args = ["-m", str(tiny_paths[0]), "-d", "none"]
    residency = Residency()
    for stop in (False, True):
        cancel, events = Cancel(), []

        def emit(event: Any) -> None:
            events.append(event)
            if stop and isinstance(event, Text) and len(events) >= 3:
                cancel.set("interrupted")

        run(residency, request_for(args, "the quick brown fox", max_tokens=200, num_draft_tokens=0), cancel, emit)
        done = events[-1]
        assert isinstance(done, Done)
        if stop:
            assert done.stopped == "interrupted" and done.stats.generated_tokens < 200
        else:
            assert done.stopped is None and done.stats.generated_tokens == 200
    assert residency.close()


def test_a_seeded_fixed_plan_call_repeats_whatever_the_pair_served(tiny_paths: tuple[Path, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """--seed with --plan fixed: the same sampled text however many times the pair served the
    same call before (the earlier calls' drafts are the planner's only). Negative control: drafts
    from the earlier calls under the fixed plan change the draws, and the text."""
    from localspec.core import run as run_module

    def texts(residency: Residency) -> list[str]:
        out = []
        for _ in range(3):
            events: list[Any] = []
            run(residency, request_for(["-m", str(tiny_paths[0]), "-d", str(tiny_paths[1])], "the quick brown fox",
                                       max_tokens=40, temperature=0.8, seed=11, plan="fixed", num_draft_tokens=4),
                Cancel(), events.append)
            out.append("".join(e.text for e in events if isinstance(e, Text)))
        residency.close()
        return out

    first, *again = texts(Residency())
    assert again == [first, first]
    monkeypatch.setattr(run_module, "shared_history", lambda residency, spec, config: residency.history(spec))
    control = texts(Residency())
    assert control[1:] != [control[0], control[0]]


def test_unload_stops_the_call_using_the_pair(tiny_paths: tuple[Path, Path]) -> None:
    args = ["-m", str(tiny_paths[0]), "-d", "none"]
    residency = Residency()
    call = LocalCall(request_for(args, "the quick brown fox", max_tokens=3000, num_draft_tokens=0), residency)
    events = call.events()
    first = next(e for e in events if isinstance(e, Text))
    assert first.text
    stopped = residency.unload(lambda s: True, "a test")
    done = [e for e in events if isinstance(e, Done)][0]
    assert done.stopped == "interrupted" and done.stats.generated_tokens < 3000
    assert len(stopped) == 1 and not residency.status().pairs
    assert residency.close()


def test_events_round_trip_and_malformed_ones_are_refused(tiny_paths: tuple[Path, Path]) -> None:
    residency = Residency()
    events: list[Any] = []
    run(residency, request_for(["-m", str(tiny_paths[0]), "-d", "none"], "hi", max_tokens=4), Cancel(), events.append)
    assert residency.close()
    for event in events:
        assert event_of(json.loads(json.dumps(event_json(event)))) == event
    for bad in ({"event": "text", "txt": "a"}, {"event": "done", "stats": {"x": 1}}, {"event": "nope"},
                {"event": "done", "error": "exploded"}, {"event": "note"}, [], None):
        with pytest.raises(ValueError):
            event_of(bad)


def test_a_request_is_read_by_its_types(tiny_paths: tuple[Path, Path]) -> None:
    good = request_for(["-m", str(tiny_paths[0]), "-d", "none"], "hi")
    payload = json.dumps(good.to_json()).encode()
    assert parse_request(payload) == good  # the control
    data = good.to_json()
    for bad, what in ((b"{", "not JSON"), (json.dumps({**data, "version": 2}).encode(), "version 2"),
                      (json.dumps({**data, "keep_alive": None}).encode(), "keep_alive"),
                      (json.dumps({**data, "keep_alive": float("nan")}).encode(), "keep_alive: Input should be a finite"),
                      (json.dumps({**data, "max_loaded": True}).encode(), "max_loaded"),
                      (json.dumps({**data, "profiles": 3}).encode(), "profiles"),
                      (json.dumps({**data, "extra": 1}).encode(), "extra"),
                      (json.dumps({**data, "kind": "rm"}).encode(), "kind"),
                      (json.dumps({**data, "pair": {**data["pair"], "options": {"target": {"ctx_size": -1}}}}).encode(),
                       "pair")):
        with pytest.raises(RequestError, match=what):
            parse_request(bad)


def test_status_refuses_what_is_not_one() -> None:
    from localspec.core.status import PairStatus

    pair = PairStatus("a", "/m/a.gguf", None, False, "idle", 0, 1, 10, 1.0, 2.0, 300.0, 0.5)
    status = CoreStatus(1, 2.0, 3, 4, (pair,))
    assert parse_status(json.dumps(status.to_json()).encode()) == status  # the control
    data = status.to_json()
    for bad in ({**data, "pid": None}, {**data, "started": None}, {**data, "pairs": [{**data["pairs"][0], "calls": True}]},
                {**data, "pairs": [5]}, {**data, "pairs": [{**data["pairs"][0], "state": "on fire"}]},
                {**data, "pairs": [{**data["pairs"][0], "idle_seconds": float("inf")}]}, {**data, "x": 1}, [], "x"):
        with pytest.raises(Malformed):
            parse_status(json.dumps(bad).encode())


def test_a_failed_load_reports_and_forgets(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf" * 10)
    residency = Residency()
    events: list[Any] = []
    run(residency, request_for(["-m", str(junk), "-d", "none"], "hi"), Cancel(), events.append)
    assert isinstance(events[-1], Failed) and "junk.gguf" in events[-1].message
    assert not residency.status().pairs and not any(isinstance(e, Note) for e in events)
    assert residency.close()


def spec_threads(path: Path, ctx: int, threads: int) -> PairSpec:
    return PairSpec(ModelFile.at(path), None, str(path), False,
                    PairOptions.from_flags({"ctx_size": ctx, "threads": threads, "cache_type": "f32"}))


@pytest.mark.parametrize("threads, waits", [(2, True), (1, False)])
def test_generations_share_the_cores(tiny_paths: tuple[Path, Path], threads: int, waits: bool) -> None:
    """On two cores, a generation of two threads waits (told why) while another pair's generation
    uses them, since threads that outnumber the cores spin against each other; with one thread
    each (the control) both run at once."""
    residency = Residency()
    residency.cores = 2
    a, b = spec_threads(tiny_paths[0], 256, threads), spec_threads(tiny_paths[0], 512, threads)
    release, thread, _ = hold(residency, a)
    notes: list[str] = []
    got: list[bool] = []
    other = threading.Thread(target=lambda: got.append(_lease_b(residency, b, notes)))
    other.start()
    other.join(2)
    assert (not got) == waits and any("waiting for the CPU" in n for n in notes) == waits, notes
    release.set()
    thread.join(10)
    other.join(10)
    assert got == [True]
    assert residency.close()


def _lease_b(residency: Residency, spec: PairSpec, notes: list[str]) -> bool:
    with residency.lease(spec, Cancel(), notify=notes.append):
        return True
