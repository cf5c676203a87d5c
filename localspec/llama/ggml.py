"""ggml's backend API through ctypes on the libraries llama-cpp-python bundles.

The bindings cover llama.h only; device and buffer-type calls (RPC servers, the CPU backend's
extra buffer types) are declared here once, with their C signatures.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

DEVICE_CPU = 0  # GGML_BACKEND_DEVICE_TYPE_CPU
LIBRARY_NAMES = ("libggml.so", "libggml.dylib", "ggml.dll")  # in llama-cpp-python's lib directory



class GGUFInitParams(ctypes.Structure):
    """gguf.h's struct gguf_init_params."""

    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


_vp, _cp, _sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
_SIGNATURES: tuple[tuple[str, object, list], ...] = (
    ("ggml_backend_reg_by_name", _vp, [_cp]), ("ggml_backend_register", None, [_vp]),
    ("ggml_backend_reg_get_proc_address", _vp, [_vp, _cp]),
    ("ggml_backend_reg_dev_count", _sz, [_vp]), ("ggml_backend_reg_dev_get", _vp, [_vp, _sz]),
    ("ggml_backend_dev_count", _sz, []), ("ggml_backend_dev_get", _vp, [_sz]),
    ("ggml_backend_dev_name", _cp, [_vp]), ("ggml_backend_dev_description", _cp, [_vp]),
    ("ggml_backend_dev_type", ctypes.c_int, [_vp]),
    ("ggml_backend_dev_backend_reg", _vp, [_vp]), ("ggml_backend_reg_name", _cp, [_vp]),
    ("ggml_backend_dev_by_type", _vp, [ctypes.c_int]),
    ("ggml_backend_dev_memory", None, [_vp, ctypes.POINTER(_sz), ctypes.POINTER(_sz)]),
    ("ggml_backend_buft_name", _cp, [_vp]),
    ("gguf_init_from_file", _vp, [_cp, GGUFInitParams]), ("gguf_free", None, [_vp]),
    ("gguf_get_n_tensors", ctypes.c_int64, [_vp]), ("gguf_get_tensor_name", _cp, [_vp, ctypes.c_int64]),
    ("gguf_get_tensor_type", ctypes.c_int, [_vp, ctypes.c_int64]),
    ("ggml_get_tensor", _vp, [_vp, _cp]), ("ggml_n_dims", ctypes.c_int, [_vp]),
    ("ggml_nrows", ctypes.c_int64, [_vp]), ("ggml_type_name", _cp, [ctypes.c_int]), ("ggml_free", None, [_vp]),
    ("gguf_get_n_kv", ctypes.c_int64, [_vp]), ("gguf_get_key", _cp, [_vp, ctypes.c_int64]),
    ("gguf_get_kv_type", ctypes.c_int, [_vp, ctypes.c_int64]),
    ("gguf_get_arr_type", ctypes.c_int, [_vp, ctypes.c_int64]),
    ("gguf_get_arr_n", _sz, [_vp, ctypes.c_int64]), ("gguf_get_arr_data", _vp, [_vp, ctypes.c_int64]),
    ("gguf_get_val_data", _vp, [_vp, ctypes.c_int64]), ("gguf_get_val_str", _cp, [_vp, ctypes.c_int64]),
    ("gguf_get_tensor_offset", _sz, [_vp, ctypes.c_int64]), ("gguf_get_tensor_size", _sz, [_vp, ctypes.c_int64]),
)
# gguf.h's enum gguf_type -> the ctypes type of a scalar or array element (8: STRING, 9: ARRAY)
GGUF_SCALARS: dict[int, Any] = {
    0: ctypes.c_uint8, 1: ctypes.c_int8, 2: ctypes.c_uint16, 3: ctypes.c_int16, 4: ctypes.c_uint32, 5: ctypes.c_int32,
    6: ctypes.c_float, 7: ctypes.c_bool, 10: ctypes.c_uint64, 11: ctypes.c_int64, 12: ctypes.c_double}
GGUF_STRING, GGUF_ARRAY = 8, 9



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


def tensors(path: str) -> list[tuple[str, str, int, int]] | None:
    """(name, type name, dimensions, rows) of each tensor of a GGUF file, from its header alone
    (:func:`header`); None when llama.cpp cannot read the file."""
    found = header(path)
    return None if found is None else [(t.name, t.type, t.dims, t.rows) for t in found.tensors]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file's header: its name, ggml type name, dimensions, rows (ne[1] and
    above), bytes and offset in the file's data section."""

    name: str
    type: str
    dims: int
    rows: int
    nbytes: int
    offset: int


@dataclass(frozen=True)
class Header:
    """A GGUF file's metadata (numbers and strings as values; an array of numbers as a tuple, an
    array of strings as its length) and tensors, as llama.cpp's own reader reads them."""

    metadata: Mapping[str, object]
    tensors: Sequence[TensorInfo]


def _value(g: ctypes.CDLL, gguf: int, key: int) -> object:
    """One metadata value (see Header)."""
    kind = g.gguf_get_kv_type(gguf, key)
    if kind == GGUF_STRING:
        return g.gguf_get_val_str(gguf, key).decode("utf-8", "replace")
    if kind in GGUF_SCALARS:
        return GGUF_SCALARS[kind].from_address(g.gguf_get_val_data(gguf, key)).value
    if kind == GGUF_ARRAY:
        n, element = g.gguf_get_arr_n(gguf, key), GGUF_SCALARS.get(g.gguf_get_arr_type(gguf, key))
        if element is None:  # strings (a vocabulary) or nested arrays: only how many
            return n
        return tuple((element * n).from_address(g.gguf_get_arr_data(gguf, key))) if n else ()
    return None


def header(path: str) -> Header | None:
    """A GGUF file's metadata and tensors, from its header alone: llama.cpp's own reader
    (gguf_init_from_file with no_alloc) reads the 1.5B target's in 0.2 s, where the gguf
    package's Python reader takes 9 s over its two 150,000-entry tokenizer arrays; None when
    llama.cpp cannot read the file."""
    g = lib()
    context = ctypes.c_void_p()
    gguf = g.gguf_init_from_file(os.fsencode(path), GGUFInitParams(True, ctypes.pointer(context)))
    if not gguf:
        return None
    try:
        metadata = {g.gguf_get_key(gguf, k).decode("utf-8", "replace"): _value(g, gguf, k)
                    for k in range(g.gguf_get_n_kv(gguf))}
        tensors = []
        for i in range(g.gguf_get_n_tensors(gguf)):
            name = g.gguf_get_tensor_name(gguf, i)
            tensor = g.ggml_get_tensor(context, name)
            tensors.append(TensorInfo(name.decode(), g.ggml_type_name(g.gguf_get_tensor_type(gguf, i)).decode(),
                                      g.ggml_n_dims(tensor), g.ggml_nrows(tensor), g.gguf_get_tensor_size(gguf, i),
                                      g.gguf_get_tensor_offset(gguf, i)))
        return Header(metadata, tuple(tensors))
    finally:
        g.gguf_free(gguf)
        if context:
            g.ggml_free(context)


def proc(reg: int, name: str, restype: object, argtypes: list) -> ctypes._CFuncPtr | None:
    """A backend's own function (ggml_backend_reg_get_proc_address), or None if it has none."""
    address = lib().ggml_backend_reg_get_proc_address(reg, name.encode())
    return ctypes.CFUNCTYPE(restype, *argtypes)(address) if address else None
