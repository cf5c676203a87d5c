"""The machine every figure belongs to: a table's header line (CPU, llama.cpp's feature line, its
CPU extra buffer types) and a one-line summary with memory and versions."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version (its vendored llama.cpp is what the tools are built from)."""
    return metadata.version("llama-cpp-python")


def host_header() -> list[str]:
    """The host every figure belongs to: CPU model, llama.cpp's feature line, its extra buffer types."""
    from localspec.llama import buffer_types
    from localspec.llama.host import machine

    m = machine()
    extra = ", ".join(buffer_types.extra_buffer_types()) or "none"
    return [f"Host: **{m['cpu']}**, {m['cores']} cores; llama-cpp-python {m['llama_cpp']}; "
            f"llama.cpp `{m['build'].strip().rstrip('|').strip()}`; CPU extra buffer types: {extra}.", ""]


def machine_line() -> str:
    """CPU, cores, memory, system and versions in one line (head_to_head's report header)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}, llama-cpp-python {llama_cpp_version()}")
