"""A model's reusable llama.cpp batch, filled from the parts of one decode
(localspec.llama.sequence.Part: each slot's tokens, positions, sequence ids and outputs), and the
flag that stops a decode half-way (llama.cpp's abort callback).

A decode's output rows follow its tokens' order, so a part's rows are contiguous: its
``first_row`` is the number of output rows of the parts before it.

The abort flag is an int32 that llama.cpp's compute threads read between graph nodes through
``ls_abort_requested`` (native/verify.c): a C function, so checking it takes no Python lock and
costs a decode nothing; whoever wants a running decode stopped sets it from any thread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import llama_cpp as lc
import numpy as np

from localspec.errors import ModelError
from localspec.llama.sequence import Part


class Batch:
    """llama_batch of `capacity` tokens, each in at most `n_seq_max` sequences."""

    def __init__(self, capacity: int, n_seq_max: int) -> None:
        self.capacity, self.n_seq_max = capacity, n_seq_max
        self.raw = lc.llama_batch_init(capacity, 0, n_seq_max)
        b = self.raw
        self._token = np.ctypeslib.as_array(b.token, shape=(capacity,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(capacity,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(capacity,))
        self._logits = np.ctypeslib.as_array(b.logits, shape=(capacity,))
        self._seq = [np.ctypeslib.as_array(b.seq_id[i], shape=(n_seq_max,)) for i in range(capacity)]

    def fill(self, parts: Sequence[Part], where: str) -> int:
        """Put the parts' tokens in the batch, each part's first output row set; the tokens.
        ModelError (naming `where`) when they exceed the batch or name too many sequences."""
        n = sum(len(p.tokens) for p in parts)
        if n > self.capacity:
            raise ModelError(f"{n} tokens in one batch exceed n_batch={self.capacity} ({where})")
        i = row = 0
        for part in parts:
            k = len(part.tokens)
            if len(part.positions) != k or len(part.seq_ids) != k:
                raise ModelError(f"a part of {k} tokens has {len(part.positions)} positions and "
                                 f"{len(part.seq_ids)} sequence sets ({where})")
            self._token[i: i + k] = part.tokens
            self._pos[i: i + k] = part.positions
            for j, ids in enumerate(part.seq_ids):
                if not 0 < len(ids) <= self.n_seq_max:
                    raise ModelError(f"a token in {len(ids)} sequences; the context holds {self.n_seq_max} ({where})")
                self._nseq[i + j] = len(ids)
                self._seq[i + j][: len(ids)] = ids
            self._logits[i: i + k] = 1 if part.outputs == "all" else 0
            if part.outputs == "last" and k:
                self._logits[i + k - 1] = 1
            part.first_row = row
            row += part.n_outputs
            i += k
        self.raw.n_tokens = n
        return n

    def free(self) -> None:
        lc.llama_batch_free(self.raw)


class AbortFlag:
    """The flag a context's abort callback reads (see the module docstring)."""

    def __init__(self) -> None:
        self.value = ctypes.c_int32(0)
        self._callback: Any = None  # kept alive for as long as the context may call it

    def install(self, ctx: Any) -> None:
        """Make llama.cpp check this flag while `ctx` decodes."""
        from localspec._verifier import ffi, lib

        address = int(ffi.cast("uintptr_t", ffi.addressof(lib, "ls_abort_requested")))
        self._callback = lc.ggml_abort_callback(address)
        lc.llama_set_abort_callback(ctx, self._callback, ctypes.cast(ctypes.pointer(self.value), ctypes.c_void_p))

    def set(self) -> None:
        self.value.value = 1

    def clear(self) -> None:
        self.value.value = 0

    @property
    def is_set(self) -> bool:
        return bool(self.value.value)
