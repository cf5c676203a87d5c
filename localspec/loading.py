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
    from localspec.llama.progress import Callback, Span


def load_model(model: str | Path, *, progress: Callback | None = None, **options: Any) -> Model:
    """Load a GGUF file, or a registry model by name (fetched and cached on first use).
    Options: ctx_size, batch_size, threads, n_gpu_layers, flash_attn, cache_type, n_seq_max,
    load_mode, cpu_kernels, rpc (see localspec.settings.models.ModelOptions).

    `progress`: called with the fraction done, rising from 0 to 1 (a registry model's download, by
    bytes, then llama.cpp's load of the weights, then the context); returning False stops the load
    with localspec.errors.Cancelled, everything it took freed. A callback that raises stops it too
    (localspec.errors.CallbackError, naming its exception)."""
    from localspec.llama import registry
    from localspec.llama.model import Model

    model_options = ModelOptions.from_options(options)
    fetch, load = _spans(progress, [str(model)], [str(model)])
    return Model(registry.resolve(str(model), fetch[0]), model_options, load[0])


def _spans(callback: Callback | None, fetched: list[str],
           loaded: list[str]) -> tuple[list[Span | None], list[Span | None]]:
    """One progress from 0 to 1 for a load: the downloads of `fetched` (registry models not cached
    yet), then the loads of `loaded`, each part in proportion to its bytes (0.0 reported now, so a
    callback that says stop at once stops before anything is fetched or loaded). No callback: no spans."""
    from localspec.llama import progress, registry

    if callback is None:
        return [None] * len(fetched), [None] * len(loaded)
    sizes = {name: registry.sizes(name) for name in {*fetched, *loaded}}
    whole = progress.Progress(callback).whole()
    progress.reach(whole, 0.0, "the load of " + ", ".join(Path(n).name for n in loaded))
    parts: list[Span | None] = list(whole.split([sizes[n][1] for n in fetched] + [sizes[n][0] for n in loaded]))
    return parts[:len(fetched)], parts[len(fetched):]


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


def load_target(path: str | Path, options: ModelOptions, grammar: bool = False,
                progress: Span | None = None) -> Model:
    """A target from its file; `grammar`: a constrained generation follows, so the grammar's
    tokenizer is built from the file's vocabulary while the weights load; `progress`: where its
    load reports."""
    from localspec.llama.model import Model

    if not grammar:
        return Model(path, options, progress)
    from localspec.decoding.grammar.tokenizer import adopt_tokenizer, prestart_tokenizer

    early = prestart_tokenizer(path)
    target = Model(path, options, progress)
    adopt_tokenizer(target, early)
    return target


def load_draft(names: PairNames, options: ModelOptions, lazy: bool, path: Path | None = None,
               progress: Span | None = None) -> Any:
    """The draft model of `names` (fetched if needed, unless its `path` is known): a Model, or a
    LazyModel loaded on first use; `progress`: where a load now reports."""
    from localspec.llama import registry
    from localspec.llama.lazy import LazyModel
    from localspec.llama.model import Model

    assert names.draft is not None
    path = path or registry.resolve(names.draft)
    return LazyModel(path, options, names.paired) if lazy else Model(path, options, progress)


def load_pair(model: str | None, draft: str | None, options: PairOptions = PairOptions(), *,
              need_draft: bool = True, lazy_draft: bool = False, grammar: bool = False,
              progress: Callback | None = None) -> Loaded:
    """Load the target and the draft -m/-d name, as `options` say. lazy_draft: the draft is
    fetched if needed but loaded only when the planner wants it. grammar: a constrained
    generation follows; the target's grammar tokenizer is built from its vocabulary while its
    weights load. `progress`: one fraction from 0 to 1 over both fetches and both loads (see
    load_model), each part by its bytes."""
    from localspec.llama import registry

    names = pair_names(model, draft)
    drafts = [names.draft] if names.draft and need_draft else []
    fetch, load = _spans(progress, [names.target, *drafts], [names.target, *(drafts if not lazy_draft else [])])
    target_path = registry.resolve(names.target, fetch[0])
    draft_path = registry.resolve(drafts[0], fetch[1]) if drafts else None
    t0 = time.perf_counter()
    target = load_target(target_path, options.target, grammar, load[0])
    t1 = time.perf_counter()
    try:
        dm = load_draft(names, options.draft, lazy_draft, draft_path, load[1] if len(load) > 1 else None) \
            if drafts else None
    except BaseException:
        target.close()
        raise
    return Loaded(target, dm, names.target, (t1 - t0, None if dm is None or lazy_draft else time.perf_counter() - t1))
