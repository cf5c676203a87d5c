"""What localspec takes from llama-cpp-python beyond its bindings of llama.h, in one place.

localspec calls llama.cpp's public C API (llama.h) through llama-cpp-python's bindings wherever
it needs it. This module holds the rest, each part right for the llama.cpp that one
llama-cpp-python version bundles:

* ggml's backend API (devices, backend registries and their own functions, buffer types, the
  abort callback) and gguf's reader, which the bindings do not cover: the libggml bundled in
  llama-cpp-python's package folder (``llama_cpp/lib``) opened with a handle of our own and its
  C signatures declared by hand (:func:`lib`, :func:`proc`, :func:`tensors`);
* the address of libllama's ``llama_tokenize``, which llguidance's tokenizer calls from native
  code (:func:`tokenize_address`: the binding is a bare ctypes function);
* llama.cpp's rule for the weights its ``CPU_REPACK`` buffer type takes, copied from
  ``ggml-cpu/repack.cpp`` (:func:`repack_rows`).

A llama-cpp-python outside :data:`TESTED` (pyproject.toml pins the same) is refused when this
module is imported, with a :class:`~localspec.errors.DependencyError` that says what to install.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

from localspec.dependencies import require_tested

PACKAGE = "llama-cpp-python"
TESTED = "==0.3.36"
INTERNALS = ("its bundled libggml's C API declared by hand (ggml devices and buffer types, RPC, gguf), "
             "the address of llama_tokenize and a copy of llama.cpp's CPU_REPACK rule")
VERSION = require_tested(PACKAGE, TESTED, INTERNALS)

LIBRARY_NAMES = ("libggml.so", "libggml.dylib", "ggml.dll")  # in llama-cpp-python's lib directory
DEVICE_CPU = 0  # enum ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_CPU
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}  # the whole enum, by value
ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)  # ggml_abort_callback_t


class GGUFInitParams(ctypes.Structure):
    """gguf.h's struct gguf_init_params."""

    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


_vp, _cp, _sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
_SIGNATURES: tuple[tuple[str, Any, list[Any]], ...] = (  # libggml's own exports: name, result, arguments
    ("ggml_backend_reg_by_name", _vp, [_cp]), ("ggml_backend_register", None, [_vp]),
    ("ggml_backend_reg_get_proc_address", _vp, [_vp, _cp]),
    ("ggml_backend_reg_dev_count", _sz, [_vp]), ("ggml_backend_reg_dev_get", _vp, [_vp, _sz]),
    ("ggml_backend_dev_count", _sz, []), ("ggml_backend_dev_get", _vp, [_sz]),
    ("ggml_backend_dev_name", _cp, [_vp]), ("ggml_backend_dev_description", _cp, [_vp]),
    ("ggml_backend_dev_type", ctypes.c_int, [_vp]),
    ("ggml_backend_dev_backend_reg", _vp, [_vp]), ("ggml_backend_reg_name", _cp, [_vp]),
    ("ggml_backend_dev_by_type", _vp, [ctypes.c_int]),
    ("ggml_backend_dev_memory", None, [_vp, ctypes.POINTER(_sz), ctypes.POINTER(_sz)]),
    ("ggml_backend_buft_name", _cp, [_vp]), ("ggml_set_abort_callback", _vp, [ABORT_CALLBACK]),
    ("gguf_init_from_file", _vp, [_cp, GGUFInitParams]), ("gguf_free", None, [_vp]),
    ("gguf_get_n_tensors", ctypes.c_int64, [_vp]), ("gguf_get_tensor_name", _cp, [_vp, ctypes.c_int64]),
    ("gguf_get_tensor_type", ctypes.c_int, [_vp, ctypes.c_int64]),
    ("ggml_get_tensor", _vp, [_vp, _cp]), ("ggml_n_dims", ctypes.c_int, [_vp]),
    ("ggml_nrows", ctypes.c_int64, [_vp]), ("ggml_type_name", _cp, [ctypes.c_int]), ("ggml_free", None, [_vp]),
    ("gguf_get_n_kv", ctypes.c_int64, [_vp]), ("gguf_get_key", _cp, [_vp, ctypes.c_int64]),
    ("gguf_get_kv_type", ctypes.c_int, [_vp, ctypes.c_int64]),
    ("gguf_get_arr_type", ctypes.c_int, [_vp, ctypes.c_int64]),
    ("gguf_get_arr_n", ctypes.c_size_t, [_vp, ctypes.c_int64]), ("gguf_get_arr_data", _vp, [_vp, ctypes.c_int64]),
    ("gguf_get_val_data", _vp, [_vp, ctypes.c_int64]), ("gguf_get_val_str", _cp, [_vp, ctypes.c_int64]),
    ("gguf_get_tensor_offset", ctypes.c_size_t, [_vp, ctypes.c_int64]),
    ("gguf_get_tensor_size", ctypes.c_size_t, [_vp, ctypes.c_int64]),
)
PROCS: dict[str, tuple[Any, list[Any]]] = {  # a backend's own functions (ggml_backend_reg_get_proc_address)
    "ggml_backend_dev_get_extra_bufts": (ctypes.POINTER(_vp), [_vp]),  # the CPU backend's
    "ggml_backend_rpc_add_server": (_vp, [_cp]),  # the RPC backend's
    "ggml_backend_rpc_start_server": (None, [_cp, _cp, _sz, _sz, ctypes.POINTER(_vp)]),
}


@functools.lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    """A handle of our own on the libggml that llama-cpp-python bundles (its ``lib`` directory,
    loaded already: the same library), with the calls above typed; llama-cpp-python's own handle
    is left as it is."""
    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    path = next((libdir / name for name in LIBRARY_NAMES if (libdir / name).exists()), None)
    if path is None:
        raise OSError(f"llama-cpp-python's libggml is not in {libdir} (names tried: {', '.join(LIBRARY_NAMES)})")
    handle = ctypes.CDLL(str(path))
    for name, res, args in _SIGNATURES:
        fn = getattr(handle, name)
        fn.restype, fn.argtypes = res, args
    return handle


def proc(reg: int, name: str) -> Any | None:
    """A backend's own function (ggml_backend_reg_get_proc_address), typed as PROCS declares it,
    or None if the backend has none."""
    restype, argtypes = PROCS[name]
    address = lib().ggml_backend_reg_get_proc_address(reg, name.encode())
    return ctypes.CFUNCTYPE(restype, *argtypes)(address) if address else None


def tokenize_address() -> int:
    """The address of libllama's ``llama_tokenize``, for native code that calls it (llguidance's
    tokenizer): the binding ``llama_cpp.llama_tokenize`` is the ctypes function itself."""
    import llama_cpp

    address = ctypes.cast(llama_cpp.llama_tokenize, ctypes.c_void_p).value
    if not address:
        raise OSError("llama-cpp-python's llama_tokenize has no address")
    return address


def repack_rows(weight_type: str, features: frozenset[str]) -> int | None:
    """The row multiple CPU_REPACK needs for a weight type on a CPU with these llama.cpp features
    ("AVX2", "NEON", ...), or None when it takes none (ggml-cpu/repack.cpp,
    ggml_repack_get_optimal_repack_type, as llama-cpp-python 0.3.36 bundles it)."""
    avx2, neon = "AVX2" in features, "NEON" in features
    i8mm, dot = neon and "MATMUL_INT8" in features, neon and "DOTPROD" in features
    if weight_type == "Q4_0":
        return 8 if avx2 else 4 if (i8mm or dot) else None
    if weight_type == "Q4_K":
        return 8 if (avx2 or i8mm or dot) else None
    if weight_type == "Q2_K":
        return 8 if "AVX512" in features else None
    if weight_type in ("Q5_K", "Q6_K"):
        return 8 if (i8mm or dot) else None
    if weight_type in ("IQ4_NL", "MXFP4"):
        return 8 if avx2 else 4 if dot else None
    if weight_type in ("Q8_0", "Q1_0"):
        return 4 if (i8mm or dot) else None
    return None
