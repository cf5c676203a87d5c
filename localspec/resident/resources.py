"""What a resident service keeps between calls: its pair of models (with the grammar tokenizer
each builds once), the prompt cache with recent prompts' KV states in memory, and the cost
profiles; and the key that says which calls it may serve.

The key is everything that decides which models a call loads and how: the model files (path,
size, modification time), the load options and the prompt-cache setting. The environment that
changes where a call reads and writes (cache, profile and prompt-cache directories), the
localspec and llama.cpp code are checked before (:meth:`Service._refusal`). A call with another
key is :class:`Declined` before it has read or written anything, and its client goes elsewhere.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localspec.cli.options import load_for, model_kwargs
from localspec.cli.resources import Resources
from localspec.config import GenerationConfig
from localspec.loading import Loaded, PairNames, draft_loading, draft_options, load_draft, pair_names
from localspec.resident import control
from localspec.resident.control import stop_service

if TYPE_CHECKING:
    from localspec.resident.streams import ClientStreams

PROMPT_MEMORY = 256 << 20  # bytes of recent prompts' KV states kept in memory, in front of the disk cache
MEMORY_MARGIN = 1.15  # a pair needs about its files' size, plus its context and compute buffers


class Declined(Exception):
    """The call is not this service's (other models or options): the client goes elsewhere."""


def file_identity(name: str) -> list[Any]:
    """A model file as a key sees it: its real path, size and modification time (a registry name
    by its cached file; not yet fetched: the name)."""
    from localspec.llama import registry

    path = Path(name).expanduser()
    if not path.is_file() and name in registry.load_registry().models:
        cached = registry.cached_path(name)
        if cached is None:
            return ["registry", name]
        path = cached
    try:
        st = path.stat()
    except OSError:
        return ["missing", name]
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def model_bytes(name: str) -> int:
    """A model's size on disk: its file's, or a registry model's before it is fetched."""
    from localspec.llama import registry

    identity = file_identity(name)
    if isinstance(identity[1], int):
        return identity[1]
    spec = registry.load_registry().models.get(name)
    return spec.size if spec is not None else 0


def _cache_place(setting: Any) -> str | None:
    """A --prompt-cache setting as a key holds it: off, or the absolute directory (None: the default)."""
    from localspec.environment import OFF

    if setting is None:
        return None
    text = str(setting)
    return "off" if text.strip().lower() in OFF or not text.strip() else str(Path(text).expanduser().absolute())


def available_memory() -> int:
    """MemAvailable in bytes (0 where it is not known)."""
    from localspec.llama.host import available_memory as available

    return available() or 0


class ServiceResources(Resources):
    """A service's models, prompt cache and profiles, lent to one call at a time."""

    resident = True

    def __init__(self, service: Any) -> None:
        """`service`: the localspec.resident.service.Service that lends them."""
        super().__init__()
        self.service = service
        self.loaded: Loaded | None = None  # the pair (its draft possibly lazy, or made when first needed)
        self.names: PairNames | None = None
        self.key: dict[str, Any] | None = None
        self._draft_options: dict[str, Any] = {}
        self._cache: Any = None
        self._cache_setting: Any = None
        self._profiles: Any = None
        self.call: Any = None  # the Call being run
        self.streams: ClientStreams | None = None

    # ------------------------------------------------------------ a call

    def begin(self, call: Any, streams: ClientStreams) -> None:
        self.call, self.streams = call, streams
        self.entered = float(call.request["started"])
        self._cache_setting = None

    def end(self) -> None:
        if self._profiles is not None:
            self._profiles.save()
        self.call = self.streams = None

    def release(self, loaded: Loaded) -> None:
        """The models stay loaded for the next call."""

    def keep_alive(self, seconds: float | None) -> None:
        if seconds is not None:
            self.service.keep_alive = seconds

    def prompt_cache(self, setting: Any, **cache_options: Any) -> Any:
        """The service's prompt cache (one per service: the setting is part of the key), with
        recent states in memory."""
        from localspec.llama.prompt_cache import PromptCache

        self._cache_setting = setting
        if self.key is None:
            self._cache = PromptCache.from_setting(setting, memory=PROMPT_MEMORY, **cache_options)
        return self._cache

    @property
    def profiles(self) -> Any:
        from localspec.decoding.profiles import Profiles

        if self._profiles is None:
            self._profiles = Profiles()
        return self._profiles

    def session_profiles(self) -> Any:
        return self.profiles

    def input(self, prompt: str) -> str:
        assert self.streams is not None
        return self.streams.input(prompt)

    def timings(self) -> dict[str, Any]:
        return {"service": time.time() - self.call.received} if self.call is not None else {}

    # ------------------------------------------------------------ models

    def load_for(self, config: GenerationConfig, model: str | None, draft: str | None, options: dict,
                 grammar: bool = False) -> Loaded:
        """The call's pair: this service's (declined when the call names others)."""
        if options.get("rpc") or options.get("draft_rpc"):
            raise Declined("RPC servers: the call runs in its own process")
        names = pair_names(model, draft)
        if self.key is None:
            return self._load_first(config, model, draft, options, grammar, names)
        if self._key(names, options) != self.key:
            raise Declined("other models or options")
        self._accept(started=False, target=names.target)
        return self._view(config)

    def _key(self, names: PairNames, options: dict) -> dict[str, Any]:
        return {"target": file_identity(names.target),
                "draft": file_identity(names.draft) if names.draft else None,
                "options": {k: v for k, v in sorted(model_kwargs(options).items()) if k not in ("rpc", "draft_rpc")},
                "prompt_cache": _cache_place(self._cache_setting)}

    def _load_first(self, config: GenerationConfig, model: str | None, draft: str | None, options: dict,
                    grammar: bool, names: PairNames) -> Loaded:
        need, lazy = draft_loading(config.drafter, draft_named=False)
        self._make_room(names, need and not lazy)
        self._accept(started=True, target=names.target)  # a fetch's progress shows as it happens
        self.service.write_record()  # a client arriving now finds the service, and waits for the load
        loaded = load_for(config, model, draft, options, grammar=grammar)
        self.loaded, self.names = loaded, names
        self._draft_options = draft_options({k: v for k, v in model_kwargs(options).items()
                                             if k not in ("draft_n_gpu_layers", "draft_rpc")},
                                            options.get("draft_n_gpu_layers"), None)
        self.key = self._key(names, options)  # after loading: a registry model is fetched now
        self.service.write_record()
        return loaded

    def _view(self, config: GenerationConfig) -> Loaded:
        """The pair as this call uses it: the draft as an in-process run would have it (none,
        loaded on first use, or loaded now)."""
        assert self.loaded is not None and self.names is not None
        need, lazy = draft_loading(config.drafter, draft_named=False)
        draft = None
        if need and self.names.draft:
            if self.loaded.draft is None:
                self.loaded.draft = load_draft(self.names, self._draft_options, lazy=True)
            draft = self.loaded.draft
            if not lazy and hasattr(draft, "get"):
                draft = draft.get()
        return Loaded(self.loaded.target, draft, self.loaded.target_name, (0.0, None))

    def _accept(self, started: bool, target: str) -> None:
        assert self.streams is not None
        self.streams.accept({"service": self.service.id, "started": started, "keep_alive": self.service.keep_alive,
                             "target": target})

    def _make_room(self, names: PairNames, with_draft: bool) -> None:
        """Before loading: when the pair does not fit the memory available, stop the idle services
        used least recently until it does (each said on stderr); when it still does not fit,
        Declined (the call runs in its own process, and says why)."""
        need = int(MEMORY_MARGIN * sum(model_bytes(n) for n in (names.target, names.draft if with_draft else None) if n))
        if not available_memory() or need <= available_memory():
            return
        idle = [(r, s) for r, s in control.services() if r.id != self.service.id and not s.get("busy")]
        idle.sort(key=lambda rs: -float(rs[1].get("idle") or 0))  # the longest idle first
        for record, state in idle:
            if need <= available_memory():
                return
            if stop_service(record, reason="memory for another pair"):
                sys.stderr.write(f"localspec: stopped the resident service of {control.model_name(state)} to make "
                                 "room for these models\n")
        if need > available_memory():
            raise Declined(f"not enough memory to keep another pair loaded ({need >> 20} MB needed, "
                           f"{available_memory() >> 20} MB available; `localspec stop` ends resident services)")

    # ------------------------------------------------------------ state

    def describe(self) -> dict[str, Any]:
        """What `localspec ps` shows of the pair."""
        if self.loaded is None:
            return {"target": None, "draft": None, "draft_loaded": False, "key": None}
        draft = self.loaded.draft
        return {"target": str(self.loaded.target.path), "target_name": self.loaded.target_name,
                "draft": str(draft.path) if draft is not None else (self.names.draft if self.names else None),
                "draft_loaded": draft is not None and getattr(draft, "loaded", True), "key": self.key}

    @property
    def has_models(self) -> bool:
        return self.loaded is not None

    def close(self) -> None:
        if self.loaded is not None:
            with contextlib.suppress(Exception):
                self.loaded.close()
            self.loaded = None

