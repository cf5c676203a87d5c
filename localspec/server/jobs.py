"""A request's generation on the core (:class:`localspec.core.residency.Residency`): a thread of
its own waits for one of the pair's slots (bounded: a full queue refuses it with 503 at once),
sets the generation up and submits it to the pair's scheduler (localspec.decoding.scheduler),
whose step loop hands the generation's events (localspec.generation: each Response, an error,
then END) straight to the event loop's queue. A client that leaves sets the job's
:class:`~localspec.core.cancel.Cancel`: it stops waiting at once, or its generation within one
step (at once during its prompt's prefill); so does a server that stops.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from localspec.core.cancel import Cancel, Cancelled
from localspec.core.pairs import PairSpec
from localspec.core.residency import Residency
from localspec.core.run import shared_history
from localspec.errors import LocalspecError, RequestError
from localspec.generation import END, Generation
from localspec.prompt import Prompt
from localspec.settings.generation import GenerationConfig
from localspec.tools import ToolSet

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One generation: its events (localspec.generation's: Response, an error, END) put into the
    event loop's queue; its `cancel` stops it."""

    prompt: Prompt
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    tools: ToolSet | None = None
    cancel: Cancel = field(default_factory=Cancel)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def emit(self, event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone: nobody is listening
            self.cancel.set("gone")

    async def get(self) -> Any:
        return await self.events.get()


@dataclass
class Pair:
    """The pair a server serves, on its residency, and what its requests share."""

    residency: Residency
    spec: PairSpec
    max_queue: int
    prompt_cache: Any = None  # a PromptCache, or None: off

    @classmethod
    def adopting(cls, target: Any, draft: Any, name: str, max_queue: int = 16, prompt_cache: Any = None) -> Pair:
        """Serve models loaded already (an app's own, a test's), kept on a residency of their own."""
        from localspec.loading import Loaded

        residency = Residency()
        return cls(residency, residency.adopt(Loaded(target, draft, name)), max_queue, prompt_cache)

    def submit(self, job: Job) -> None:
        """Run the job (its events say how it went)."""
        threading.Thread(target=self._run, args=(job,), name="localspec-job", daemon=True).start()

    def _run(self, job: Job) -> None:
        ended = False
        try:
            with self.residency.lease(self.spec, job.cancel, max_queue=self.max_queue) as loaded:
                ended = self._generate(job, loaded)
        except Cancelled as stop:
            if job.cancel.reason == "ending" or str(stop) == "ending":
                job.emit(RequestError("the server is shutting down", status=503))
        except LocalspecError as exc:
            job.emit(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the client as a 500 and logged
            log.exception("generation failed")
            job.emit(exc)
        finally:
            if not ended:
                job.emit(END)

    def _generate(self, job: Job, loaded: Any) -> bool:
        """Set the generation up and run it on the pair's scheduler; this thread keeps the slot
        until it ends. True once its END went to the job."""
        profiles = self.residency.profiles()
        generation = Generation(loaded.target, loaded.draft, job.prompt, job.config, profiles,
                                self.prompt_cache or False, job.tools,
                                shared_history(self.residency, self.spec, job.config), job.cancel)
        done = threading.Event()

        def sink(event: Any) -> None:
            job.emit(event)
            if event is END:
                done.set()

        generation.submit(sink)
        done.wait()
        if job.cancel.is_set():
            log.info("generation stopped (%s)", "the server stops" if job.cancel.reason == "ending" else "the client left")
        profiles.save()
        return True
