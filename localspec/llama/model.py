"""A GGUF model in a llama.cpp context, through llama-cpp-python's low-level API.

One :class:`Model` owns a model, a context of several slots (each a
:class:`~localspec.llama.sequence.KVSequence` with sequence ids of its own, in one unified KV
cache) and a reusable batch. It decodes batches whose tokens may belong to several sequences
(token trees share a prefix through ``seq_id`` sets), several slots' parts in one decode, exposes
the output logits as a zero-copy view, edits the KV cache per sequence and saves and restores a
sequence's state. Its vocabulary side (tokenizing, pieces, the chat
template) is ``localspec.llama.vocab``; the CPU kernels its weights load with are chosen by
``localspec.llama.kernels``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np

from localspec.errors import Cancelled, ContextFull, ModelError, RemoteError
from localspec.llama import backend, buffer_types, host, kernels, progress as progress_, rpc
from localspec.llama.batch import AbortFlag, Batch
from localspec.llama.logits import LogitsPointer
from localspec.llama.sequence import KVSequence, Part
from localspec.llama.vocab import Vocabulary
from localspec.settings.models import ModelOptions

log = logging.getLogger(__name__)

CACHE_TYPES = {"f32": lc.GGML_TYPE_F32, "f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0}
FLASH_ATTN = {"auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}
LOAD_MODES = {"auto": lc.LLAMA_LOAD_MODE_AUTO, "mmap": lc.LLAMA_LOAD_MODE_MMAP,
              "read": lc.LLAMA_LOAD_MODE_NONE}  # read: copy the weights into memory (no mapped duplicates)


def check_gguf_file(path: Path) -> None:
    """A ModelError unless `path` is a readable regular file that starts as a GGUF file does."""
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelError(f"cannot read model file {path}: {exc.strerror}") from exc
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (it starts with {magic!r}); "
                         "localspec loads llama.cpp GGUF models")


class Model(Vocabulary):
    """A loaded GGUF model with its context. Use as a context manager or call close(). `progress`:
    called with the fraction loaded, 0 to 1; returning False stops the load (see llama.progress)."""

    _batch: Batch | None = None  # its reusable batch (None: a vocabulary only, or closed)

    def __init__(self, path: str | os.PathLike, options: ModelOptions | None = None,
                 progress: progress_.Callback | progress_.Span | None = None) -> None:
        self._unloaded(path, options)
        self._progress = progress_.span_of(progress) or progress_.watched(self.path.name)
        started = time.perf_counter()
        try:
            self._load_model()
            self._check_rollback()
            self._create_context()
            self._alloc_batch()
            progress_.reach(self._progress, 1.0, f"the load of {self.path.name}")
        except BaseException:  # an error, or the caller's stop: nothing of the load is kept
            self.close()
            raise
        finally:
            self._progress = None  # the callback is the caller's: not kept with the model
        self.load_seconds: float | None = time.perf_counter() - started  # weights and context

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def vocabulary(cls, path: str | os.PathLike) -> Model:
        """Only the vocabulary of a GGUF file (no weights, no context): enough to check a pair."""
        self = cls.__new__(cls)
        self._unloaded(path, None)
        self._load_model(vocab_only=True)
        return self

    def _unloaded(self, path: str | os.PathLike, options: ModelOptions | None) -> None:
        """The state before llama.cpp loads anything: the file checked, llama.cpp's process set up."""
        self.path = Path(path).expanduser()
        self.options = options or ModelOptions()
        check_gguf_file(self.path)
        backend.init()
        self._model = self._ctx = self._batch = None
        self._identity: dict | None = None
        self._pieces: dict[int, bytes] = {}
        self.sequences = [KVSequence(self)]  # what each slot of the KV cache holds: its one owner
        self.n_slots = 1  # calls that may generate at once (the context's slots; set when it is made)
        self.decodes = 0  # decodes run: output rows are those of the last one
        self.scheduler: Any = None  # the step loop of the calls generating on it (localspec.decoding.scheduler)
        self.drafting_for: Any = None  # the target whose step loop decodes it as a draft (localspec.generation)
        self.checked_drafts: dict[str, str] = {}  # pairing's verdicts: draft key -> "ok" or why not
        # llguidance's tokenizer of this vocabulary, once started (decoding.grammar.tokenizer.start_tokenizer:
        # a TokenizerFuture, with the grammars already followed over it)
        self.grammar_tokenizer: Any = None
        self.load_seconds = None
        self.weight_buffers: dict[str, float] = {}
        self._progress = None  # while loading: where its progress goes (a progress_.Span)

    def _load_model(self, vocab_only: bool = False) -> None:
        """Load the weights (or only the vocabulary). A CPU kernel configuration checked for the
        first time on this machine is checked in a child process while the weights load; should
        the check fail, the model is loaded again with the next configuration."""
        self.kernels: kernels.KernelChoice | None = None
        if vocab_only:
            self._model = self._load_weights(None, vocab_only=True)
        else:
            self._model, self.kernels = kernels.load_checked(self.path, self.options.cpu_kernels, self._gpu_layers(),
                                                             self._load_weights, lc.llama_model_free)
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))

    def _n_gpu_layers(self) -> int:
        """llama_model_params.n_gpu_layers: with --rpc, every layer remote unless told otherwise."""
        o = self.options
        layers = -1 if o.rpc and o.n_gpu_layers == 0 else o.n_gpu_layers
        return layers if layers >= 0 else 999

    def _gpu_layers(self) -> int:
        """Layers that really go to another device (none on a CPU-only build without --rpc)."""
        return self._n_gpu_layers() if self.options.rpc or lc.llama_supports_gpu_offload() else 0

    def _load_weights(self, choice: kernels.KernelChoice | None, vocab_only: bool = False) -> Any:
        o = self.options
        params = lc.llama_model_default_params()
        params.vocab_only = vocab_only
        keep_alive = choice.apply(params) if choice is not None else None
        params.n_gpu_layers = self._n_gpu_layers()
        params.load_mode = LOAD_MODES[o.load_mode]
        devices = None  # NULL: every registered device
        if o.rpc:
            devices = rpc.device_array(rpc.devices(o.rpc))
        elif rpc.in_use():  # RPC servers are registered here: keep this model on this machine's devices
            devices = rpc.device_array(rpc.local_devices())
        if devices is not None:
            params.devices = ctypes.addressof(devices)
        if vocab_only:  # no weights to report (and no waiting on a load of weights in another thread)
            model, lines = lc.llama_model_load_from_file(os.fsencode(self.path), params), []
        else:
            with backend.capture_log() as lines:
                model = progress_.load_weights(self._progress, params, lambda: lc.llama_model_load_from_file(
                    os.fsencode(self.path), params), f"the load of {self.path.name}")
        del keep_alive  # llama.cpp reads the overrides during the load only
        self.weight_buffers = buffer_types.weight_buffers(lines)
        if not model:
            raise ModelError(f"llama.cpp could not load {self.path} (unsupported architecture, "
                             "truncated download, or not enough memory); set LOCALSPEC_LLAMA_LOG=1 "
                             "and logging to DEBUG for llama.cpp's own messages")
        return model

    def _check_rollback(self) -> None:
        if lc.llama_model_is_recurrent(self._model) or lc.llama_model_is_hybrid(self._model):
            raise ModelError(f"{self.path.name} is a recurrent/hybrid model ({self.architecture}); its "
                             "state cannot roll back rejected draft tokens, so it cannot be used for "
                             "speculative decoding")

    def kv_bytes(self, n_ctx: int) -> int:
        """An estimate of the KV cache of n_ctx cells (K and V of every layer, this cache type)."""
        n_head = max(int(lc.llama_model_n_head(self._model)), 1)
        head_dim = int(lc.llama_model_n_embd(self._model)) // n_head
        per_value = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}[self.options.cache_type]
        per_cell = 2 * int(lc.llama_model_n_layer(self._model)) * int(lc.llama_model_n_head_kv(self._model)) * head_dim
        return int(n_ctx * per_cell * per_value)

    def _slots_that_fit(self) -> int:
        """The slots whose KV cache fits in this machine's memory: `parallel` as asked (refused
        before llama.cpp allocates it when it does not fit: a huge --ctx-size would otherwise take
        gigabytes and then fail, or swap), or by default as many of DEFAULT_PARALLEL as fit."""
        o = self.options
        available = host.available_memory()
        if available is None or self._gpu_layers():  # unknown, or the cache lives on other devices
            return o.slots
        per_slot = self.kv_bytes(o.ctx_size)
        fitting = int(available // max(per_slot, 1))
        slots = o.slots if o.parallel is not None else max(1, min(o.slots, fitting))
        if slots < o.slots:
            log.info("%s: %d slots of %d tokens fit in the memory available (not %d)", self.path.name, slots,
                     o.ctx_size, o.slots)
        need = per_slot * slots
        if need > available:
            fits = max(16, int(o.ctx_size * available / need) // 256 * 256)
            each = f" in each of {slots} slots" if slots > 1 else ""
            raise ModelError(f"ctx_size={o.ctx_size}{each} needs ~{need / 2**30:.1f} GiB of KV cache for "
                             f"{self.path.name}, and this machine has {available / 2**30:.1f} GiB available; use "
                             f"--ctx-size {fits} or less (or --cache-type q8_0{', or fewer --parallel' if each else ''})")
        return slots

    def _create_context(self) -> None:
        o = self.options
        self.n_slots = self._slots_that_fit()
        params = lc.llama_context_default_params()
        params.n_ctx = o.ctx_size * self.n_slots  # each slot's calls hold at most ctx_size tokens
        params.n_batch = o.batch_size
        params.n_ubatch = min(o.batch_size, 512)
        params.n_seq_max = o.n_seq_max * self.n_slots
        params.n_threads = params.n_threads_batch = o.threads or os.cpu_count() or 1
        params.flash_attn_type = FLASH_ATTN[o.flash_attn]
        params.type_k = params.type_v = CACHE_TYPES[o.cache_type]
        # one cache for every slot: a token may belong to several sequences (trees), which per-slot
        # streams (kv_unified = false) cannot hold
        params.kv_unified = True
        params.no_perf = True
        ctx = lc.llama_init_from_model(self._model, params)
        if not ctx:
            hint = ("; a quantized KV cache also needs head sizes that its blocks divide: try --cache-type f16"
                    if o.cache_type == "q8_0" else "")
            raise ModelError(f"llama.cpp could not create a context for {self.path.name} with "
                             f"ctx_size={o.ctx_size} × {self.n_slots} slots, cache_type={o.cache_type}: not enough "
                             f"memory? Try a smaller --ctx-size or --parallel{hint}")
        self._ctx = ctx
        self._mem = lc.llama_get_memory(ctx)
        self.n_ctx = int(lc.llama_n_ctx(ctx)) // self.n_slots  # one call's context: a slot's share of the cells
        # llama.cpp caps n_batch at the requested n_ctx (before it pads n_ctx): the real limit
        self.n_batch = int(lc.llama_n_batch(ctx))

    def _alloc_batch(self) -> None:
        self._batch = Batch(self.n_batch, self.options.n_seq_max * self.n_slots)
        span = self.options.n_seq_max
        self.sequences = [KVSequence(self, base=i * span, span=span, slot=i) for i in range(self.n_slots)]
        self._abort = AbortFlag()
        if not self.options.rpc:  # a remote decode is bounded by rpc.DecodeWatch instead
            self._abort.install(self._ctx)

    def close(self) -> None:
        """Free the batch, context and model (idempotent)."""
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.close()
        if self._batch is not None:  # (the class's None where the load stopped before _unloaded)
            self._batch.free()
            self._batch = None
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lc.llama_model_free(self._model)
            self._model = None
            self._vocab = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    # ------------------------------------------------------------------ metadata

    @property
    def identity(self) -> dict:
        """What this model's speed depends on (the key of its cost profile)."""
        if self._identity is None:
            self._identity = host.identity(self.path, self.options)
        return self._identity

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size

    @property
    def loaded(self) -> bool:
        return True

    def meta(self, key: str) -> str | None:
        self._live()
        buf = ctypes.create_string_buffer(4096)
        n = lc.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    @property
    def architecture(self) -> str:
        return self.meta("general.architecture") or "unknown"

    @property
    def name(self) -> str:
        return self.meta("general.name") or self.path.stem

    @property
    def n_params(self) -> int:
        self._live()
        return int(lc.llama_model_n_params(self._model))

    @property
    def size_bytes(self) -> int:
        self._live()
        return int(lc.llama_model_size(self._model))

    # ------------------------------------------------------------------ decoding

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               seq_ids: Sequence[Sequence[int]] | None = None, outputs: str = "all") -> int:
        """Decode one batch. seq_ids[i]: the sequences token i belongs to (default: sequence 0).
        outputs: "all" (logits for every token) or "last". Returns the number of output rows."""
        ids = [(0,)] * len(tokens) if seq_ids is None else seq_ids
        return self.decode_parts([Part(tokens, positions, ids, outputs)])

    def decode_parts(self, parts: Sequence[Part]) -> int:
        """Decode the parts (several slots' tokens) in one llama_decode; each part's first output
        row is set (Part.first_row); the number of output rows. Cancelled when the abort flag
        was set during it (llama.cpp removed what it had put in the cache of its last batch:
        the callers drop the rest, localspec.llama.sequence.KVSequence.abandon)."""
        self._live()
        assert self._batch is not None  # only a vocabulary-only model (Model.vocabulary) has none: never decoded
        n = self._batch.fill(parts, self.path.name)
        if n == 0:
            return 0
        self.decodes += 1
        if self.options.rpc:  # the whole computation, not only its submission, within a time limit
            with rpc.DecodeWatch(self.options.rpc):
                rc = lc.llama_decode(self._ctx, self._batch.raw)
                lc.llama_synchronize(self._ctx)
        else:
            rc = lc.llama_decode(self._ctx, self._batch.raw)
        if rc == 1:
            raise ContextFull(f"the context is full: no KV slot for {n} more tokens "
                             f"(ctx_size={self.n_ctx} per slot); use a larger --ctx-size")
        if rc == 2 and self._abort.is_set:
            raise Cancelled("the decode was stopped")
        if rc != 0 and self.options.rpc:
            raise RemoteError(f"llama_decode failed with code {rc} on the RPC server(s) {', '.join(self.options.rpc)}")
        if rc != 0:
            raise ModelError(f"llama_decode failed with code {rc}")
        return sum(p.n_outputs for p in parts)

    def stop_decoding(self) -> None:
        """Stop the decode running now, from any thread (decode_parts raises Cancelled), and every later one."""
        self._abort.set()

    def resume_decoding(self) -> None:
        self._abort.clear()

    def prefill(self, tokens: Sequence[int], start: int, seq_ids: Sequence[int] = (0,)) -> None:
        """Decode a long run of tokens (e.g. the prompt) in n_batch chunks at positions
        start, start+1, ...; the last token's logits are kept as output row 0."""
        step = self.n_batch
        for lo in range(0, len(tokens), step):
            chunk = tokens[lo: lo + step]
            self.decode(chunk, range(start + lo, start + lo + len(chunk)), [tuple(seq_ids)] * len(chunk),
                        outputs="last")

    def logits(self, n_rows: int, first: int = 0) -> LogitsPointer:
        """The last decode's output rows first .. first + n_rows - 1, zero-copy (valid until the
        next decode)."""
        self._live()
        ptr = lc.llama_get_logits(self._ctx)
        return LogitsPointer(ctypes.addressof(ptr.contents) + 4 * first * self.n_vocab, n_rows, self.n_vocab)

    def logits_array(self, n_rows: int, first: int = 0) -> np.ndarray:
        """The same rows as a numpy view (no copy; valid until the next decode)."""
        self._live()
        ptr = lc.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(first + n_rows, self.n_vocab))[first:]

    # ------------------------------------------------------------------ KV cache

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Drop positions [p0, p1) of sequence seq (-1: open end; seq -1: every sequence)."""
        self._live()
        if not lc.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise ModelError("this model's cache cannot remove a partial sequence")

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._live()
        lc.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        self._live()  # the largest position sequence `seq` holds in the cache (-1: none)
        return int(lc.llama_memory_seq_pos_max(self._mem, seq))

    def clear_memory(self) -> None:
        """Empty the KV cache (KVSequence.clear keeps its record true; use Model.clear)."""
        self._live()
        lc.llama_memory_clear(self._mem, True)

    # ------------------------------------------------------------------ saved state

    @property
    def state_options(self) -> dict:
        """What a saved sequence state of this model depends on besides its tokens: the file, the
        KV cache's type, attention and stream layout, the batch shape its prefill used, the CPU
        kernels and llama.cpp's build (localspec.llama.prompt_cache keys entries by it)."""
        ident = self.identity
        keep = ("file", "size", "mtime_ns", "n_gpu_layers", "cache_type", "flash_attn", "cpu_kernels",
                "batch_size", "rpc", "llama_cpp", "build", "cpu")
        return {**{k: ident.get(k) for k in keep}, "n_seq_max": self.options.n_seq_max, "kv_unified": True}

    @property
    def state_refusal(self) -> str | None:
        """Why this model's KV state cannot be saved and trimmed safely (None: it can)."""
        self._live()
        if lc.llama_model_n_swa(self._model) > 0:
            return f"{self.path.name} uses sliding-window attention: a restored state cannot be trimmed"
        if lc.llama_model_is_recurrent(self._model) or lc.llama_model_is_hybrid(self._model):
            return f"{self.path.name} is recurrent: its state cannot be trimmed to a prefix"
        return None

    def seq_state(self, seq: int = 0) -> bytes:
        """llama.cpp's state of sequence `seq` (its KV cells), as bytes."""
        self._live()
        size = lc.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data(self._ctx, buf, size, seq)
        if written != size:
            raise ModelError(f"llama.cpp wrote {written} of {size} bytes of {self.path.name}'s sequence state")
        return bytes(buf)

    def set_seq_state(self, data: bytes, seq: int = 0) -> bool:
        """Load a state from seq_state into sequence `seq` (which must be empty); False: llama.cpp
        refused it."""
        self._live()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return lc.llama_state_seq_set_data(self._ctx, buf, len(data), seq) > 0

    @property
    def cpu_threads(self) -> int | None:
        """The threads its decodes run on this machine's CPU (None: its layers are elsewhere)."""
        return None if self._gpu_layers() else (self.options.threads or os.cpu_count() or 1)

    @property
    def sequence(self) -> KVSequence:
        """The first slot's sequence (a program generating one call at a time uses only it)."""
        return self.sequences[0]

    def clear(self) -> None:
        """Empty the KV cache, every slot's sequence and the states its idle slots parked."""
        if self.scheduler is not None:
            self.scheduler.parked.clear()
        self.clear_memory()
        for seq in self.sequences:
            seq.clear()
