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

from localspec.settings.models import ModelOptions, PairOptions

if TYPE_CHECKING:
    from localspec.llama.model import Model


def load_model(model: str | Path, **options: Any) -> Model:
    """Load a GGUF file, or a registry model by name (fetched and cached on first use).
    Options: ctx_size, batch_size, threads, n_gpu_layers, flash_attn, cache_type, n_seq_max,
    load_mode, cpu_kernels, rpc (see localspec.settings.models.ModelOptions)."""
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


@dataclass(frozen=True)
class PairNames:
    """The target and draft a command names, with the registry's default pair filled in."""

    target: str
    draft: str | None  # None: no draft model
    paired: bool  # the registry's own pair (its vocabularies are known to match)


def pair_names(model: str | None, draft: str | None) -> PairNames:
    """The models -m/-d name: the default pair's when -m is not given; -d none: no draft."""
    from localspec.llama import registry

    reg = registry.load_registry()
    pair = reg.pairs[reg.default_pair]
    target = model or pair.target
    draft_name = None if is_none(draft) else (draft or (None if model else pair.draft))
    return PairNames(target, draft_name, draft_name == pair.draft and target == pair.target)


def load_target(path: str | Path, options: ModelOptions, grammar: bool = False) -> Model:
    """A target from its file; `grammar`: a constrained generation follows, so the grammar's
    tokenizer is built from the file's vocabulary while the weights load."""
    from localspec.llama.model import Model

    if not grammar:
        return Model(path, options)
    from localspec.decoding.grammar.tokenizer import adopt_tokenizer, prestart_tokenizer

    early = prestart_tokenizer(path)
    target = Model(path, options)
    adopt_tokenizer(target, early)
    return target


def load_draft(names: PairNames, options: ModelOptions, lazy: bool) -> Any:
    """The draft model of `names` (fetched if needed): a Model, or a LazyModel loaded on first use."""
    from localspec.llama import registry
    from localspec.llama.lazy import LazyModel
    from localspec.llama.model import Model

    assert names.draft is not None
    path = registry.resolve(names.draft)
    return LazyModel(path, options, names.paired) if lazy else Model(path, options)


def load_pair(model: str | None, draft: str | None, options: PairOptions = PairOptions(), *,
              need_draft: bool = True, lazy_draft: bool = False, grammar: bool = False) -> Loaded:
    """Load the target and the draft -m/-d name, as `options` say. lazy_draft: the draft is
    fetched if needed but loaded only when the planner wants it. grammar: a constrained
    generation follows; the target's grammar tokenizer is built from its vocabulary while its
    weights load."""
    from localspec.llama import registry

    names = pair_names(model, draft)
    t0 = time.perf_counter()
    target = load_target(registry.resolve(names.target), options.target, grammar)
    t1 = time.perf_counter()
    try:
        dm = load_draft(names, options.draft, lazy_draft) if names.draft and need_draft else None
    except BaseException:
        target.close()
        raise
    return Loaded(target, dm, names.target, (t1 - t0, None if dm is None or lazy_draft else time.perf_counter() - t1))
