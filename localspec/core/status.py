"""The one status type of what is loaded (:class:`CoreStatus`, a :class:`PairStatus` per pair):
``localspec ps`` and ``localspec info`` print it (:func:`table`), ``localspec stop`` picks pairs
by it, and ``localspec serve`` answers it on ``/health``.

Plain dataclasses and the standard library; ``ps`` and ``stop`` read a service's answer with
pydantic, from these types (:func:`localspec.core.wire.parse_status`), so that a malformed answer
never breaks a command. A field declared here is checked wherever a status is read; one with a
default also reads the answer of a service that predates it (``ps`` asks every service of this
user, whatever localspec runs it).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from localspec.settings.validation import WIRE_CONFIG

State = Literal["waiting", "loading", "busy", "idle"]  # waiting: a call waits for room to load it
STATES: tuple[str, ...] = get_args(State)


def display_name(target_name: str) -> str:
    """How a target is named to people and HTTP clients (``ps``, notes, ``/v1/models``): a
    registry name as it is, a GGUF file by its file name without ``.gguf``."""
    base = os.path.basename(target_name.rstrip("/")) or target_name
    return base[:-5] if base.lower().endswith(".gguf") else base


@dataclass(frozen=True)
class PairStatus:
    """One loaded (or loading) pair."""

    __pydantic_config__ = WIRE_CONFIG

    name: str  # display_name of the target
    target: str  # the target's file
    draft: str | None  # the draft's file (None: no draft model)
    draft_loaded: bool
    state: State
    queued: int  # calls waiting for it
    calls: int  # calls it served
    memory_bytes: int  # its weights and KV cache (an estimate)
    idle_seconds: float
    left_seconds: float | None  # until it is unloaded (None: busy, or kept for as long as the server runs)
    keep_alive_seconds: float | None
    last_call_seconds: float | None  # the last call, from its arrival to its end
    slots: int = 1  # calls that may generate on it at once (--parallel)
    generating: int = 0  # calls generating on it now

    def matches(self, model: str) -> bool:
        """Whether `model` (a registry name, a path, a file name or its stem) names its target or draft."""
        names = {self.name, self.target, self.draft}
        for path in (self.target, self.draft):
            if path:
                names |= {os.path.basename(path), display_name(path)}
        if model in names:
            return True
        candidate = os.path.abspath(os.path.expanduser(model))
        return os.path.exists(candidate) and os.path.realpath(candidate) in {os.path.realpath(p) for p in
                                                                              (self.target, self.draft) if p}


@dataclass(frozen=True)
class CoreStatus:
    """A process that keeps pairs loaded (a resident service, or a server)."""

    __pydantic_config__ = WIRE_CONFIG

    pid: int
    started: float  # epoch seconds
    memory_bytes: int  # the process's resident memory
    memory_peak_bytes: int
    pairs: tuple[PairStatus, ...]
    ending: str | None = None  # why it takes no new call (None: it does)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def process_memory() -> tuple[int, int]:
    """This process's resident memory and its peak, in bytes (0 where unknown: not Linux)."""
    values = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in values:
                    values[name] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return values["VmRSS"], values["VmHWM"]


# ---------------------------------------------------------------- what `localspec ps` shows


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit != "MB" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def rows(statuses: list[CoreStatus]) -> list[dict[str, Any]]:
    """A row per pair (``localspec ps --json``)."""
    return [{"model": p.name, "target": p.target, "draft": p.draft, "draft_loaded": p.draft_loaded, "state": p.state,
             "memory_bytes": p.memory_bytes, "idle_seconds": round(p.idle_seconds, 1),
             "left_seconds": None if p.left_seconds is None else round(p.left_seconds, 1),
             "keep_alive_seconds": p.keep_alive_seconds, "queued": p.queued, "calls": p.calls,
             "last_call_seconds": p.last_call_seconds, "slots": p.slots, "generating": p.generating, "pid": s.pid}
            for s in statuses for p in s.pairs]


def table(statuses: list[CoreStatus]) -> list[str]:
    """``localspec ps``'s table (also in ``localspec info``)."""
    return table_of_rows(rows(statuses))


def table_of_rows(found: list[dict[str, Any]]) -> list[str]:
    """The table of rows() (``localspec info`` keeps the rows in its JSON)."""
    from localspec.settings.environment import format_duration

    if not found:
        return ["no resident models (a call keeps its models loaded for --keep-alive, default 5m)"]
    drafts = [display_name(r["draft"]) + ("" if r["draft_loaded"] else " (not loaded)") if r["draft"] else "-"
              for r in found]
    wide, dwide = max(5, *(len(r["model"]) for r in found)), max(5, *(len(d) for d in drafts))
    lines = [f"{'MODEL':<{wide}}  {'DRAFT':<{dwide}}  {'MEMORY':>9} {'SLOTS':>5} {'QUEUE':>5} {'IDLE':>7} "
             f"{'LEFT':>7} {'CALLS':>5}  PID"]
    for r, draft in zip(found, drafts, strict=True):
        left = r["state"] if r["state"] != "idle" else "forever" if r["left_seconds"] is None else \
            format_duration(round(r["left_seconds"]))
        slots = f"{r.get('generating', 0)}/{r.get('slots', 1)}"
        lines.append(f"{r['model']:<{wide}}  {draft:<{dwide}}  {_size(r['memory_bytes']):>9} {slots:>5} "
                     f"{r['queued']:>5} {format_duration(round(r['idle_seconds'])):>7} {left:>7} {r['calls']:>5}  "
                     f"{r['pid']}")
    return lines
