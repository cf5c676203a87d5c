"""This machine as llama.cpp runs on it: its CPU, the llama.cpp build, what a model's speed
depends on here (its identity, and the key per-machine state is filed under), and where that
state lives (the profile directory: cost profiles, CPU kernel checks)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any

from localspec.config import ModelOptions

PROFILE_ENV = "LOCALSPEC_PROFILE_DIR"  # overrides the directory


def profile_dir() -> Path:
    from localspec.llama import registry

    override = os.environ.get(PROFILE_ENV)
    return Path(override).expanduser() if override else registry.cache_root() / "profiles"


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


MAX_STATE_BYTES = 16 << 20  # a profile or record larger than this is no file localspec wrote


def read_state_file(path: Path) -> str:
    """The text of a small state file localspec wrote (a profile, a record of kernel checks):
    FileNotFoundError when absent; ValueError (UnicodeDecodeError included) when it is no regular
    file, is too large or is not UTF-8, so that a FIFO, a device or a huge file is neither read
    forever nor into memory."""
    if not path.exists():
        raise FileNotFoundError(path)
    if not path.is_file():
        raise ValueError("not a regular file")
    if path.stat().st_size > MAX_STATE_BYTES:
        raise ValueError(f"larger than {MAX_STATE_BYTES >> 20} MiB")
    return path.read_text(encoding="utf-8")
