"""The one owner of what is loaded: pairs keyed by their spec, the cost profiles, the prompt
caches, a queue per pair and what each call's cancellation stops.

Both front ends keep pairs through it: the resident service (:mod:`localspec.resident.service`,
many pairs, each idle for its keep-alive at most) and ``localspec serve`` (one pair, pinned).
A call *leases* its pair (:meth:`Residency.lease`): it waits in the pair's queue while the pair's
slots are all taken (calls on other pairs run meanwhile), the pair is loaded if it is not (once,
by the first call; the idle pairs used least recently are unloaded first when the new one would
not fit the memory available or LOCALSPEC_MAX_LOADED), its generation waits for the cores its
threads need where other pairs' generations use them, and the call holds one of the pair's slots
until it gives it back: up to ``parallel`` calls generate on a pair at once, in one step loop
(localspec.decoding.scheduler). A call's :class:`Cancel` (Ctrl-C, SIGTERM, its client gone, the
service ending) wakes its wait at once and ends its generation within one step. :meth:`Residency.status` is the one status type
(:mod:`localspec.core.status`) that ``localspec ps``, ``localspec info`` and ``/health`` show.

Targets are kept per file and load options; drafts per target (a call without a draft model
shares the target with calls that have one), loaded when a call needs them (lazily where the
planner decides, :func:`localspec.loading.draft_loading`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from localspec.core.cancel import Cancel, Cancelled
from localspec.core.entries import Entry, Ticket, loaded_bytes, model_bytes
from localspec.core.pairs import ModelFile, PairSpec
from localspec.core.status import CoreStatus, PairStatus, display_name, process_memory
from localspec.decoding.history import History
from localspec.errors import ModelError, RequestError
from localspec.loading import Loaded

log = logging.getLogger(__name__)

DEFAULT_MAX_LOADED = 3  # pairs a service keeps loaded at most (LOCALSPEC_MAX_LOADED), as ollama's default on a CPU
PROMPT_MEMORY = 256 << 20  # bytes of recent prompts' KV states kept in memory, in front of the disk cache


Notify = Callable[[str], None]


def _quiet(text: str) -> None:
    """A call that nobody is told about (the server logs instead)."""
    log.info("%s", text)


class Residency:
    """What is loaded in this process and who uses it (see the module docstring). `memory`:
    bytes available to new allocations (None: unknown); `prompt_memory`: bytes of prompt states
    each prompt cache keeps in memory."""

    def __init__(self, memory: Callable[[], int | None] | None = None, prompt_memory: int = PROMPT_MEMORY) -> None:
        from localspec.llama.host import available_memory, usable_cores

        self._memory = memory or available_memory
        self.prompt_memory = prompt_memory
        self._cond = threading.Condition()
        self._residents: dict[tuple, Entry] = {}
        self._caches: dict[tuple[str, str | None], Any] = {}
        self._profiles: dict[str, Any] = {}
        self.started = time.time()
        self.ending: str | None = None  # why no new call is taken
        self._held: list[Cancel] = []  # the cancellation of every call holding or waiting for a pair
        self.cores = usable_cores()
        self._computing: dict[tuple, tuple[int, int]] = {}  # pairs generating -> (threads they use, their calls)
        self._waiting_cores: list[Ticket] = []  # calls waiting for cores, in arrival order

    # ------------------------------------------------------------ leasing a pair

    @contextlib.contextmanager
    def lease(self, spec: PairSpec, cancel: Cancel, *, need_draft: bool = True, lazy_draft: bool = True,
              grammar: bool = False, keep_alive: float | None = None, max_loaded: int = DEFAULT_MAX_LOADED,
              max_queue: int | None = None, notify: Notify = _quiet) -> Iterator[Loaded]:
        """The pair of `spec`, one of its slots this call's until the block ends (see the module
        docstring). Cancelled when `cancel` is set before the call has it; ModelError when it
        cannot load; RequestError (503) when `max_queue` calls wait already or the residency is
        ending."""
        started = time.monotonic()
        with self._cond:
            entry, ticket = self._join(spec, cancel, max_queue)
        try:
            with self._cond:
                self._wait_turn(entry, ticket, notify)
            seconds = self._ensure_target(entry, spec, grammar, max_loaded, ticket, notify)
            draft, draft_seconds = self._draft(entry, spec, need_draft, lazy_draft)
            with self._cond:
                self._wait_cores(ticket, entry, spec, notify)
            yield Loaded(entry.target, draft, spec.target_name, (seconds, draft_seconds))
        finally:
            with self._cond:
                self._leave(entry, ticket, keep_alive, started)

    def _join(self, spec: PairSpec, cancel: Cancel, max_queue: int | None) -> tuple[Entry, Ticket]:
        if self.ending is not None:
            raise RequestError(f"localspec is ending ({self.ending}); this call was not started", status=503)
        self._forget_replaced(spec)
        entry = self._residents.get(spec.target_key)
        if entry is None:
            entry = self._residents[spec.target_key] = Entry(spec)
        if max_queue is not None and len(entry.queue) >= max_queue:
            raise RequestError(f"the server is busy: {max_queue} requests are waiting; retry later", status=503)
        entry.spec = spec
        ticket = Ticket(cancel)
        entry.queue.append(ticket)
        self._held.append(cancel)
        cancel.wake(self._wake)
        return entry, ticket

    def _wake(self) -> None:
        """A call's cancel was set: whatever waits looks again."""
        with self._cond:
            self._cond.notify_all()

    def _wait_turn(self, entry: Entry, ticket: Ticket, notify: Notify) -> None:
        """Until the ticket is first in its pair's queue and one of the pair's slots is free (while
        it loads, none is), told once why."""
        told = False
        while entry.queue[0] is not ticket or entry.loading or len(entry.holders) >= entry.slots:
            self._check(ticket)
            if not told and entry.target is not None and not entry.loading:
                ahead = entry.queue.index(ticket) + len(entry.holders)
                notify(f"localspec: waiting for {ahead} earlier call{'s' if ahead > 1 else ''} on "
                       f"{display_name(entry.spec.target_name)} ({entry.slots} generate at once: --parallel)")
                told = True
            self._cond.wait()
        self._check(ticket)
        entry.queue.remove(ticket)
        entry.holders.add(ticket)

    def _check(self, ticket: Ticket) -> None:
        if ticket.cancel.is_set():
            raise Cancelled(ticket.cancel.reason)

    def _wait_cores(self, ticket: Ticket, entry: Entry, spec: PairSpec, notify: Notify) -> None:
        """Until the cores the pair's generations use are free (the first waiting call first): two
        pairs generating with threads that together outnumber the cores spin against each other
        in llama.cpp's thread pools (measured on 2 cores: 8× slower each, not 2×); one whose
        threads fit runs beside the others. Calls on a pair that generates already share its step
        loop and its threads: they wait for nothing."""
        key = spec.target_key
        if key in self._computing:
            need, calls = self._computing[key]
            self._computing[key] = (need, calls + 1)
            ticket.computing = key
            return
        need = min(spec.options.target.threads or self.cores, self.cores)
        self._waiting_cores.append(ticket)
        told = False
        try:
            while self._computing and key not in self._computing and (
                    self._waiting_cores[0] is not ticket or sum(n for n, _ in self._computing.values()) + need > self.cores):
                self._check(ticket)
                if not told:
                    others = ", ".join(sorted(display_name(r.spec.target_name) for k, r in self._residents.items()
                                              if k in self._computing))
                    notify(f"localspec: waiting for the CPU: {others} is generating with the cores this call needs "
                           f"({need} of {self.cores}; --threads sets how many a call uses)")
                    told = True
                self._cond.wait()
            self._check(ticket)
            have, calls = self._computing.get(key, (need, 0))
            self._computing[key] = (have, calls + 1)
            ticket.computing = key
        finally:
            self._waiting_cores.remove(ticket)

    def _leave(self, entry: Entry, ticket: Ticket, keep_alive: float | None, started: float) -> None:
        if ticket.computing is not None and ticket.computing in self._computing:
            need, calls = self._computing[ticket.computing]
            if calls <= 1:
                del self._computing[ticket.computing]
            else:
                self._computing[ticket.computing] = (need, calls - 1)
        if ticket in entry.queue:
            entry.queue.remove(ticket)
        if ticket in entry.holders:
            entry.holders.discard(ticket)
            entry.calls += 1
            entry.last_used = time.monotonic()
            entry.last_call_seconds = entry.last_used - started
            entry.keep_alive = keep_alive  # each call sets its pair's anew
        if ticket.cancel in self._held:
            self._held.remove(ticket.cancel)
        if entry.target is None and not entry.loading and not entry.queue and not entry.busy:
            self._residents.pop(entry.spec.target_key, None)  # its load failed, or it was never tried
        self._cond.notify_all()

    def _forget_replaced(self, spec: PairSpec) -> None:
        """Idle targets whose file at the same path is another file now can never be used again."""
        for key, entry in list(self._residents.items()):
            if key != spec.target_key and entry.idle and entry.spec.target.path == spec.target.path \
                    and entry.target is not None and not entry.spec.target.is_current():
                log.info("unloading %s: its file was replaced", entry.spec.target.path)
                self._unload(entry)

    # ------------------------------------------------------------ loading

    def _ensure_target(self, entry: Entry, spec: PairSpec, grammar: bool, max_loaded: int, ticket: Ticket,
                       notify: Notify) -> float:
        """Load the target (its holder does, once); the seconds it took (0: it was loaded)."""
        if entry.target is not None:
            return 0.0
        with self._cond:
            self._make_room(entry, spec, max_loaded, ticket, notify)
            entry.loading = True
        t0 = time.perf_counter()
        try:
            target = self._load_target(spec, grammar)
        finally:
            with self._cond:
                entry.loading = False
        with self._cond:
            entry.target = target
            entry.bytes = loaded_bytes(target)
            self._cond.notify_all()  # its other slots may be taken now
        return time.perf_counter() - t0

    @staticmethod
    def _load_target(spec: PairSpec, grammar: bool) -> Any:
        from localspec.loading import load_target

        target = load_target(spec.target.path, spec.options.target, grammar)
        if not spec.target.is_current():  # replaced while the call was on its way: its key is not this file
            target.close()
            raise ModelError(f"{spec.target.path} changed while it was being loaded; run the call again")
        return target

    def _make_room(self, entry: Entry, spec: PairSpec, max_loaded: int, ticket: Ticket,
                   notify: Notify) -> None:
        """Before a load: unload idle pairs, the least recently used first, while the new one would
        not fit the memory available or max_loaded; wait (told why) while what is in the way is
        busy; load anyway where nothing else is loaded (the load says if it cannot)."""
        need = model_bytes(spec.target, spec.options.target)
        told = None
        while True:
            self._check(ticket)
            others = [r for r in self._residents.values() if r is not entry and (r.target is not None or r.loading)]
            available = self._memory()
            fits = len(others) < max_loaded and (available is None or need <= available)
            if fits or not others:
                return
            idle = sorted((r for r in others if r.idle and not r.pinned), key=lambda r: r.last_used)
            if idle:
                notify(f"localspec: unloaded {display_name(idle[0].spec.target_name)} to make room for "
                       f"{display_name(spec.target_name)}")
                self._unload(idle[0])
                continue
            why = (f"{len(others)} models are loaded (LOCALSPEC_MAX_LOADED={max_loaded})" if len(others) >= max_loaded
                   else f"{need >> 20} MB are needed and {(available or 0) >> 20} MB are available")
            if why != told:
                busy = ", ".join(display_name(r.spec.target_name) for r in others)
                notify(f"localspec: waiting for {busy} to finish: {why}")
                told = why
            self._cond.wait()  # a pair given back, a call cancelled

    def _draft(self, entry: Entry, spec: PairSpec, need: bool, lazy: bool) -> tuple[Any, float | None]:
        """The call's draft: none, the LazyModel the planner loads when it pays, or loaded now."""
        key = spec.draft_key
        if not need or spec.draft is None or key is None:  # (the key is None where the draft is)
            return None, None
        from localspec.llama.lazy import LazyModel

        with self._cond:
            for other, model in list(entry.drafts.items()):  # a replaced file is never used again
                if other != key and model.path == Path(spec.draft.path) and not spec.draft.is_current():
                    model.close()
                    del entry.drafts[other]
            draft = entry.drafts.get(key)
        if draft is None:
            draft = LazyModel(spec.draft.path, spec.options.draft, spec.paired)
            with self._cond:
                entry.drafts[key] = draft
        if lazy:
            return draft, None
        if draft.loaded:
            return draft.get(), 0.0
        t0 = time.perf_counter()
        model = draft.get()
        with self._cond:
            entry.bytes = loaded_bytes(entry.target) + sum(loaded_bytes(d.get()) for d in entry.draft_models())
        return model, time.perf_counter() - t0

    # ------------------------------------------------------------ unloading

    def _unload(self, entry: Entry) -> None:
        self._residents.pop(entry.spec.target_key, None)
        for model in (*entry.drafts.values(), entry.target):
            if model is not None:
                with contextlib.suppress(Exception):
                    model.close()
        entry.target = None
        entry.drafts.clear()
        self._cond.notify_all()

    def expire(self) -> float | None:
        """Unload the pairs idle for longer than their keep-alive; the seconds until the next one
        is due (None: no pair will expire: none is loaded, or all are pinned or busy)."""
        now = time.monotonic()
        due: float | None = None
        with self._cond:
            for entry in list(self._residents.values()):
                if not entry.idle or entry.keep_alive is None or entry.target is None:
                    continue
                left = entry.last_used + entry.keep_alive - now
                if left <= 0:
                    log.info("unloading %s: idle for %.0f s", entry.spec.target_name, entry.keep_alive)
                    self._unload(entry)
                else:
                    due = left if due is None else min(due, left)
        return due

    def unload(self, chosen: Callable[[PairStatus], bool], reason: str) -> list[PairStatus]:
        """Unload the pairs whose status `chosen` picks (a call using one stops between two steps,
        calls waiting for it are cancelled); their statuses as they were."""
        with self._cond:
            picked = [(r, r.status()) for r in self._residents.values() if not r.pinned]
            picked = [(r, s) for r, s in picked if chosen(s)]
            for entry, _ in picked:
                for ticket in [*entry.holders, *entry.queue]:
                    ticket.cancel.set("ending")
            self._cond.wait_for(lambda: not any(r.busy or r.loading for r, _ in picked), timeout=30)
            for entry, _ in picked:
                if not entry.busy and not entry.loading:
                    log.info("unloading %s: %s", entry.spec.target_name, reason)
                    self._unload(entry)
        return [s for _, s in picked]

    def end(self, reason: str) -> None:
        """Take no new call; every call holding or waiting for a pair stops (between two steps)."""
        with self._cond:
            self.ending = self.ending or reason
            for cancel in self._held:
                cancel.set("ending")
            self._cond.notify_all()

    def close(self, timeout: float = 30.0) -> bool:
        """end(), wait for the calls to stop, unload everything. True when no call was left running."""
        self.end(self.ending or "closing")
        with self._cond:
            self._cond.wait_for(lambda: not any(r.busy or r.loading for r in self._residents.values()), timeout)
            running = any(r.busy or r.loading for r in self._residents.values())
            for entry in list(self._residents.values()):
                if not entry.busy and not entry.loading:
                    self._unload(entry)
        for profiles in self._profiles.values():
            with contextlib.suppress(Exception):
                profiles.save()
        return not running

    def adopt(self, loaded: Loaded) -> PairSpec:
        """Keep models loaded elsewhere (an app's own, a test's) as a pair for as long as the
        residency lives; its spec, for leases."""
        from localspec.llama.lazy import LazyModel
        from localspec.settings.models import PairOptions

        target, draft = loaded.target, loaded.draft
        spec = PairSpec(ModelFile.at(target.path), ModelFile.at(draft.path) if draft is not None else None,
                        loaded.target_name, False,
                        PairOptions(target.options, draft.options if draft is not None else target.options))
        with self._cond:
            entry = self._residents[spec.target_key] = Entry(spec, target=target, pinned=True)
            entry.bytes = loaded_bytes(target)
            if draft is not None and spec.draft_key is not None:  # (the spec has a draft where `draft` is one)
                entry.drafts[spec.draft_key] = draft if isinstance(draft, LazyModel) else LazyModel.of(draft)
        return spec

    def pin(self, spec: PairSpec, *, need_draft: bool, lazy_draft: bool, grammar: bool = False) -> Loaded:
        """Load a pair now and keep it for as long as the residency lives (`serve`'s pair): no
        keep-alive, never unloaded to make room, nor by :meth:`unload`; only :meth:`close` frees it."""
        with self.lease(spec, Cancel(), need_draft=need_draft, lazy_draft=lazy_draft, grammar=grammar,
                        keep_alive=None) as loaded:
            with self._cond:
                self._residents[spec.target_key].pinned = True
        return loaded

    # ------------------------------------------------------------ what calls share

    def history(self, spec: PairSpec) -> History:
        """The earlier calls of the pair's target (a call drafts from them, and adds itself)."""
        with self._cond:
            entry = self._residents.get(spec.target_key)
            return entry.history if entry is not None else History()

    def profiles(self, directory: str | os.PathLike | None = None) -> Any:
        """The cost profiles of `directory` (None: the default), one object per directory: calls
        learn into the same one (each saves it after its generation)."""
        from localspec.decoding.profiles import Profiles

        path = Path(directory) if directory is not None else None
        key = str(path) if path is not None else ""
        with self._cond:
            if key not in self._profiles:
                self._profiles[key] = Profiles(path)
            return self._profiles[key]

    def prompt_cache(self, directory: str | os.PathLike | None, limit: int, namespace: str | None = None) -> Any:
        """The prompt cache of `directory` (None: off), with up to prompt_memory bytes of states in
        memory in front of the disk, one per directory (and namespace: a server's API key)."""
        if directory is None:
            return None
        from localspec.llama.prompt_cache import PromptCache

        key = (os.fsdecode(directory), namespace)
        with self._cond:
            cache = self._caches.get(key)
            if cache is None:
                cache = self._caches[key] = PromptCache(directory, limit, memory=self.prompt_memory,
                                                        namespace=namespace)
            cache.limit = limit
            return cache

    # ------------------------------------------------------------ status

    def status(self) -> CoreStatus:
        with self._cond:
            pairs = tuple(r.status() for r in self._residents.values())
        rss, peak = process_memory()
        return CoreStatus(pid=os.getpid(), started=self.started, memory_bytes=rss, memory_peak_bytes=peak,
                          pairs=pairs, ending=self.ending)
