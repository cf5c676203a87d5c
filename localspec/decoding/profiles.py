"""Per-machine cost profiles: what steps cost and how often drafts are accepted, kept between runs.

A profile belongs to one model as it runs on this machine: keyed by everything that changes its
speed (the model file, threads, GPU layers, KV cache type, flash attention, load mode, CPU kernels,
batch size, the llama.cpp build and the device). It holds

* ``costs``: seconds per decode of n tokens with logits for all of them (what a verification
  pass costs), learned from real steps;
* ``prefill``: seconds per token of a prompt prefill (a long batch: the cheapest per token);
* ``load``: seconds to load the model;
* ``acceptance``: for a target, per kind of draft and per draft level, decaying counts of the
  draft tokens put at risk at that level and of those rejected there (``[at_risk, rejected]``:
  the planner's prior for the next run).

The first run learns them from its own work (the prompt's prefill, every step); later runs start
from them and keep refining. Files live in ``<cache root>/profiles`` (see
``localspec.llama.registry.cache_root``); ``localspec profiles`` shows and resets them. They are
read and written through :class:`localspec.settings.files.StateDir`: never through a symbolic link, and a
reset deletes only the profiles localspec wrote.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from localspec.errors import ConfigError
from localspec.llama.host import key_of
from localspec.settings.files import STATE_LIMIT, Foreign, StateDir
from localspec.settings.locations import profile_dir

log = logging.getLogger(__name__)

VERSION = 2
MAX_WEIGHT = 100.0  # acceptance counts kept per level between runs (so a profile keeps adapting)
class Profiled(Protocol):
    """A model as the cost model sees it (loaded or not)."""

    @property
    def identity(self) -> dict[str, Any]: ...  # read-only: a Model computes it on first use

    @property
    def file_bytes(self) -> int: ...


MAX_PASS = 1 << 20  # the largest pass size a profile may record a cost for
MAX_LEVELS = 1024  # acceptance levels per kind of draft


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where!r} must be a finite number, got {value!r:.40}")
    return float(value)


def _seconds(value: Any, where: str) -> float | None:
    """A measured time; None where nothing was measured (null, or 0 as older versions wrote)."""
    if value is None:
        return None
    seconds = _number(value, where)
    if seconds < 0:
        raise ValueError(f"{where!r} must be a number of seconds >= 0, got {value!r:.40}")
    return seconds or None


def _pass_size(key: Any) -> int:
    if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 7 and 1 <= int(key) <= MAX_PASS):
        raise ValueError(f"'costs' keys must be pass sizes in [1, {MAX_PASS}], got {key!r:.40}")
    return int(key)


def _mapping(data: dict, name: str) -> dict:
    value = data.get(name, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name!r} must be an object, got {type(value).__name__}")
    return value


def _counts(value: Any, where: str) -> list[list[float]]:
    """[at_risk, rejected]: two lists of equal length of finite counts >= 0, rejected <= at_risk."""
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, list) for v in value)
            and len(value[0]) == len(value[1]) <= MAX_LEVELS):
        raise ValueError(f"{where!r} must be two lists of equal length (at most {MAX_LEVELS}) of counts")
    at_risk = [_number(x, where) for x in value[0]]
    rejected = [_number(x, where) for x in value[1]]
    if any(x < 0 for x in at_risk + rejected) or any(r > a * (1 + 1e-9) + 1e-9 for a, r in zip(at_risk, rejected, strict=True)):
        raise ValueError(f"{where!r} must hold counts >= 0, rejected at most at risk")
    return [at_risk, rejected]


@dataclass
class Profile:
    key: str
    identity: dict[str, Any]
    costs: dict[int, float] = field(default_factory=dict)
    prefill: float | None = None
    load: float | None = None
    acceptance: dict[str, list[list[float]]] = field(default_factory=dict)  # kind: [at_risk, rejected] per level
    updated: float = 0.0
    dirty: bool = False

    def to_json(self) -> dict:
        return {"version": VERSION, "key": self.key, "identity": self.identity,
                "costs": {str(n): s for n, s in sorted(self.costs.items())}, "prefill": self.prefill,
                "load": self.load, "acceptance": self.acceptance, "updated": self.updated}

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        """A profile from its JSON; ValueError saying which field has the wrong shape or value
        (a file edited by hand, or written by another program, is never trusted)."""
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"profile version {data.get('version') if isinstance(data, dict) else data!r}")
        if not isinstance(data.get("identity"), dict) or not isinstance(data.get("key"), str):
            raise ValueError("a profile needs a 'key' string and an 'identity' object")
        if not isinstance(data["identity"].get("file", ""), str):
            raise ValueError("'identity.file' must be a string")
        costs = _mapping(data, "costs")
        acceptance = _mapping(data, "acceptance")
        return cls(key=data["key"], identity=dict(data["identity"]),
                   costs={_pass_size(n): c for n, c in ((n, _seconds(s, f"costs.{n}")) for n, s in costs.items()) if c},
                   prefill=_seconds(data.get("prefill"), "prefill"),
                   load=_seconds(data.get("load"), "load"),
                   acceptance={str(k): _counts(v, f"acceptance.{k}") for k, v in acceptance.items()},
                   updated=_number(data.get("updated", 0.0), "updated"))

    @property
    def name(self) -> str:
        return Path(self.identity.get("file", "?")).name

    def cap_acceptance(self) -> None:
        """Scale each kind's counts down to at most MAX_WEIGHT per level (so a profile keeps adapting)."""
        for at_risk, rejected in self.acceptance.values():
            scale = min(1.0, MAX_WEIGHT / max(at_risk + [1.0]))
            at_risk[:] = [x * scale for x in at_risk]
            rejected[:] = [x * scale for x in rejected]

    def levels(self, kind: str, levels: int) -> list[list[float]]:
        """The per-level [at_risk, rejected] counts of a kind of draft (created empty)."""
        pair = self.acceptance.setdefault(kind, [[0.0] * levels, [0.0] * levels])
        for counts in pair:
            counts.extend([0.0] * (levels - len(counts)))
        return pair


class Profiles:
    """Cost profiles, read from `directory` on first use and written back by :meth:`save`
    (default directory: :func:`profile_dir`)."""

    def __init__(self, directory: Path | None = None, *, persistent: bool = True) -> None:
        self.directory = directory or profile_dir()
        self.persistent = persistent  # False: nothing is read or written
        self._loaded: dict[str, Profile] = {}
        self.io_seconds = 0.0  # spent reading and writing profiles (reported by `localspec --json`)
        self._refused = False  # the directory was refused (said once)
        self._lock = threading.RLock()  # calls on several pairs share one (a resident service's)

    @property
    def lock(self) -> threading.RLock:
        """Held while profiles are read, written back or saved: the generations on a pair learn
        into them in its step loop while another thread saves them."""
        return self._lock

    @classmethod
    def in_memory(cls) -> Profiles:
        """Profiles that start empty and are never saved (a first run, every time)."""
        return cls(persistent=False)

    def get(self, ident: dict[str, Any]) -> Profile:
        key = key_of(ident)
        with self._lock:
            profile = self._loaded.get(key)
            if profile is None:
                profile = self._read(key) or Profile(key, ident)
                self._loaded[key] = profile
            return profile

    def _store(self, create: bool) -> StateDir | None:
        """The profile directory, opened (None: absent, or refused: said once)."""
        try:
            return StateDir.open(self.directory, what="the profile directory", create=create, private=False)
        except FileNotFoundError:
            return None
        except ConfigError as exc:
            if not self._refused:
                self._refused = True
                log.warning("cost profiles are neither read nor saved: %s", exc)
            return None

    def _read(self, key: str) -> Profile | None:
        if not self.persistent:
            return None
        t0 = time.perf_counter()
        try:
            store = self._store(create=False)
            if store is None:
                return None
            with store:
                return self._parse(store, f"{key}.json")
        finally:
            self.io_seconds += time.perf_counter() - t0

    def _parse(self, store: StateDir, name: str) -> Profile | None:
        path = store.path / name
        try:
            data = json.loads(store.read(name, STATE_LIMIT).decode("utf-8"))
            if isinstance(data, dict) and data.get("version") != VERSION:
                log.info("the cost profile %s is from another localspec version: measured again", path)
                return None
            return Profile.from_json(data)
        except FileNotFoundError:
            return None
        except Foreign as exc:
            log.warning("ignoring %s: %s (localspec reads only the profiles it wrote)", path, exc)
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:  # any shape a file may have
            log.warning("ignoring the unreadable cost profile %s (%s); it will be measured again", path, exc)
            return None

    def save(self) -> None:
        """Write every changed profile (atomically; a failure is logged, never raised)."""
        if not self.persistent:
            return
        t0 = time.perf_counter()
        with self._lock:
            self._write_changed()
        self.io_seconds += time.perf_counter() - t0

    def _write_changed(self) -> None:
        changed = [p for p in self._loaded.values() if p.dirty]
        store = self._store(create=True) if changed else None
        if store is None:
            return
        with store:
            for profile in changed:
                profile.cap_acceptance()
                profile.updated = time.time()
                try:
                    store.write(f"{profile.key}.json", json.dumps(profile.to_json(), indent=1).encode("utf-8"))
                    profile.dirty = False
                except Foreign as exc:
                    log.warning("cannot save the cost profile %s: that name is %s, which localspec did not write "
                                "(left as it is)", store.path / f"{profile.key}.json", exc)
                except OSError as exc:
                    log.warning("cannot save the cost profile in %s: %s", self.directory, exc)

    def _names(self, store: StateDir) -> list[str]:
        return [n for n in store.names() if n.endswith(".json") and not n.startswith(".")]

    def on_disk(self) -> list[Profile]:
        """Every readable profile in the directory, newest first."""
        store = self._store(create=False) if self.persistent else None
        if store is None:
            return []
        with store:
            found = [self._parse(store, name) for name in self._names(store)]
        return sorted((p for p in found if p is not None), key=lambda p: -p.updated)

    def reset(self) -> int:
        """Delete the profiles localspec wrote (on disk and in this process): regular files of this
        user named <key>.json that hold a profile of that key (any version); any other file stays.
        How many files were removed."""
        removed = 0
        store = self._store(create=False) if self.persistent else None
        if store is not None:
            with store:
                for name in self._names(store):
                    try:
                        data = json.loads(store.read(name, STATE_LIMIT).decode("utf-8"))
                        if isinstance(data, dict) and data.get("key") == name[:-5] and isinstance(data.get("identity"), dict):
                            store.unlink(name)
                            removed += 1
                    except (Foreign, OSError, ValueError, RecursionError):
                        continue  # not a profile localspec wrote: left alone
        self._loaded.clear()
        return removed

    def one_token_seconds(self, model: Profiled) -> float:
        """A model's measured cost of decoding one token (0: not measured yet)."""
        return self.get(model.identity).costs.get(1, 0.0)
