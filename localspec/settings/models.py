"""How a model loads and sizes its context (:class:`ModelOptions`), and how a pair does
(:class:`PairOptions`: the target's and the draft's, from the CLI's load flags). A leaf: the
standard library, the shared checks and the RPC addresses' parser."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from localspec.settings.endpoints import parse_endpoints
from localspec.settings.validation import INT32_MAX, WIRE_CONFIG, as_int, choice, is_int, require, show, unknown_names

CACHE_TYPES: tuple[str, ...] = ("f16", "f32", "q8_0")
FLASH_ATTN: tuple[str, ...] = ("auto", "on", "off")
LOAD_MODES: tuple[str, ...] = ("read", "mmap", "auto")
CPU_KERNELS: tuple[str, ...] = ("auto", "llama", "repack", "plain")  # see localspec.llama.kernels
MAX_THREADS = 1024
DEFAULT_PARALLEL = 4  # slots per loaded pair (LOCALSPEC_NUM_PARALLEL, --parallel): llama-server's and ollama's default
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: every slot's sequences together

@dataclass(frozen=True)
class ModelOptions:
    """How to load a model and size its context (keyword names of ``localspec.load_model``)."""

    __pydantic_config__ = WIRE_CONFIG  # a resident service validates requests with pydantic

    ctx_size: int = 4096  # context length in tokens of one call (a slot): the KV cache holds parallel × ctx_size cells
    batch_size: int = 512  # most tokens one decode may take
    threads: int | None = None  # CPU threads (default: all cores)
    n_gpu_layers: int = 0  # layers offloaded to the GPU (-1: all)
    flash_attn: str = "auto"
    cache_type: str = "f16"  # KV cache type
    n_seq_max: int = 16  # sequences (tree branches) one call's step may use
    # calls generating at once on the loaded model (slots), as llama-server's -np; None: DEFAULT_PARALLEL, or
    # fewer where batch_size cannot hold every slot's sequences (the model may hold fewer where memory is short)
    parallel: int | None = None
    load_mode: str = "read"  # read: copy the weights into memory (no mapped duplicate); mmap; auto
    rpc: tuple[str, ...] = ()  # RPC servers ("host:port") that take the model's layers
    cpu_kernels: str = "auto"  # which llama.cpp weight buffer types (AMX, CPU_REPACK) to use: see localspec.llama.kernels

    def __post_init__(self) -> None:
        for name in ("ctx_size", "batch_size", "threads", "n_gpu_layers", "n_seq_max", "parallel"):
            object.__setattr__(self, name, as_int(getattr(self, name)))
        object.__setattr__(self, "rpc", parse_endpoints(self.rpc))
        require(is_int(self.ctx_size) and self.ctx_size >= 16, "ctx_size",
                f"ctx_size must be at least 16 tokens, got {show(self.ctx_size)}")
        require(self.ctx_size <= INT32_MAX, "ctx_size", f"ctx_size must be at most {INT32_MAX}, got {show(self.ctx_size)}")
        require(is_int(self.batch_size) and self.batch_size >= 1, "batch_size",
                f"batch_size must be a positive integer, got {show(self.batch_size)}")
        require(self.batch_size <= INT32_MAX, "batch_size", f"batch_size must be at most {INT32_MAX}")
        require(self.threads is None or (is_int(self.threads) and 1 <= self.threads <= MAX_THREADS), "threads",
                f"threads must be an integer in [1, {MAX_THREADS}], got {show(self.threads)}")
        require(is_int(self.n_gpu_layers) and -1 <= self.n_gpu_layers <= INT32_MAX, "n_gpu_layers",
                f"n_gpu_layers must be an integer in [-1, {INT32_MAX}] (-1: all), got {show(self.n_gpu_layers)}")
        choice(self.flash_attn, "flash_attn", FLASH_ATTN)
        choice(self.cache_type, "cache_type", CACHE_TYPES)
        choice(self.load_mode, "load_mode", LOAD_MODES)
        choice(self.cpu_kernels, "cpu_kernels", CPU_KERNELS)
        require(not (self.cache_type == "q8_0" and self.flash_attn == "off"), "cache_type",
                "cache_type q8_0 (a quantized KV cache) needs flash attention: use flash_attn 'auto' or 'on', "
                "or cache_type f16")
        require(is_int(self.n_seq_max) and 1 <= self.n_seq_max <= MAX_SEQUENCES, "n_seq_max",
                f"n_seq_max must lie in [1, {MAX_SEQUENCES}], got {show(self.n_seq_max)}")
        require(self.parallel is None or (is_int(self.parallel) and 1 <= self.parallel <= MAX_SEQUENCES // self.n_seq_max),
                "parallel", f"parallel must lie in [1, {MAX_SEQUENCES // self.n_seq_max}] (llama.cpp holds "
                f"{MAX_SEQUENCES} sequences, n_seq_max = {self.n_seq_max} per slot), got {show(self.parallel)}")
        require(self.n_cells <= INT32_MAX, "ctx_size", f"ctx_size × parallel must be at most {INT32_MAX}")
        # llama.cpp reserves an output row per sequence in one decode and aborts the process when a
        # batch (n_batch, capped at ctx_size) is smaller than n_seq_max: refused here instead
        require(self.batch_size >= self.n_sequences, "batch_size",
                f"batch_size must be at least n_seq_max × parallel = {self.n_sequences} (one decode holds a row "
                f"for every sequence), got {self.batch_size}: raise batch_size or lower n_seq_max or parallel")
        require(self.ctx_size >= self.n_seq_max, "ctx_size",
                f"ctx_size must be at least n_seq_max = {self.n_seq_max}, got {self.ctx_size}: raise ctx_size or "
                "lower n_seq_max")

    @property
    def slots(self) -> int:
        """Calls that may generate at once: `parallel`, or by default DEFAULT_PARALLEL where
        batch_size holds every slot's sequences (else as many as it holds, at least one)."""
        if self.parallel is not None:
            return self.parallel
        return max(1, min(DEFAULT_PARALLEL, self.batch_size // self.n_seq_max, MAX_SEQUENCES // self.n_seq_max))

    @property
    def n_sequences(self) -> int:
        """llama.cpp sequences of the context: n_seq_max for each slot."""
        return self.n_seq_max * self.slots

    @property
    def n_cells(self) -> int:
        """KV cells of the context: ctx_size for each slot."""
        return self.ctx_size * self.slots

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ModelOptions:
        """Options from keywords; unknown names are a ConfigError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        require(not unknown, unknown[0] if unknown else "", unknown_names(unknown, sorted(known), "model option(s)"))
        return cls(**{k: v for k, v in options.items() if v is not None or k == "threads"})


MODEL_DEFAULTS = ModelOptions()
LOAD_FLAGS: tuple[str, ...] = ("ctx_size", "parallel", "n_gpu_layers", "draft_n_gpu_layers", "threads", "cache_type", "load_mode",
                               "cpu_kernels", "rpc", "draft_rpc")  # the CLI's flags that say how a pair loads


@dataclass(frozen=True)
class PairOptions:
    """How a target and its draft load: one ModelOptions each. The draft's are the target's, on
    this machine unless ``draft_rpc`` names servers for it, with its own GPU layers when
    ``draft_n_gpu_layers`` is given (:meth:`from_flags`)."""

    __pydantic_config__ = WIRE_CONFIG

    target: ModelOptions = MODEL_DEFAULTS
    draft: ModelOptions = MODEL_DEFAULTS

    def __post_init__(self) -> None:
        require(isinstance(self.target, ModelOptions) and isinstance(self.draft, ModelOptions), "options",
                "a pair's options are two ModelOptions (the target's and the draft's)")

    @classmethod
    def from_flags(cls, options: Mapping[str, Any]) -> PairOptions:
        """The options of the load keywords (LOAD_FLAGS and ModelOptions' names; None: the
        default): ConfigError naming a bad one."""
        own = {k: v for k, v in options.items() if k not in ("draft_n_gpu_layers", "draft_rpc")}
        target = ModelOptions.from_options(own)
        draft = replace(target, rpc=parse_endpoints(options.get("draft_rpc")))
        if options.get("draft_n_gpu_layers") is not None:
            draft = replace(draft, n_gpu_layers=options["draft_n_gpu_layers"])
        return cls(target, draft)

    @property
    def remote(self) -> bool:
        """Whether either model puts layers on RPC servers."""
        return bool(self.target.rpc or self.draft.rpc)
