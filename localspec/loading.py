"""Loading a target and its draft: the one place that names them, resolves registry names, and
decides whether and when the draft model loads (the CLI's commands, the server and
``localspec.api.default_pair`` all load through it).

A leaf of the surfaces: it imports the models lazily, so ``localspec --help`` stays fast.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localspec.config import ModelOptions

if TYPE_CHECKING:
    from localspec.llama.model import Model


def load_model(model: str | Path, **options: Any) -> Model:
    """Load a GGUF file, or a registry model by name (fetched and cached on first use).
    Options: ctx_size, batch_size, threads, n_gpu_layers, flash_attn, cache_type, n_seq_max,
    load_mode, cpu_kernels, rpc (see localspec.config.ModelOptions)."""
    from localspec.llama import registry
    from localspec.llama.model import Model

    model_options = ModelOptions.from_options(options)
    return Model(registry.resolve(str(model)), model_options)


def draft_loading(drafter: str, draft_named: bool) -> tuple[bool, bool]:
    """The one rule for the draft model: (load one at all, load it lazily). The n-gram drafter
    needs none, unless one is named where later requests may ask for another drafter (the
    server); auto and ngram load it only when the planner (or a request) wants it; model and
    hybrid need it at once."""
    need = drafter != "ngram" or draft_named
    return need, drafter in ("auto", "ngram")


@dataclass
class Loaded:
    """A loaded target and its draft (a Model, a LazyModel the planner may load, or None)."""

    target: Any  # Model
    draft: Any  # Model | LazyModel | None
    target_name: str
    load_seconds: tuple[float, float | None] = (0.0, None)  # target, draft (None: not loaded)

    def close(self) -> None:
        self.target.close()
        if self.draft is not None:
            self.draft.close()


def is_none(value: str | None) -> bool:
    """-d none (or an empty value): no draft model."""
    return value is not None and value.lower() in ("none", "")


def load_pair(model: str | None, draft: str | None, *, draft_n_gpu_layers: int | None = None,
              draft_rpc: str | None = None, need_draft: bool = True, lazy_draft: bool = False,
              grammar: bool = False, **options: Any) -> Loaded:
    """Load the target and the draft the options name (options: those of localspec.load_model).
    lazy_draft: the draft is fetched if needed but loaded only when the planner wants it.
    grammar: a constrained generation follows; the target's grammar tokenizer is built from its
    vocabulary while its weights load."""
    from localspec.llama import registry
    from localspec.decoding.pairing import LazyModel

    ModelOptions.from_options(options)  # bad options are reported before anything loads
    reg = registry.load_registry()
    pair = reg.pairs[reg.default_pair]
    target_name = model or pair.target
    draft_name = None if (is_none(draft) or not need_draft) else (draft or (None if model else pair.draft))
    t0 = time.perf_counter()
    if grammar:
        from localspec.decoding.constraint import prestart_tokenizer

        prestart_tokenizer(registry.resolve(target_name))
    target = load_model(target_name, **options)
    t1 = time.perf_counter()
    try:
        dm = None
        if draft_name:
            draft_options = dict(options, rpc=draft_rpc)
            if draft_n_gpu_layers is not None:
                draft_options["n_gpu_layers"] = draft_n_gpu_layers
            paired = draft_name == pair.draft and target_name == pair.target  # the registry vouches for it
            dm = (LazyModel(registry.resolve(draft_name), ModelOptions.from_options(draft_options), paired)
                  if lazy_draft else load_model(draft_name, **draft_options))
    except BaseException:
        target.close()
        raise
    return Loaded(target, dm, target_name, (t1 - t0, None if dm is None or lazy_draft else time.perf_counter() - t1))


