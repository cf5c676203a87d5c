"""Python API: load models, then stream or generate text with speculative decoding.

    from localspec import load_model, default_pair, stream_generate, generate

    target, draft = default_pair()                 # fetches the Qwen2.5-Coder pair on first use
    for r in stream_generate(target, draft, "def fib(n):", max_tokens=64):
        print(r.text, end="", flush=True)
    print(r.stats.block_efficiency, r.stats.tokens_per_second)

``draft=None`` decodes with the target alone through the same code path (the baseline).
Keyword names equal the CLI flags.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence, Union

from localspec.drafters import (Drafter, HybridDrafter, ModelDrafter, NGramDrafter,
                                SamplingSettings)
from localspec.engine import ConfigError, Engine, GenerationStats, SpecConfig
from localspec.model import Model, ModelError, ModelOptions, check_pair

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int], Sequence[dict]]
DRAFTERS = ("model", "ngram", "hybrid")


@dataclass(frozen=True)
class Response:
    """One generated token: its text (may be empty mid-character), id, and running stats."""

    text: str
    token: int | None
    finish_reason: str | None  # None while generating; "stop" (EOS or a stop string) or "length"
    stats: GenerationStats


def load_model(model: str | Path, *, ctx_size: int = 4096, n_gpu_layers: int = 0,
               threads: int | None = None, flash_attn: str = "auto", cache_type: str = "f16",
               batch_size: int = 512, n_seq_max: int = 16, load_mode: str = "read") -> Model:
    """Load a GGUF file, or a registry model by name (fetched and cached on first use)."""
    from localspec import registry

    path = registry.resolve(str(model))
    return Model(path, ModelOptions(n_ctx=ctx_size, n_batch=batch_size, n_threads=threads,
                                    n_gpu_layers=n_gpu_layers, flash_attn=flash_attn,
                                    cache_type=cache_type, n_seq_max=n_seq_max, load_mode=load_mode))


def default_pair(*, draft_n_gpu_layers: int | None = None, **options) -> tuple[Model, Model]:
    """The default (target, draft) pair of the registry, fetched if needed. Options as for
    load_model; draft_n_gpu_layers defaults to n_gpu_layers."""
    from localspec import registry

    reg = registry.load_registry()
    pair = reg.pairs[reg.default_pair]
    target = load_model(pair.target, **options)
    draft_options = dict(options)
    if draft_n_gpu_layers is not None:
        draft_options["n_gpu_layers"] = draft_n_gpu_layers
    try:
        draft = load_model(pair.draft, **draft_options)
    except Exception:
        target.close()
        raise
    return target, draft


def target_alone_without_draft(settings: dict, has_draft: bool) -> dict:
    """Speculative settings as they apply: the model drafter with no draft model loaded decodes
    with the target alone (no draft tokens, no tree)."""
    if not has_draft and settings.get("drafter", "model") == "model":
        return {**settings, "num_draft_tokens": 0, "tree": None}
    return settings


def make_drafter(target: Model, draft: Model | None, drafter: str, spec: SpecConfig) -> Drafter | None:
    """The drafter named by `drafter` for this pair (None: no speculation)."""
    if drafter not in DRAFTERS:
        raise ConfigError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
    shape = spec.shape()
    if spec.num_draft_tokens == 0 and not spec.tree:
        return None
    max_nodes = max(shape.n_nodes, 1)
    if drafter == "ngram":
        return NGramDrafter(target.n_vocab, max_nodes)
    if draft is None:
        if drafter == "hybrid":
            raise ConfigError("the hybrid drafter needs a draft model (-d/--draft); use --drafter ngram without one")
        return None
    check_pair(target, draft)
    model_drafter = ModelDrafter(draft, target.n_vocab, max_nodes)
    if drafter == "hybrid":
        return HybridDrafter(model_drafter, NGramDrafter(target.n_vocab, max_nodes))
    return model_drafter


def prompt_tokens(target: Model, prompt: Prompt) -> list[int]:
    """A prompt (text, chat messages or token ids) as the token ids generation starts from."""
    if isinstance(prompt, str):
        return target.tokenize(prompt, add_special=True, parse_special=False)
    items = list(prompt)
    if items and all(isinstance(m, dict) for m in items):
        text = target.apply_chat_template(items, add_generation_prompt=True)
        return target.tokenize(text, add_special=not text.startswith(_bos_text(target)), parse_special=True)
    if all(isinstance(t, int) and 0 <= t < target.n_vocab for t in items):
        return list(items)
    raise ModelError("prompt must be a string, a list of chat messages ({'role', 'content'}) "
                     f"or a list of token ids in [0, {target.n_vocab})")


def _bos_text(model: Model) -> str:
    return model.token_text(model.bos).decode("utf-8", "replace") if model.add_bos else "\0"


class _StopFilter:
    """Holds back text that could be the start of a stop string; cuts at the first stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        self.held += text
        if not self.stops:
            out, self.held = self.held, ""
            return out
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.held = self.held[: min(hits)], ""
            return out
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def stream_generate(target: Model, draft: Model | None, prompt: Prompt, *, max_tokens: int = 256,
                    temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                    seed: int | None = None, verifier: str = "block", num_draft_tokens: int = 4,
                    paths: int = 1, tree: Sequence[int] | None = None, drafter: str = "model",
                    lenience: float = 0.0, stop: Sequence[str] = (), plan: str = "auto") -> Iterator[Response]:
    """Yield one Response per generated token; the last one carries the finish reason.

    plan="auto" (default) drafts at most num_draft_tokens levels and picks each step's depth, or
    no speculation at all, from measured step costs and acceptance (localspec.planner);
    plan="fixed" always drafts the full shape."""
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    spec = SpecConfig(verifier=verifier, num_draft_tokens=num_draft_tokens, paths=paths,
                      tree=tuple(tree) if tree else None, lenience=lenience, plan=plan)
    spec.validate(drafter, target.n_batch)
    sampling = SamplingSettings(temperature, top_k, top_p, min_p)
    engine = Engine(target, make_drafter(target, draft, drafter, spec), spec, sampling, seed)
    engine.start(prompt_tokens(target, prompt))
    detok = target.detokenizer()
    stops = _StopFilter(stop)
    try:
        yield from _run(engine, target, detok, stops, max_tokens)
    except GeneratorExit:  # the caller stopped between steps: the caches are consistent
        engine.finish()
        raise


def _run(engine: Engine, target: Model, detok, stops: _StopFilter, max_tokens: int) -> Iterator[Response]:
    generated = 0
    while True:
        if engine.room() < 0:
            yield Response(stops.flush() + detok.flush(), None, "length", engine.counters.snapshot())
            break
        new = engine.step(max_tokens - generated - 1)
        finish = None
        for tok in new:
            generated += 1
            engine.counters.generated = generated
            if target.is_eog(tok):
                finish = "stop"
            text = "" if finish else stops.push(detok.add(tok))
            if stops.stopped:
                finish = "stop"
            elif finish is None and generated >= max_tokens:
                finish = "length"
            if finish and not stops.stopped:
                text += stops.flush() + detok.flush()
            yield Response(text, tok, finish, engine.counters.snapshot())
            if finish:
                break
        if finish:
            break
    engine.finish()


def generate(target: Model, draft: Model | None, prompt: Prompt, **kwargs) -> str:
    """The whole completion as a string (see stream_generate for the keywords)."""
    return "".join(r.text for r in stream_generate(target, draft, prompt, **kwargs))
