"""What llama.cpp's CPU backend offers a model's weights: the extra buffer types of this build
(``CPU_REPACK``, ``AMX``, KleidiAI on Arm) and those known to crash, the features of this CPU, a
GGUF file's weights and which of them ``CPU_REPACK`` takes. ``localspec.llama.kernels`` chooses a
configuration from these."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from localspec.errors import ModelError

KNOWN_CRASHING = {"AMX": "llama.cpp's AMX kernels crash on the first decode on some Intel Xeons "
                         "(llama.cpp issue 20824)"}
REPACK_BUFFER = "CPU_REPACK"
# the matrix weights of llama.cpp's graphs (used only as the first operand of a MUL_MAT)
MATMUL_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "attn_q_a", "attn_q_b",
                  "attn_kv_a_mqa", "attn_kv_b", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp",
                  "ffn_up_shexp", "ffn_down_shexp")
# the llama_ftype that quantizes a tiny model's matrices to each weight type (for the check)
CHECK_FTYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 11,
                "Q4_K": 14, "Q5_K": 16, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32}


# ---------------------------------------------------------------- what this build and CPU offer


@lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """The features llama.cpp's CPU backend was built for ("AVX2", "AMX_INT8", "NEON", ...)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    text = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    return frozenset(m.group(1) for m in re.finditer(r"(\w+) = 1", text))


@lru_cache(maxsize=1)
def extra_buffer_types() -> dict[str, int]:
    """The CPU backend's extra buffer types, in llama.cpp's order of preference: name -> handle."""
    from localspec.llama import backend, compat

    backend.init()
    lib = compat.lib()
    dev = lib.ggml_backend_dev_by_type(compat.DEVICE_CPU)
    if not dev:
        return {}
    get = compat.proc(lib.ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts")
    if get is None:
        return {}
    array, out = get(dev), {}
    for i in range(64):
        if not array or not array[i]:
            break
        out[lib.ggml_backend_buft_name(array[i]).decode()] = int(array[i])
    return out


def crashing_buffer_types() -> list[str]:
    """This build's extra buffer types that are known to crash (KNOWN_CRASHING)."""
    return [name for name in extra_buffer_types() if name in KNOWN_CRASHING]


# ---------------------------------------------------------------- a model's weights


@dataclass(frozen=True)
class Weight:
    """One tensor of a GGUF file: its name, ggml type name, number of dimensions and rows (ne[1])."""

    name: str
    type: str
    dims: int
    rows: int

    @property
    def matmul(self) -> bool:
        """A matrix weight of llama.cpp's graphs (never token_embd, which is read row by row)."""
        if self.dims != 2 or not self.name.endswith(".weight"):
            return False
        if self.name == "output.weight":
            return True
        m = re.fullmatch(r"blk\.\d+\.(\w+)\.weight", self.name)
        return m is not None and m.group(1) in MATMUL_WEIGHTS


def read_weights(path: Path) -> tuple[Weight, ...]:
    """The tensors of a GGUF file, from its header (llama.cpp's gguf reader; milliseconds)."""

    from localspec.llama.gguf_header import tensors

    found = tensors(str(path))
    if found is None:
        raise ModelError(f"llama.cpp could not load {path}: its header or tensor list is damaged or cut short "
                         "(an interrupted download? fetch or copy it again)")
    return tuple(Weight(name, type_name.upper(), dims, rows) for name, type_name, dims, rows in found)


def checked_types(weights: Sequence[Weight]) -> tuple[str, ...]:
    """The weight types a configuration's kernels must be checked on: every type of a matrix
    weight but F32 (which no extra buffer type takes), for which a tiny model can be made."""
    return tuple(sorted({w.type for w in weights if w.matmul and w.type in CHECK_FTYPES}))


def repackable(weights: Sequence[Weight], features: frozenset[str]) -> list[Weight]:
    """The weights CPU_REPACK takes on this CPU: matrix weights of a type it has kernels for,
    with a row count its interleave divides."""
    from localspec.llama.compat import repack_rows

    out = []
    for w in weights:
        rows = repack_rows(w.type, features) if w.matmul else None
        if rows is not None and w.rows % rows == 0:
            out.append(w)
    return out


def on_cpu(weights: Sequence[Weight], gpu_layers: int) -> list[Weight]:
    """The weights that stay on the CPU when `gpu_layers` layers go to other devices (llama.cpp
    offloads the last blocks, then the output layer: block i stays below n_layer + 1 - gpu_layers)."""
    if gpu_layers <= 0:
        return list(weights)
    block = {w.name: int(m.group(1)) for w in weights if (m := re.match(r"blk\.(\d+)\.", w.name))}
    first_offloaded = max(block.values(), default=-1) + 2 - gpu_layers  # n_layer + 1 - gpu_layers
    return [w for w in weights
            if block.get(w.name, first_offloaded) < first_offloaded or w.name == "token_embd.weight"]


def name_pattern(names: Sequence[str]) -> str:
    """One regular expression that matches exactly these tensor names (llama.cpp runs every
    override pattern on every tensor name, so keep them few): blocks grouped per weight."""
    blocks: dict[str, list[str]] = {}
    others = []
    for name in names:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if m:
            blocks.setdefault(m.group(2), []).append(m.group(1))
        else:
            others.append(re.escape(name))
    parts = [rf"blk\.(?:{'|'.join(sorted(ids, key=int))})\.{re.escape(tensor)}\.weight"
             for tensor, ids in sorted(blocks.items())]
    return "^(?:" + "|".join(parts + sorted(others)) + ")$"


_BUFFER_LINE = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([0-9.]+) MiB")


def weight_buffers(lines: Sequence[str]) -> dict[str, float]:
    """MiB of weights per buffer type, from llama.cpp's `load_tensors: <type> model buffer size` lines
    (its log during a load)."""
    out: dict[str, float] = {}
    for m in _BUFFER_LINE.finditer("".join(lines)):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out
