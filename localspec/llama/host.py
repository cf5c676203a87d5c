"""This machine as llama.cpp runs on it: its CPU and free memory, the llama.cpp build, what a
model's speed depends on here (its identity, and the key per-machine state is filed under), and
where that state lives (the profile directory: cost profiles, CPU kernel checks; read and written
through localspec.settings.files, which touches only files localspec wrote)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any

from localspec.settings.models import ModelOptions


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux: MemAvailable), None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity; else every CPU), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cpuinfo(*keys: str) -> str | None:
    """The value of the first /proc/cpuinfo line that starts with one of `keys` (None: none, or
    not Linux)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line.split(":", 1)[1].strip()
    return None


@lru_cache(maxsize=1)
def machine() -> dict[str, str]:
    """The llama.cpp build and the CPU it runs on."""
    import llama_cpp

    cpu = cpuinfo("model name") or platform.processor() or platform.machine()
    info = llama_cpp.llama_print_system_info()
    return {"llama_cpp": str(getattr(llama_cpp, "__version__", "?")),
            "build": info.decode("utf-8", "replace").strip() if isinstance(info, bytes) else str(info),
            "cpu": cpu, "cores": str(os.cpu_count())}


def identity(path: Path, options: ModelOptions, extra: dict | None = None) -> dict[str, Any]:
    """What a model's speed depends on (without loading it)."""
    st = path.stat()
    return {"file": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "threads": options.threads or os.cpu_count(), "n_gpu_layers": options.n_gpu_layers,
            "cache_type": options.cache_type, "flash_attn": options.flash_attn, "load_mode": options.load_mode,
            "cpu_kernels": options.cpu_kernels, "batch_size": options.batch_size, "rpc": list(options.rpc),
            **machine(), **(extra or {})}


def key_of(ident: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
