"""A request's generation, run on the core (:class:`localspec.core.residency.Residency`) in a
thread of its own: it waits in its pair's queue (bounded: a full queue refuses it with 503 at
once), generates, and hands its events to the event loop. A client that leaves sets the job's
:class:`~localspec.core.residency.Cancel`: it stops waiting at once, or its generation between
two steps; so does a server that stops.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from localspec.api import Generation
from localspec.settings.generation import GenerationConfig
from localspec.core.pairs import PairSpec
from localspec.core.cancel import Cancel, Cancelled
from localspec.core.residency import Residency
from localspec.errors import LocalspecError, RequestError
from localspec.tools import ToolSet

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One generation: ("token", Response) events, ("error", exc), then ("end", None), put into
    the event loop's queue; its `cancel` stops it."""

    prompt: Any
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    tools: ToolSet | None = None
    cancel: Cancel = field(default_factory=Cancel)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def emit(self, event: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (event, value))
        except RuntimeError:  # the event loop is gone: nobody is listening
            self.cancel.set("gone")

    async def get(self) -> tuple[str, Any]:
        return await self.events.get()


@dataclass
class Pair:
    """The pair a server serves, on its residency, and what its requests share."""

    residency: Residency
    spec: PairSpec
    max_queue: int
    prompt_cache: Any = None  # a PromptCache, or None: off

    @classmethod
    def adopting(cls, target: Any, draft: Any, name: str, max_queue: int = 16, prompt_cache: Any = None) -> "Pair":
        """Serve models loaded already (an app's own, a test's), kept on a residency of their own."""
        from localspec.loading import Loaded

        residency = Residency()
        return cls(residency, residency.adopt(Loaded(target, draft, name)), max_queue, prompt_cache)

    def submit(self, job: Job) -> None:
        """Run the job in a thread of its own (its events say how it went)."""
        threading.Thread(target=self._run, args=(job,), name="localspec-job", daemon=True).start()

    def _run(self, job: Job) -> None:
        try:
            with self.residency.lease(self.spec, job.cancel, max_queue=self.max_queue) as loaded:
                self._generate(job, loaded)
        except Cancelled as stop:
            if str(stop) == "ending":
                job.emit("error", RequestError("the server is shutting down", status=503))
        except LocalspecError as exc:
            job.emit("error", exc)
        except Exception as exc:  # noqa: BLE001 - reported to the client as a 500 and logged
            log.exception("generation failed")
            job.emit("error", exc)
        finally:
            job.emit("end", None)

    def _generate(self, job: Job, loaded: Any) -> None:
        profiles = self.residency.profiles()
        stream = iter(Generation(loaded.target, loaded.draft, job.prompt, job.config, profiles,
                                 self.prompt_cache or False, job.tools, self.residency.history(self.spec)))
        try:
            for r in stream:
                job.emit("token", r)
                if r.finish_reason is None and job.cancel.is_set():
                    log.info("generation stopped after %d tokens (%s)", r.stats.generated_tokens,
                             "the server stops" if job.cancel.reason == "ending" else "the client left")
                    return
        finally:
            stream.close()  # between steps: the engine keeps its KV caches consistent
            profiles.save()
