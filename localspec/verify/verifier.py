"""numpy <-> C verifier: the lossless accept/reject rules of speculative decoding.

One tree representation serves chains, K paths and trees:

* ``tokens[n]`` (int32) and ``parents[n]`` (int32, -1 = the committed prefix), parents before
  children, siblings in the order they were sampled;
* ``target_logits[n+1, V]`` (float32): row 0 = target logits after the committed prefix,
  row j+1 = after node j;
* ``draft_probs[n+1, V]`` (float32): row 0 = the distribution the root's children were sampled
  from, row j+1 = the one node j's children were sampled from (unused for leaves).

How siblings were sampled matters:

* ``rrs``: the children of a node are i.i.d. draws (with replacement) from its draft row;
* ``rrsw`` and ``traversal``: drawn without replacement, each later sibling from the draft row
  renormalised after removing the earlier siblings' tokens (siblings must be distinct);
* ``gbv`` and ``batch``: K independent root-to-leaf chains (``gbv``: all of the same length);
* ``token``, ``block`` (and ``lenience``): one chain; ``greedy`` and ``match``: any tree.

The target is transformed exactly like plain sampling (:func:`probs`): the row's token mask
first (``masks``, constrained decoding: disallowed tokens get probability 0, as if their logits
were -inf), then top-k, then top-p, then min-p on the temperature-1 distribution of the allowed
tokens (llama.cpp's default order), then temperature; temperature 0 is greedy (the lowest-id
argmax among the allowed tokens). ``lenience`` > 0 (``token`` only) is the *lossy*
over-acceptance of Yin et al. Thm 4; every other setting is lossless, with respect to the
masked target when ``masks`` is given.

``masks`` (optional): uint32 bitmasks of shape ``(n+1, ceil(V/32))``, the same row ids as
``target_logits``; row r allows token t iff bit ``t % 32`` of word ``t // 32`` is set
(:func:`pack_mask` builds them from a boolean array). Draft rows are whatever the drafter drew
from (e.g. its own masked distribution, ``probs(..., masks=...)``); a drafted token its row's
mask forbids is never accepted.

Randomness is a ``seed`` or ``n+1`` caller-supplied ``uniforms``: ``uniforms[j]`` is node j's
accept/reject draw (for ``match``: the target draw at row j+1, ``uniforms[0]`` at the root) and
``uniforms[n]`` draws the correction/bonus token, so a reference can be compared draw for draw.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from localspec._verifier import ffi, lib
from localspec.errors import VerifierError
from localspec.llama.logits import LogitsPointer
from localspec.settings.generation import CHAIN_ONLY, VERIFIERS as METHODS
from localspec.settings.sampling import SamplingParams

PLAIN = SamplingParams()  # the target's own distribution: temperature 1, nothing truncated
_METHOD_IDS = {name: i for i, name in enumerate(METHODS)}

_SHAPES = {
    "token": "a single chain (every node has at most one child)",
    "block": "a single chain (every node has at most one child)",
    "gbv": "K root-to-leaf chains of equal length (only the root may branch)",
    "batch": "K root-to-leaf chains (only the root may branch)",
}


@dataclass(frozen=True)
class VerifyOutcome:
    """Outcome of one verification step."""

    path: tuple[int, ...]  # accepted node indices, root to leaf
    token: int  # the correction (after a rejection) or bonus (all accepted) token
    n_accepted: int


def _c_sampling(sampling: SamplingParams, out: Any) -> None:
    """Fill an ls_sampling struct."""
    out.temperature = sampling.temperature
    out.top_k = sampling.top_k
    out.top_p = sampling.top_p
    out.min_p = sampling.min_p


class _Workspace(threading.local):
    """Per-thread scratch memory, grown on demand and reused (no allocation per call)."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)

    def get(self, nbytes: int) -> Any:
        if self.buf.nbytes < nbytes:
            self.buf = np.empty(max(nbytes, 2 * self.buf.nbytes), dtype=np.uint8)
        return ffi.from_buffer(self.buf)


_workspace = _Workspace()


def _rows(name: str, value: Any, n_rows: int, n_vocab: int | None) -> tuple[Any, int, int, Any]:
    """(pointer, stride, n_vocab, keepalive) for a float32 row matrix without copying if possible."""
    if isinstance(value, LogitsPointer):
        stride = value.row_stride or value.n_vocab
        if value.n_rows != n_rows:
            raise VerifierError(f"{name} has {value.n_rows} rows; expected {n_rows} (n_nodes + 1)")
        if stride < value.n_vocab or value.n_vocab <= 0 or value.address == 0:
            raise VerifierError(f"{name}: invalid pointer, n_vocab or row_stride")
        return ffi.cast("float *", value.address), stride, value.n_vocab, value
    arr = np.asarray(value)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise VerifierError(f"{name} must be a 2-D array of shape (n_nodes + 1, n_vocab), got {arr.shape}")
    if arr.dtype != np.float32 or arr.strides[1] != 4 or (
        arr.shape[0] > 1 and (arr.strides[0] % 4 or arr.strides[0] < 4 * arr.shape[1])
    ):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.shape[0] != n_rows:
        raise VerifierError(f"{name} has {arr.shape[0]} rows; expected {n_rows} (n_nodes + 1)")
    if n_vocab is not None and arr.shape[1] != n_vocab:
        raise VerifierError(f"{name} has {arr.shape[1]} columns; target_logits has {n_vocab}")
    if arr.shape[1] == 0:
        raise VerifierError(f"{name} has an empty vocabulary")
    ptr = ffi.cast("float *", arr.ctypes.data)
    stride = arr.strides[0] // 4 if arr.shape[0] > 1 else arr.shape[1]  # a 1-row stride is arbitrary
    return ptr, stride, arr.shape[1], arr


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """Boolean ``allowed[..., V]`` -> uint32 bitmask ``[..., ceil(V/32)]``: bit t % 32 of word t // 32."""
    a = np.asarray(allowed)
    if a.dtype != np.bool_:
        raise ValueError(f"pack_mask needs a boolean array, got dtype {a.dtype}")
    if a.ndim == 0 or a.shape[-1] == 0:
        raise ValueError(f"pack_mask needs a non-empty last axis (the vocabulary), got shape {a.shape}")
    V = a.shape[-1]
    words = (V + 31) // 32
    padded = np.zeros(a.shape[:-1] + (words * 32,), dtype=np.bool_)
    padded[..., :V] = a
    packed = np.packbits(padded, axis=-1, bitorder="little")  # byte k, bit b = token 8k + b
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def _masks(value: Any, n_rows: int, n_vocab: int) -> tuple[Any, int, Any]:
    """(pointer, row stride in words, keepalive) of a uint32 mask matrix, validated, not copied."""
    if not isinstance(value, np.ndarray):
        raise VerifierError(f"masks must be a numpy uint32 array (see verifier.pack_mask), got {type(value).__name__}")
    if value.dtype != np.uint32:
        raise VerifierError(f"masks must have dtype uint32 (bit t % 32 of word t // 32; verifier.pack_mask "
                            f"builds it from booleans), got {value.dtype}")
    arr = value[None, :] if value.ndim == 1 else value
    words = (n_vocab + 31) // 32
    if arr.ndim != 2:
        raise VerifierError(f"masks must be a 2-D array of shape (n_rows, {words}), got {value.shape}")
    if arr.shape[0] != n_rows:
        raise VerifierError(f"masks has {arr.shape[0]} rows; expected {n_rows}, one per target row")
    if arr.shape[1] < words:
        raise VerifierError(f"masks has {arr.shape[1]} words per row; a vocabulary of {n_vocab} needs "
                            f"ceil({n_vocab}/32) = {words}")
    if arr.strides[1] != 4 or (arr.shape[0] > 1 and (arr.strides[0] % 4 or arr.strides[0] < 4 * arr.shape[1])):
        raise VerifierError("masks rows must be contiguous uint32 words (use np.ascontiguousarray)")
    if not arr.dtype.isnative:
        raise VerifierError("masks must be in native byte order")
    stride = arr.strides[0] // 4 if arr.shape[0] > 1 else arr.shape[1]
    return ffi.cast("uint32_t *", arr.ctypes.data), stride, arr


def _int_array(name: str, value: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise VerifierError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise VerifierError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise VerifierError(f"{name} holds values outside int32")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _uniforms(uniforms: Any, n: int) -> np.ndarray:
    u = np.ascontiguousarray(np.asarray(uniforms, dtype=np.float64).reshape(-1))
    if u.shape[0] != n + 1:
        raise VerifierError(f"uniforms must hold n_nodes + 1 = {n + 1} values, got {u.shape[0]}")
    return u


def _shape_problem(method: str, parents: np.ndarray) -> str:
    """What makes this tree unacceptable for `method` (diagnosed on the error path only)."""
    first_child: dict[int, int] = {}
    for j, p in enumerate(parents.tolist()):
        if p in first_child and (p >= 0 or method in CHAIN_ONLY):
            owner = "the root" if p < 0 else f"node {p}"
            return f"node {j} is a second child of {owner}"
        first_child.setdefault(p, j)
    depth: dict[int, int] = {-1: 0}
    for j, p in enumerate(parents.tolist()):
        depth[j] = depth[p] + 1
    leaves = [j for j in range(len(parents)) if j not in first_child]
    lengths = sorted({depth[j] for j in leaves})
    return f"its chains have lengths {lengths}"


def _error(status: int, index: int, method: str, tokens: np.ndarray, parents: np.ndarray,
           n_vocab: int, uniforms: np.ndarray | None) -> VerifierError:
    i = index
    if status == lib.LS_ERR_TOKEN:
        msg = f"tokens[{i}] = {tokens[i]} is outside the vocabulary [0, {n_vocab})"
    elif status == lib.LS_ERR_PARENT:
        msg = f"parents[{i}] = {parents[i]} must be -1 (the committed prefix) or the index of an earlier node"
    elif status == lib.LS_ERR_LOGITS:
        msg = f"target_logits row {i} contains NaN or infinity"
    elif status == lib.LS_ERR_DRAFT:
        msg = (f"draft_probs row {i} is not a probability distribution "
               "(entries must be finite, in [0, 1], and sum to 1)")
    elif status == lib.LS_ERR_SHAPE:
        msg = f"method '{method}' verifies {_SHAPES.get(method, 'this shape')}, but {_shape_problem(method, parents)}"
    elif status == lib.LS_ERR_SIBLINGS:
        msg = (f"method '{method}' needs siblings drawn without replacement (distinct tokens); "
               f"node {i} repeats a sibling's token {tokens[i]}")
    elif status == lib.LS_ERR_UNIFORM and uniforms is not None:
        msg = f"uniforms[{i}] = {uniforms[i]} is outside [0, 1)"
    elif status == lib.LS_ERR_LENIENCE:
        msg = "lenience must be finite and >= 0, and applies to method 'token' only"
    elif status == lib.LS_ERR_MASK:
        msg = (f"masks row {i} allows no token (row 0 = after the committed prefix, row j+1 = after node j); "
               "every target row needs at least one allowed token")
    else:
        msg = ffi.string(lib.ls_status_string(status)).decode()
    return VerifierError(msg, status, i)


def verify(
    method: str,
    target_logits: np.ndarray | LogitsPointer,
    draft_probs: np.ndarray | LogitsPointer | None,
    tokens: Sequence[int] | np.ndarray,
    parents: Sequence[int] | np.ndarray,
    *,
    sampling: SamplingParams = PLAIN,
    seed: int | None = None,
    uniforms: Sequence[float] | np.ndarray | None = None,
    lenience: float = 0.0,
    masks: np.ndarray | None = None,
) -> VerifyOutcome:
    """Accept a path of the draft tree and draw one more token, losslessly.

    Returns the accepted node indices (root to leaf) and the correction/bonus token; the
    sequence (accepted tokens, token) is distributed exactly as the transformed (and, with
    ``masks``, masked) target would sample it (``lenience`` > 0 excepted). See the module
    docstring for the representation.
    """
    if method not in _METHOD_IDS:
        raise VerifierError(f"unknown method '{method}'; choose one of {', '.join(METHODS)}")
    tok = _int_array("tokens", tokens)
    par = _int_array("parents", parents)
    n = tok.shape[0]
    if par.shape[0] != n:
        raise VerifierError(f"parents has {par.shape[0]} entries but tokens has {n}")
    if not np.isfinite(lenience) or lenience < 0:
        raise VerifierError(f"lenience must be a finite number >= 0, got {lenience}")
    if lenience > 0 and method != "token":
        raise VerifierError(f"lenience applies to method 'token' only (got method '{method}')")
    t_ptr, t_stride, n_vocab, t_keep = _rows("target_logits", target_logits, n + 1, None)
    if draft_probs is None:
        if n:
            raise VerifierError("draft_probs is required when there are draft nodes")
        d_ptr, d_stride, d_keep = ffi.NULL, n_vocab, None
    else:
        d_ptr, d_stride, _, d_keep = _rows("draft_probs", draft_probs, n + 1, n_vocab)
    u = None if uniforms is None else _uniforms(uniforms, n)
    m_ptr, m_stride, m_keep = (ffi.NULL, 0, None) if masks is None else _masks(masks, n + 1, n_vocab)

    prob = ffi.new("ls_problem *")
    prob.n_nodes = n
    prob.n_vocab = n_vocab
    prob.tokens = ffi.cast("int32_t *", tok.ctypes.data)
    prob.parents = ffi.cast("int32_t *", par.ctypes.data)
    prob.target_logits = t_ptr
    prob.target_stride = t_stride
    prob.draft_probs = d_ptr
    prob.draft_stride = d_stride
    _c_sampling(sampling, prob.sampling)
    prob.lenience = lenience
    prob.uniforms = ffi.NULL if u is None else ffi.cast("double *", u.ctypes.data)
    prob.seed = secrets.randbits(64) if seed is None else int(seed) & 0xFFFFFFFFFFFFFFFF
    prob.masks = m_ptr
    prob.mask_stride = m_stride

    mid = _METHOD_IDS[method]
    nbytes = lib.ls_workspace_bytes(mid, n, n_vocab, ffi.addressof(prob.sampling))
    if nbytes == 0:
        raise VerifierError(f"sizes out of range: {n} nodes, vocabulary {n_vocab}")
    path = np.empty(max(n, 1), dtype=np.int32)
    out = ffi.new("ls_verdict *")
    out.path = ffi.cast("int32_t *", path.ctypes.data)
    status = lib.ls_verify(mid, prob, _workspace.get(nbytes), nbytes, out)
    del t_keep, d_keep, m_keep
    if status != lib.LS_OK:
        raise _error(status, out.error_index, method, tok, par, n_vocab, u)
    k = out.n_accepted
    return VerifyOutcome(path=tuple(int(j) for j in path[:k]), token=int(out.token), n_accepted=k)


def probs(
    logits: np.ndarray | LogitsPointer,
    *,
    sampling: SamplingParams = PLAIN,
    dtype: type = np.float64,
    out: np.ndarray | None = None,
    masks: np.ndarray | None = None,
) -> np.ndarray:
    """The plain sampler's distribution of each row of ``logits`` (exactly what verify uses).

    ``masks``: optional uint32 bitmasks, one row per logits row (:func:`pack_mask`); applied
    first, as in :func:`verify` (a drafter draws from its own masked distribution this way).
    ``out``: an existing C-contiguous float32/float64 array of the result's shape to fill."""
    if isinstance(logits, LogitsPointer):
        n_rows, one = logits.n_rows, False
    else:
        arr = np.asarray(logits)
        one = arr.ndim == 1
        n_rows = 1 if one else arr.shape[0]
        logits = arr
    ptr, stride, n_vocab, keep = _rows("logits", logits, n_rows, None)
    m_ptr, m_stride, m_keep = (ffi.NULL, 0, None) if masks is None else _masks(masks, n_rows, n_vocab)
    if out is None:
        out = np.empty((n_rows, n_vocab), dtype=dtype)
    if out.dtype not in (np.float32, np.float64) or not out.flags.c_contiguous or out.size != n_rows * n_vocab:
        raise VerifierError(f"out must be a C-contiguous float32/float64 array of {n_rows}x{n_vocab}")
    settings = ffi.new("ls_sampling *")
    _c_sampling(sampling, settings)
    nbytes = lib.ls_probs_workspace_bytes(n_vocab, settings)
    err = ffi.new("int32_t *")
    o64 = ffi.cast("double *", out.ctypes.data) if out.dtype == np.float64 else ffi.NULL
    o32 = ffi.cast("float *", out.ctypes.data) if out.dtype == np.float32 else ffi.NULL
    status = lib.ls_probs_masked(ptr, stride, n_rows, n_vocab, m_ptr, m_stride, settings,
                                 _workspace.get(nbytes), nbytes, o64, o32, n_vocab, err)
    del keep, m_keep
    if status == lib.LS_ERR_LOGITS:
        raise VerifierError(f"logits row {err[0]} contains NaN or infinity", status, err[0])
    if status == lib.LS_ERR_MASK:
        raise VerifierError(f"masks row {err[0]} allows no token", status, err[0])
    if status != lib.LS_OK:
        raise VerifierError(ffi.string(lib.ls_status_string(status)).decode(), status)
    return out.reshape(n_vocab) if one else out.reshape(n_rows, n_vocab)


def sample_probs(row: np.ndarray, uniform: float, exclude: Sequence[int] = ()) -> int:
    """Inverse-CDF draw from a float32 probability row with ``exclude`` removed (renormalised)."""
    arr = np.ascontiguousarray(row, dtype=np.float32)
    ex = np.ascontiguousarray(np.asarray(exclude, dtype=np.int32).reshape(-1))
    out = ffi.new("int32_t *")
    status = lib.ls_sample_probs(ffi.cast("float *", arr.ctypes.data), arr.shape[0],
                                 ffi.cast("int32_t *", ex.ctypes.data), ex.shape[0], float(uniform), out)
    if status == lib.LS_ERR_DRAFT:
        raise VerifierError("draft row has no probability mass left to sample from", status)
    if status != lib.LS_OK:
        raise VerifierError(ffi.string(lib.ls_status_string(status)).decode(), status)
    return int(out[0])
