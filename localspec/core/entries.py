"""A residency's entries: one target (with the drafts calls brought) and the calls that use it
(:class:`Entry`), a call in its queue (:class:`Ticket`), and the memory a pair takes
(:func:`model_bytes` before it loads, :func:`loaded_bytes` once loaded)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Any

from localspec.core.cancel import Cancel
from localspec.core.pairs import ModelFile, PairSpec
from localspec.core.status import PairStatus, State, display_name
from localspec.decoding.history import History
from localspec.settings.models import ModelOptions

MEMORY_MARGIN = 1.15  # a file that cannot be estimated: about its size, plus its context and compute buffers


@dataclass(eq=False)
class Ticket:
    """A call in a pair's queue."""

    cancel: Cancel
    since: float = field(default_factory=time.monotonic)
    computing: tuple | None = None  # the pair whose generations it counts among (Residency._wait_cores)


@dataclass(eq=False)
class Entry:
    """A target (with the drafts calls brought) and the calls that use it."""

    spec: PairSpec  # the latest call's (its names are what `ps` shows)
    target: Any = None  # localspec.llama.model.Model once loaded
    drafts: dict[tuple, Any] = field(default_factory=dict)  # draft key -> LazyModel
    loading: bool = False
    holders: set[Ticket] = field(default_factory=set)  # calls that have it (at most its slots)
    queue: list[Ticket] = field(default_factory=list)
    pinned: bool = False  # kept for as long as the residency lives (`serve`'s pair)
    calls: int = 0  # leases given back
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float | None = None  # seconds idle before it is unloaded (None: never; `serve`)
    last_call_seconds: float | None = None
    bytes: int = 0  # estimated memory (weights, KV cache, buffers)
    history: History = field(default_factory=History)  # its earlier calls, drafted from (decoding.history)

    @property
    def busy(self) -> bool:
        return bool(self.holders)

    @property
    def idle(self) -> bool:
        return not self.holders and not self.queue and not self.loading

    @property
    def slots(self) -> int:
        """Calls that may have it at once: its target's slots (one while it is not loaded: the
        call that loads it)."""
        return int(getattr(self.target, "n_slots", 1) or 1) if self.target is not None else 1

    def draft_models(self) -> list[Any]:
        return [d for d in self.drafts.values() if getattr(d, "loaded", True)]

    def status(self) -> PairStatus:
        now = time.monotonic()
        spec = self.spec
        drafts = self.draft_models()
        state: State = "loading" if self.loading else "busy" if self.busy else "idle" if self.target else "waiting"
        idle = 0.0 if state != "idle" else now - self.last_used
        left = None if state != "idle" or self.keep_alive is None else max(0.0, self.keep_alive - idle)
        return PairStatus(name=display_name(spec.target_name), target=spec.target.path,
                          draft=drafts[0].path.as_posix() if drafts else (spec.draft.path if spec.draft else None),
                          draft_loaded=bool(drafts), state=state, queued=len(self.queue), calls=self.calls,
                          memory_bytes=self.bytes, idle_seconds=round(idle, 3), left_seconds=left,
                          keep_alive_seconds=self.keep_alive, last_call_seconds=self.last_call_seconds,
                          slots=self.slots, generating=len(self.holders))


def model_bytes(file: ModelFile | None, options: ModelOptions) -> int:
    """What a model file will take once loaded with `options` (0 for none): the estimate from its
    header (localspec.llama.memory: weights, KV cache, compute and output buffers). A file that
    cannot be estimated counts its size × MEMORY_MARGIN: its load says what is wrong with it."""
    if file is None:
        return 0
    try:
        return _estimated(file.path, file.identity, options)
    except Exception:  # noqa: BLE001 - a damaged or unsupported file: its load reports why
        return int(MEMORY_MARGIN * file.size)


def loaded_bytes(model: Any) -> int:
    """A loaded model's memory (what `ps` shows): the estimate for its file under the options and
    the CPU kernels it was loaded with; a closed model counts nothing."""
    try:
        model.size_bytes  # noqa: B018 - a ModelError once the model is closed
        options = model.options
        if getattr(model, "kernels", None) is not None:
            options = replace(options, cpu_kernels=model.kernels.config)
        file = ModelFile.at(model.path)
        return _estimated(file.path, file.identity, options)
    except Exception:  # noqa: BLE001 - an estimate for `ps`; a closed or replaced model counts nothing
        return 0


@functools.lru_cache(maxsize=64)
def _estimated(path: str, identity: tuple, options: ModelOptions) -> int:
    """The estimate's total, once per file (its identity: a replaced file is estimated again) and options."""
    from localspec.llama.memory import estimate_model

    return estimate_model(path, options).total
