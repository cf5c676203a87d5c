"""A model loaded on first use: a draft the planner may never need (:class:`LazyModel`)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from localspec.llama.host import identity
from localspec.llama.model import Model, check_gguf_file
from localspec.settings.models import ModelOptions

log = logging.getLogger(__name__)


class LazyModel:
    """A model loaded on first use (a draft the planner may never need). The planner records its
    load time (`load_seconds`) in its cost profile."""

    def __init__(self, path: str | os.PathLike, options: ModelOptions | None = None, paired: bool = False) -> None:
        self.path = Path(path).expanduser()
        self.options = options or ModelOptions()
        self.paired = paired  # a registry pair: its vocabulary is known to match the target's
        check_gguf_file(self.path)
        self.identity = identity(self.path, self.options)
        self._model: Model | None = None
        self.load_seconds: float | None = None  # set when it is loaded
        self.drafting_for: Any = None  # the target whose step loop decodes it (localspec.generation)

    @classmethod
    def of(cls, model: Model, paired: bool = False) -> LazyModel:
        """A model loaded already, kept as one that loads on first use is (an app's own draft)."""
        lazy = cls(model.path, model.options, paired)
        lazy._model = model
        return lazy

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size

    @property
    def name(self) -> str:
        return self._model.name if self._model is not None else self.path.stem

    def get(self) -> Model:
        if self._model is None:
            t0 = time.perf_counter()
            self._model = Model(self.path, self.options)
            self.load_seconds = time.perf_counter() - t0
            log.info("loaded the draft %s in %.2f s", self.path.name, self.load_seconds)
        return self._model

    def close(self) -> None:
        if self._model is not None:
            self._model.close()
            self._model = None
