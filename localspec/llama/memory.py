"""What a model or pair will take in memory once loaded, from the GGUF header alone (no load).

llama.cpp allocates four kinds of buffers for a model in a context, and logs each when it does:

* **weights** (``load_tensors: CPU model buffer size``, and ``CPU_REPACK`` for the weights its CPU
  kernels re-lay): every tensor's bytes, each padded to the buffer's 32-byte alignment. Repacking
  re-lays a tensor in as many bytes, and a tied output layer shares the token embeddings. With
  ``load_mode`` mmap or auto the whole tensor data is mapped (``CPU_Mapped``) and the repacked
  tensors are copies on top of it (src/llama-model-loader.cpp, load_all_data).
* **KV cache** (``llama_kv_cache: CPU KV buffer size``): for each layer, K and V rows of
  ``head_count_kv × key_length`` (``value_length``) values of the cache type (q8_0: 34 bytes per 32
  values) for every cell. A context of ``n_ctx`` cells is padded to a multiple of 256
  (llama_context's constructor: ``GGML_PAD(n_ctx, 256)``); localspec's unified cache holds
  ``ctx_size × parallel`` cells (ModelOptions.n_cells).
* **output** (``llama_context: CPU output buffer size``): one row of float logits over the
  vocabulary for each sequence (``output_reserve(n_seq_max)``; llama.cpp grows it on the first
  decode that asks for more rows, up to n_batch).
* **compute** (``sched_reserve: CPU compute buffer size``): the activations of the worst-case
  micro-batch, laid out by ggml's graph allocator: :mod:`localspec.llama.compute_buffer` replays it.

Each term follows llama.cpp's own rule; none is fitted (tests/test_memory.py compares them with
llama.cpp's logged sizes, and benchmarks/memory.py with the process's resident memory). What the
estimate leaves out: llama.cpp's own bookkeeping (the vocabulary, graph metadata: tens of MiB),
the CPU backend's per-thread work buffers, a GPU's placement of layers (the bytes are counted as
if every layer stayed on the CPU) and the AMX buffer type's own layouts; for sliding-window
models every layer's cache is counted at full size (an upper bound).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from localspec.errors import ModelError
from localspec.llama import backend, buffer_types, gguf_header
from localspec.llama.compute_buffer import ALIGNMENT, GraphShape, compute_bytes
from localspec.settings.models import ModelOptions, PairOptions

CELL_PADDING = 256  # llama_context: n_ctx = GGML_PAD(n_ctx, 256)
UBATCH_MAX = 512  # localspec's n_ubatch: min(batch_size, 512)
CACHE_BYTES = {"f32": (4, 1), "f16": (2, 1), "q8_0": (34, 32)}  # bytes per block, values per block
RECURRENT_KEYS = ("ssm", "wkv", "shortconv")  # metadata groups of state-space, RWKV and short-conv layers
TERMS = ("weights", "kv_cache", "compute", "output")
# llama.cpp's log lines of the other terms (the weights' are buffer_types.weight_buffers')
_LOGGED = {"kv_cache": re.compile(r"(\S+) KV buffer size =\s+([0-9.]+) MiB"),
           "compute": re.compile(r"(\S+) compute buffer size =\s+([0-9.]+) MiB"),
           "output": re.compile(r"(\S+)\s+output buffer size =\s+([0-9.]+) MiB")}


@dataclass(frozen=True)
class ModelMemory:
    """The bytes one model will take once loaded with its options: weights, KV cache, compute and
    output buffers (as llama.cpp reports them when it loads), and the context they are sized for."""

    path: str
    weights: int
    kv_cache: int
    compute: int
    output: int
    n_cells: int  # KV cells, after llama.cpp's padding
    n_sequences: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.output

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclass(frozen=True)
class MemoryEstimate:
    """What a target and its draft (None: no draft) will take once loaded."""

    target: ModelMemory
    draft: ModelMemory | None = None

    @property
    def models(self) -> tuple[ModelMemory, ...]:
        return (self.target,) if self.draft is None else (self.target, self.draft)

    @property
    def weights(self) -> int:
        return sum(m.weights for m in self.models)

    @property
    def kv_cache(self) -> int:
        return sum(m.kv_cache for m in self.models)

    @property
    def compute(self) -> int:
        return sum(m.compute for m in self.models)

    @property
    def output(self) -> int:
        return sum(m.output for m in self.models)

    @property
    def total(self) -> int:
        return sum(m.total for m in self.models)

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target.as_dict(), "draft": self.draft.as_dict() if self.draft else None,
                "total": self.total}


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs of a GGUF file: its graph's shape, its vocabulary and its tensors."""

    path: Path
    shape: GraphShape
    n_vocab: int  # tokens of the vocabulary (the output buffer's row)
    tensors: tuple[gguf_header.TensorInfo, ...]


# ---------------------------------------------------------------- the file's metadata


def _needed(path: Path, metadata: Mapping[str, object], key: str) -> object:
    if key not in metadata:
        raise ModelError(f"{path} has no {key!r} in its metadata, which a memory estimate needs: is it a "
                         "complete llama.cpp model file of a transformer?")
    return metadata[key]


def _per_layer(path: Path, value: object, key: str, n_layer: int) -> tuple[int, ...]:
    """A hyper-parameter as one value per layer (GGUF stores either one number or an array)."""
    values = value if isinstance(value, tuple) else (value,) * n_layer
    if len(values) != n_layer or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelError(f"{path}: {key} is {value!r}, not a count (or one per layer, {n_layer} layers)")
    return tuple(cast(int, v) for v in values)


def _count(path: Path, metadata: Mapping[str, object], key: str, default: object = None) -> int:
    """A positive whole number of the metadata (the largest, where it gives one per layer)."""
    value = metadata.get(key, default) if default is not None else _needed(path, metadata, key)
    value = max(value) if isinstance(value, tuple) and value else value
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelError(f"{path}: {key} is {value!r}; a memory estimate needs a positive whole number")
    return value


def model_path(model: str | os.PathLike) -> Path:
    """A GGUF path as it is; a registry model's name: its file, fetched first if it is not cached
    (as load_model fetches it: the header is in the file)."""
    from localspec.llama import registry

    path = Path(model).expanduser()
    if path.exists() or str(model) not in registry.load_registry().models:
        return path
    return registry.resolve(str(model))


def read_facts(path: str | os.PathLike) -> ModelFacts:
    """The facts of the GGUF file at `path` (or a fetched registry model's); a ModelError naming the
    file when it is missing, not a GGUF file, cut short, or without the metadata of a transformer's
    attention."""
    from localspec.llama.model import check_gguf_file

    path = model_path(path)
    check_gguf_file(path)
    backend.init()  # llama.cpp's reader logs through localspec's log callback
    found = gguf_header.header(str(path))
    if found is None:
        raise ModelError(f"llama.cpp cannot read the header of {path}: it is damaged or cut short (an "
                         "interrupted download? fetch or copy it again)")
    metadata = found.metadata
    arch = _needed(path, metadata, "general.architecture")
    if any(key.startswith(f"{arch}.{group}.") for key in metadata for group in RECURRENT_KEYS):
        raise ModelError(f"{path.name} is a recurrent/hybrid model ({arch}); its state cannot roll back rejected "
                         "draft tokens, so localspec does not load it and does not estimate it")
    return ModelFacts(path, _graph_shape(path, metadata, str(arch), found.tensors),
                      _vocabulary(path, metadata, str(arch)), tuple(found.tensors))


def _graph_shape(path: Path, metadata: Mapping[str, object], arch: str,
                 tensors: Sequence[gguf_header.TensorInfo]) -> GraphShape:
    n_layer = _count(path, metadata, f"{arch}.block_count")
    n_embd = _count(path, metadata, f"{arch}.embedding_length")
    n_head = _count(path, metadata, f"{arch}.attention.head_count")
    kv_key = f"{arch}.attention.head_count_kv"
    n_head_kv = _per_layer(path, metadata.get(kv_key, n_head), kv_key, n_layer)
    ff_key = f"{arch}.feed_forward_length"
    n_ff = _per_layer(path, _needed(path, metadata, ff_key), ff_key, n_layer)
    head_k = _count(path, metadata, f"{arch}.attention.key_length", max(n_embd // n_head, 1))
    head_v = _count(path, metadata, f"{arch}.attention.value_length", max(n_embd // n_head, 1))
    by_name = {t.name: t for t in tensors}
    output = by_name.get("output.weight") or by_name.get("token_embd.weight")
    if output is None:
        raise ModelError(f"{path} has neither an output.weight nor a token_embd.weight tensor: not a language "
                         "model llama.cpp can decode with")
    biases = frozenset(p for p, name in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output"))
                       if f"blk.0.{name}.bias" in by_name)
    return GraphShape(n_layer, n_embd, n_head, n_head_kv, head_k, head_v, n_ff, output.rows, biases)


def _vocabulary(path: Path, metadata: Mapping[str, object], arch: str) -> int:
    """The vocabulary's size: llama.cpp's n_tokens, the tokenizer's token list (or vocab_size)."""
    tokens = metadata.get("tokenizer.ggml.tokens", metadata.get(f"{arch}.vocab_size"))
    if not isinstance(tokens, int) or tokens <= 0:
        raise ModelError(f"{path} has no tokenizer.ggml.tokens in its metadata: a model without a vocabulary "
                         "cannot be loaded")
    return tokens


# ---------------------------------------------------------------- the terms


def cells(options: ModelOptions) -> int:
    """KV cells of the context localspec creates (n_ctx = ModelOptions.n_cells), padded as llama.cpp does."""
    return -(-options.n_cells // CELL_PADDING) * CELL_PADDING


def micro_batch(options: ModelOptions) -> int:
    """n_ubatch as llama.cpp keeps it: n_batch is capped at the requested n_ctx, n_ubatch at n_batch."""
    return min(options.n_cells, options.batch_size, UBATCH_MAX)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def repacked(facts: ModelFacts, options: ModelOptions) -> list[gguf_header.TensorInfo]:
    """The weights llama.cpp's CPU_REPACK buffer takes on this CPU under options.cpu_kernels (none
    for 'plain', or where this build has no CPU_REPACK)."""
    if options.cpu_kernels == "plain" or buffer_types.REPACK_BUFFER not in buffer_types.extra_buffer_types():
        return []
    weights = [buffer_types.Weight(t.name, t.type.upper(), t.dims, t.rows) for t in facts.tensors]
    names = {w.name for w in buffer_types.repackable(buffer_types.on_cpu(weights, _gpu_layers(options)),
                                                       buffer_types.cpu_features())}
    return [t for t in facts.tensors if t.name in names]


def _gpu_layers(options: ModelOptions) -> int:
    """Layers that go to another device (as Model._gpu_layers: none on a CPU-only build without RPC)."""
    import llama_cpp

    layers = -1 if options.rpc and options.n_gpu_layers == 0 else options.n_gpu_layers
    layers = layers if layers >= 0 else 999
    return layers if options.rpc or llama_cpp.llama_supports_gpu_offload() else 0


def weight_bytes(facts: ModelFacts, options: ModelOptions) -> int:
    """The weights' buffers: read, every tensor once; mapped (mmap, auto), the tensor data's span of
    the file plus a copy of each repacked tensor."""
    if options.load_mode == "read":
        return sum(_padded(t.nbytes) for t in facts.tensors)
    span = max(t.offset + t.nbytes for t in facts.tensors) - min(t.offset for t in facts.tensors)
    return span + sum(_padded(t.nbytes) for t in repacked(facts, options))


def kv_bytes(facts: ModelFacts, options: ModelOptions) -> int:
    """K and V rows of every layer for every cell, in the cache type (llama-kv-cache.cpp: one
    ggml_row_size of n_embd_k_gqa, n_embd_v_gqa per cell and layer)."""
    s, (block_bytes, block) = facts.shape, CACHE_BYTES[options.cache_type]
    if block > 1 and (s.head_dim_k % block or s.head_dim_v % block):
        raise ModelError(f"cache_type {options.cache_type} stores values in blocks of {block}, which do not divide "
                         f"{facts.path.name}'s attention heads ({s.head_dim_k} key and {s.head_dim_v} value "
                         "dimensions): llama.cpp cannot create its context; use --cache-type f16")
    per_cell = sum(h * (s.head_dim_k + s.head_dim_v) for h in s.n_head_kv) // block * block_bytes
    return cells(options) * per_cell


def output_bytes(facts: ModelFacts, options: ModelOptions) -> int:
    """One float logit row over the vocabulary per sequence (llama_context::output_reserve)."""
    return facts.n_vocab * options.n_sequences * 4


def estimate_model(path: str | os.PathLike, options: ModelOptions | None = None,
                   facts: ModelFacts | None = None) -> ModelMemory:
    """What the model at `path` will take loaded with `options` (default ModelOptions())."""
    options = options or ModelOptions()
    facts = facts or read_facts(path)
    compute = compute_bytes(facts.shape, cells(options), micro_batch(options), options.n_sequences,
                            options.flash_attn != "off", options.cache_type)
    return ModelMemory(str(facts.path), weight_bytes(facts, options), kv_bytes(facts, options), compute,
                       output_bytes(facts, options), cells(options), options.n_sequences)


def estimate_memory(target: str | os.PathLike | None = None, draft: str | os.PathLike | None = None, *,
                    options: ModelOptions | PairOptions | None = None, ctx_size: int | None = None,
                    parallel: int | None = None, cache_type: str | None = None, batch_size: int | None = None,
                    n_seq_max: int | None = None, flash_attn: str | None = None, load_mode: str | None = None,
                    cpu_kernels: str | None = None) -> MemoryEstimate:
    """The bytes a target and its draft (GGUF paths or registry models' names, fetched if they are not
    cached; None: the default pair) will take once loaded: weights, KV cache, compute and output buffers of each,
    from the files' headers alone (a fraction of a second; no model is loaded). The keywords
    are ``load_model``'s (None: the default), applied over `options` (a ModelOptions for both
    models, or a PairOptions); ConfigError for a bad value, ModelError naming a file that cannot be
    estimated.

        estimate = estimate_memory(target_path, draft_path, ctx_size=8192, parallel=2)
        print(estimate.total / 2**20, "MiB")
    """
    if target is None:
        from localspec.llama import registry

        default = registry.load_registry()
        target, draft = default.pairs[default.default_pair].target, default.pairs[default.default_pair].draft
    pair = options if isinstance(options, PairOptions) else PairOptions(options or ModelOptions(),
                                                                        options or ModelOptions())
    keywords = (("ctx_size", ctx_size), ("parallel", parallel), ("cache_type", cache_type), ("batch_size", batch_size),
                ("n_seq_max", n_seq_max), ("flash_attn", flash_attn), ("load_mode", load_mode),
                ("cpu_kernels", cpu_kernels))
    given: dict[str, Any] = {k: v for k, v in keywords if v is not None}
    pair = PairOptions(dataclasses.replace(pair.target, **given), dataclasses.replace(pair.draft, **given))
    return MemoryEstimate(estimate_model(target, pair.target),
                          estimate_model(draft, pair.draft) if draft is not None else None)


def one_slot(options: ModelOptions) -> ModelOptions:
    """The options of a single slot that holds every cell and sequence of `options`: llama.cpp's
    context is the same (n_ctx = n_cells, n_seq_max = n_sequences), however a loader maps slots to
    it. The measurements of the estimate (tests, benchmarks/memory.py) load with these."""
    return dataclasses.replace(options, ctx_size=options.n_cells, n_seq_max=options.n_sequences, parallel=1)


def reported_mib(lines: Sequence[str]) -> dict[str, float]:
    """The MiB llama.cpp logs for each term (TERMS) as it loads a model and creates its context,
    from its log lines (backend.capture_log around the load): what the estimate is measured against.
    Each is rounded to 0.01 MiB, as llama.cpp prints it."""
    text = "".join(lines)
    out = {"weights": sum(buffer_types.weight_buffers(lines).values())}
    for term, pattern in _LOGGED.items():
        out[term] = sum(float(m.group(2)) for m in pattern.finditer(text))
    return out
