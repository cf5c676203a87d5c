"""One step loop per loaded target: every active call is a slot, and each round puts every slot's
work into one decode per model (continuous batching with speculation).

A call (:class:`Call`: a generation, localspec.api.Generation) is a program: a generator that
yields decode requests (localspec.decoding.passes: a :class:`~localspec.decoding.passes.Fill` of
committed tokens, a :class:`~localspec.decoding.passes.Step`'s draft nodes) and a
:class:`~localspec.decoding.passes.Turn` request at the end of each step. The scheduler runs
rounds, as llama-server's slots run (tools/server/server-context.cpp: one batch per step built in
``pre_decode``, each slot verified on its own rows in ``post_decode``):

1. calls whose cancel is set end (between two steps, or between two prompt chunks); waiting calls
   take the free slots (the slot whose cached tokens share the longest prefix with the prompt,
   else the one used least recently);
2. every slot at a turn starts its next step, told what the others put in the target pass (the
   planner prices its draft against that: localspec.decoding.planner.Planner.choose);
3. draft-model requests of all slots are decoded together, one decode per draft model, until
   every slot waits for the target;
4. ONE target decode holds every slot's root and draft nodes and a bounded chunk of the prompts
   being prefilled (at most :data:`PREFILL_CHUNK` tokens while other slots generate, so a long
   prompt never stalls them for more than one chunk; the whole batch when it is alone); each slot
   then verifies its own rows with its own verifier, sampling, grammar and random stream,
   commits, and emits its tokens.

One call alone runs exactly the decodes it runs without the scheduler (localspec.decoding.passes.run_alone).
A decode running for calls that are all cancelled is stopped half-way (llama.cpp's abort callback,
localspec.llama.batch.AbortFlag), so a cancel during a long prefill returns within a graph node.
A call's failure ends its own slot; the others go on.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from localspec.decoding import passes
from localspec.decoding.batch_plan import Offer, allocate
from localspec.decoding.passes import Decoded, Fill, Turn
from localspec.decoding.slots import Call, Running, Slot
from localspec.errors import Cancelled, LocalspecError, RequestError
from localspec.llama.parked import PARK_MEMORY, Parked
from localspec.llama.sequence import Part

log = logging.getLogger(__name__)

PREFILL_CHUNK = 256  # prompt tokens a round's target decode takes while other slots generate
DEFAULT_MAX_QUEUE = 64  # calls that may wait for a slot (beyond them: RequestError, a 503 for a server)
WATCH = 0.05  # seconds between checks, during a decode, of whether its calls were all cancelled
SIMILAR = 0.5  # of a prompt a slot's context must hold to take that slot (llama-server's default similarity)
IDLE_EXIT = 30.0  # seconds a loop waits for a call before its thread ends (and lets go of the model)


class Scheduler:
    """The step loop of one loaded target (see the module docstring); :meth:`of` gives a model's."""

    def __init__(self, target: Any, max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        self.target = target
        self.max_queue = max_queue
        self.slots = [Slot(i) for i in range(target.n_slots)]
        self._waiting: collections.deque[Call] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running: Running | None = None
        self._admissions = 0
        self.closed = False
        self.parked = Parked(PARK_MEMORY)
        self.rounds = 0  # rounds run (diagnostics, tests)
        self.decodes: collections.Counter[int] = collections.Counter()  # target decodes by slots served

    @classmethod
    def of(cls, target: Any) -> Scheduler:
        """The target's scheduler, made on first use."""
        with _MADE:
            if target.scheduler is None:
                target.scheduler = cls(target)
            return target.scheduler

    # ------------------------------------------------------------------ the calls' side

    def submit(self, call: Call) -> None:
        """Run `call` as soon as a slot is free (its events come through its own sink).
        RequestError when max_queue calls wait already or the scheduler is closed."""
        with self._cond:
            if self.closed:
                raise RequestError(f"{self.target.path.name} was closed; load it again", status=503)
            if len(self._waiting) >= self.max_queue and not self._free_slots():
                raise RequestError(f"{len(self._waiting)} calls wait for {self.target.path.name} already "
                                   f"(max_queue={self.max_queue}); retry later", status=503)
            self._waiting.append(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="localspec-slots", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def in_use(self) -> tuple[int, int]:
        """(slots generating, calls waiting for one)."""
        with self._cond:
            return sum(s.call is not None for s in self.slots), len(self._waiting)

    @property
    def busy(self) -> bool:
        """Whether a call runs in it now (read without its lock: another scheduler may ask while
        holding its own)."""
        return any(s.call is not None for s in self.slots)

    def close(self, timeout: float = 30.0) -> None:
        """Stop every call (as cancelled) and the loop; no call is taken after."""
        with self._cond:
            self.closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        watcher = threading.Thread(target=self._watch, args=(threading.current_thread(),), name="localspec-watch",
                                   daemon=True)
        watcher.start()
        try:
            while True:
                with self._cond:  # idle: the thread (and llama.cpp's thread team under it) waits for a call
                    if not self._cond.wait_for(lambda: self.closed or bool(self._waiting)
                                               or any(s.call is not None for s in self.slots), IDLE_EXIT):
                        self._thread = None  # decided under the lock: the next submit starts a loop again
                        self._cond.notify_all()
                        return
                if self._admit():
                    self._round()
                elif self.closed:
                    return
        except BaseException:  # noqa: BLE001 - a bug in the loop: every call ends with it
            log.exception("the step loop failed")
            self._fail_all(RuntimeError("localspec's step loop failed (see the log)"))
        finally:
            with self._cond:
                if self._thread is threading.current_thread():  # closed, or it failed: a submit starts another
                    self._thread = None
                self._cond.notify_all()

    def _admit(self) -> bool:
        """Cancelled calls end, waiting ones take free slots; whether a call is running."""
        with self._cond:
            waiting = list(self._waiting)
        for call in waiting:
            if call.cancelled() or self.closed:
                self._remove_waiting(call)
                call.end(None, True)
        for slot in self.slots:
            if slot.call is not None and (self.closed or slot.call.cancelled()):
                self._stop(slot)
        with self._cond:
            while self._waiting and not self.closed:
                free = self._slot_for(self._waiting[0])
                if free is None:
                    break
                self._start(free, self._waiting.popleft())
            return any(s.call is not None for s in self.slots)

    def _remove_waiting(self, call: Call) -> None:
        with self._cond:
            if call in self._waiting:
                self._waiting.remove(call)

    def _free_slots(self) -> list[Slot]:
        return [s for s in self.slots if s.call is None]

    def _slot_for(self, call: Call) -> Slot | None:
        """The free slot whose context (in its cells, or parked from it) holds the longest prefix of
        the call's prompt, more than SIMILAR of the prompt (llama-server's slot similarity), else
        the one used least recently."""
        free = self._free_slots()
        if not free:
            return None
        shared = [(self._shared(s, call.prompt), -s.last_used, s) for s in free]
        best = max(shared, key=lambda x: (x[0], x[1]))
        if best[0] > SIMILAR * len(call.prompt):
            return best[2]
        return min(free, key=lambda s: s.last_used)

    def _shared(self, slot: Slot, prompt: Sequence[int]) -> int:
        """The prefix of `prompt` the slot holds, in its cells or parked from it in memory."""
        return max(self.target.sequences[slot.index].reusable(prompt),
                   self.parked.shared(slot.index, prompt, self.target))

    def _start(self, slot: Slot, call: Call) -> None:
        self._admissions += 1
        slot.call, slot.admitted, slot.pending = call, self._admissions, None
        try:
            self._park_idle(slot)
            self._park_if_mostly_lost(slot, call.prompt)
            self.parked.restore(slot.index, call.prompt, self.target)
            call.bind(slot.index)
            slot.program = call.program()
        except BaseException as exc:  # noqa: BLE001 - the call's own failure
            self._end(slot, exc)

    # ------------------------------------------------------------------ idle slots' cells

    def _park_idle(self, taken: Slot) -> None:
        """Idle slots' cells go to memory before another call runs: one unified cache attends over
        every used cell, so cells an idle slot holds slow each step of every other call (its
        earlier context comes back from memory in milliseconds when a call needs it)."""
        for slot in self.slots:
            if slot is not taken and slot.call is None:
                self.parked.park(slot.index, [self.target, *slot.models])

    def _park_if_mostly_lost(self, slot: Slot, prompt: Sequence[int]) -> None:
        """A slot's context that the new call would keep less than SIMILAR of goes to memory first
        (as llama-server saves such a slot's prompt in its cache): a later call that continues it
        gets it back, into whichever slot it takes; what the new call shares of it comes back
        from there at once."""
        seq = self.target.sequences[slot.index]
        if seq.n_cached and seq.reusable(prompt) < SIMILAR * seq.n_cached:
            self.parked.park(slot.index, [self.target, *slot.models])

    # ------------------------------------------------------------------ a round

    def _round(self) -> None:
        self.rounds += 1
        self._advance_turns()
        self._run_drafts()
        self._run_target()

    def _active(self) -> list[Slot]:
        return sorted((s for s in self.slots if s.call is not None), key=lambda s: s.admitted)

    def _advance_turns(self) -> None:
        """Every slot at a turn (or just admitted) starts its next step, told what the others'
        tokens in this round's target pass are so far. With several generating, the round is
        planned as a whole: each step offers its options and drafts at the depth the round's plan
        gives it (localspec.decoding.batch_plan.allocate)."""
        active = self._active()
        generating = [s for s in active if not isinstance(s.pending, Fill)]
        prefill = min(PREFILL_CHUNK, self._prefill_left(active)) if len(generating) < len(active) else 0
        planned = 0  # tokens of the target pass the slots before have asked for
        for i, slot in enumerate(generating):
            others = planned + (len(generating) - i - 1) + prefill  # later slots add at least their root
            self._resume(slot, Turn(others, self.target.n_batch - others, planned=len(generating) > 1))
            if slot.call is not None:
                planned += self._target_tokens(slot)
        self._plan_round(generating, prefill)

    def _plan_round(self, generating: list[Slot], prefill: int) -> None:
        """The offers of this round's steps, answered with the depths of the round's plan."""
        offering = [s for s in generating if s.call is not None and isinstance(s.pending, Offer)]
        if not offering:
            return
        fixed = [s for s in generating if s.call is not None and s not in offering]
        depths = allocate([s.pending for s in offering], sum(self._target_tokens(s) for s in fixed) + prefill,
                          float(len(fixed)), self.target.n_batch)
        for slot, depth in zip(offering, depths, strict=True):
            self._resume(slot, depth)

    def _prefill_left(self, active: Sequence[Slot]) -> int:
        return sum(max(s.pending.upto - s.pending.sequence.n_cached, 0) for s in active
                   if isinstance(s.pending, Fill) and s.pending.sequence.model is self.target)

    def _target_tokens(self, slot: Slot) -> int:
        """Tokens the slot puts in this round's target pass (its root while it is still drafting)."""
        pending = slot.pending
        if isinstance(pending, passes.Step) and pending.sequence.model is self.target:
            return len(pending.part.tokens)
        if isinstance(pending, Offer):
            return pending.tokens[0]
        return 0 if isinstance(pending, Turn) or slot.call is None else 1

    def _resume(self, slot: Slot, value: Any) -> None:
        """Run the slot's program until it asks for a decode or a turn (or ends)."""
        assert slot.program is not None
        try:
            slot.pending = slot.program.send(value) if slot.pending is not None else next(slot.program)
        except StopIteration:
            self._end(slot, None)
        except Cancelled:
            self._end(slot, None, cancelled=True)
        except LocalspecError as exc:  # the call's failure (its input, its model): it ends its slot only
            self._end(slot, exc)
        except BaseException as exc:  # noqa: BLE001 - a bug: logged with its traceback, its slot ends
            log.exception("a call failed")
            self._end(slot, exc)

    def _draft_requests(self, filled: set[Slot]) -> dict[int, list[Slot]]:
        """Slots waiting for a decode of a model other than the target, by model (those in
        `filled` got a chunk of their catch-up this round: the next one waits for the next round)."""
        out: dict[int, list[Slot]] = {}
        for slot in self._active():
            pending = slot.pending
            if isinstance(pending, Fill) and slot in filled:
                continue
            if isinstance(pending, (Fill, passes.Step)) and pending.sequence.model is not self.target:
                out.setdefault(id(pending.sequence.model), []).append(slot)
        return out

    def _run_drafts(self) -> None:
        """Draft models' decodes, one per model per level, until every slot waits for the target
        or for the next round: a draft model catching up on a long context takes one chunk a
        round while other slots generate."""
        filled: set[Slot] = set()
        while True:
            groups = self._draft_requests(filled)
            if not groups:
                return
            for slots in groups.values():
                steps = any(isinstance(s.pending, passes.Step) for s in slots) or len(self._active()) > 1
                filled.update(s for s in slots if isinstance(s.pending, Fill))
                self._decode(slots[0].pending.sequence.model, slots, budget=PREFILL_CHUNK if steps else None)

    def _run_target(self) -> None:
        """The round's one target decode: every step's part, then prompt chunks within the budget."""
        active = [s for s in self._active() if isinstance(s.pending, (Fill, passes.Step))
                  and s.pending.sequence.model is self.target]
        steps = [s for s in active if isinstance(s.pending, passes.Step)]
        fills = [s for s in active if isinstance(s.pending, Fill)]
        if not steps and not fills:
            return
        budget = PREFILL_CHUNK if steps else None
        self._decode(self.target, steps + fills, budget=budget)

    def _decode(self, model: Any, slots: list[Slot], budget: int | None) -> None:
        """One decode of the slots' requests on `model` (fills within `budget` tokens, None: the
        batch's room); each slot is resumed with what it got."""
        room = model.n_batch - sum(len(s.pending.part.tokens) for s in slots if isinstance(s.pending, passes.Step))
        budget = room if budget is None else min(budget, room)
        served: list[Slot] = []
        parts: list[Part] = []
        for slot in slots:
            request = slot.pending
            slot.models.add(request.sequence.model)
            if isinstance(request, Fill):
                if (budget <= 0 and parts) or (request.measure and len(request.part(budget).tokens) > room):
                    continue  # its prompt goes on next round
                part = request.part(max(budget, 1) if not parts else budget)
                budget -= len(part.tokens)
                room -= len(part.tokens)
            else:
                part = request.part
            served.append(slot)
            parts.append(part)
        if not parts:
            return
        decoded = self._run(model, served, parts)
        if decoded is None:
            return
        if model is self.target:
            self.decodes[len(served)] += 1
        for slot in served:
            self._resume(slot, decoded)

    def _run(self, model: Any, served: list[Slot], parts: list[Part]) -> Decoded | None:
        """The decode, watched for cancellation; a failure ends the slots it served."""
        calls = [s.call for s in served]
        with self._cond:
            self._running = Running(model, [c for c in calls if c is not None])
            model.resume_decoding()
            self._cond.notify_all()
        try:
            return passes.decode(model, parts, [s.pending for s in served])
        except Cancelled:
            for slot in served:
                self._end(slot, None, cancelled=True)
        except BaseException as exc:  # noqa: BLE001 - a decode that failed fails the calls it held
            log.warning("a decode of %d calls failed: %s", len(served), exc)
            for slot in served:
                self._end(slot, exc)
        finally:
            with self._cond:
                self._running = None
        return None

    def _watch(self, loop: threading.Thread) -> None:
        """While the loop runs: stop a decode whose calls were all cancelled (the abort flag). A
        call's cancel is any object with is_set() (a threading.Event), which calls nobody when it
        is set: while a decode runs, it is looked at every WATCH seconds; between decodes, nothing."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._running is not None or self._thread is not loop)
                if self._thread is not loop:
                    return
                running = self._running
                assert running is not None  # what the wait ended on, as the loop is still this one
            if running.calls and all(c.cancelled() for c in running.calls) or self.closed:
                with self._cond:
                    if self._running is running:
                        running.model.stop_decoding()
            time.sleep(WATCH)

    # ------------------------------------------------------------------ ends

    def _stop(self, slot: Slot) -> None:
        """A cancelled call ends between two steps: its program is closed where it waits."""
        if slot.program is not None:
            try:
                slot.program.close()
            except BaseException as exc:  # noqa: BLE001 - cleaning up a program that failed
                log.warning("a stopped call failed while ending: %s", exc)
        self._end(slot, None, cancelled=True)

    def _end(self, slot: Slot, error: BaseException | None, cancelled: bool = False) -> None:
        call = slot.call
        slot.release()
        if any(s.call is not None for s in self.slots):  # others run on: its cells would slow them
            self.parked.park(slot.index, [self.target, *slot.models])
        if call is None:
            return
        try:
            call.end(error, cancelled)
        except BaseException:  # noqa: BLE001 - its end must not stop the others
            log.exception("a call failed while ending")

    def _fail_all(self, error: BaseException) -> None:
        for slot in self.slots:
            if slot.call is not None:
                self._end(slot, error)
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for call in waiting:
            call.end(error, False)


_MADE = threading.Lock()
