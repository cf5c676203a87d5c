"""One thread owns the models and runs generations one at a time, in arrival order.

The event loop hands it :class:`Job` objects and reads their events back; a job whose client
left is cancelled between steps, and a full queue refuses new jobs at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from localspec.api import Generation
from localspec.config import GenerationConfig
from localspec.decoding.profiles import Profiles
from localspec.errors import LocalspecError, RequestError
from localspec.llama.model import Model
from localspec.tools import ToolSet

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One generation: the worker thread emits ("token", Response), ("error", exc), then ("end", None)
    into the event loop's queue; setting `cancel` stops it between steps."""

    prompt: Any
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    tools: ToolSet | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def emit(self, event: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (event, value))
        except RuntimeError:  # the event loop is gone: nobody is listening
            self.cancel.set()

    async def get(self) -> tuple[str, Any]:
        return await self.events.get()


class ModelWorker:
    """Runs jobs one at a time, in arrival order, on one thread that owns the models and the cost
    profiles their generations refine (saved after each one)."""

    def __init__(self, target: Model, draft: Model | None, max_queue: int, prompt_cache: Any = None) -> None:
        self.target = target
        self.draft = draft
        self.prompt_cache = prompt_cache  # a PromptCache (with states kept in memory too), or None: off
        self.profiles = Profiles()
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.busy = threading.Lock()  # held while a generation touches the models
        self.finished = 0  # generations run to their end (finish reason or error)
        self.stopped_early = 0  # generations stopped because the client left or the server stops

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed:
                raise RequestError("the server is shutting down", status=503)
            if self._jobs.qsize() >= self.max_queue:
                raise RequestError(f"the server is busy: {self.max_queue} requests are waiting; retry later",
                                   status=503)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="localspec-worker", daemon=True)
                self._thread.start()
            self._jobs.put(job)

    def pending(self) -> int:
        return self._jobs.qsize()

    def stop(self) -> None:
        """Make the running generation end after its current step and refuse queued and new jobs
        (safe in a signal handler: takes no lock)."""
        self._closed = True

    def close(self, timeout: float = 30.0) -> bool:
        """stop(), then wait for the worker thread. True when no generation is running."""
        with self._lock:
            self._closed = True
            thread = self._thread
            self._jobs.put(None)
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("a generation is still running after %.0f s", timeout)
                return False
        return True

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._closed:
                job.emit("error", RequestError("the server is shutting down", status=503))
            elif not job.cancel.is_set():
                with self.busy:
                    self._run(job)
            job.emit("end", None)

    def _run(self, job: Job) -> None:
        stream = None
        try:
            stream = iter(Generation(self.target, self.draft, job.prompt, job.config, self.profiles,
                                     self.prompt_cache or False, job.tools))
            for r in stream:
                job.emit("token", r)
                if r.finish_reason is None and (job.cancel.is_set() or self._closed):
                    log.info("generation stopped after %d tokens (client gone or shutdown)",
                             r.stats.generated_tokens)
                    self.stopped_early += 1
                    return
            self.finished += 1
        except LocalspecError as exc:
            self.finished += 1
            job.emit("error", exc)
        except Exception as exc:  # noqa: BLE001 - reported to the client as a 500 and logged
            self.finished += 1
            log.exception("generation failed")
            job.emit("error", exc)
        finally:
            if stream is not None:
                stream.close()  # between steps: the engine keeps its KV caches consistent
                self.profiles.save()
