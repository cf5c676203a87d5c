"""Peak memory of a fresh process that loads the default pair at an 8k context and generates, per
load mode and KV cache type (the head-to-head benchmark's last table)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MEMORY_CONFIGS = [("read", "f16"), ("mmap", "f16"), ("read", "q8_0")]  # (load_mode, cache_type); first = default


def peak_rss_8k(target_path: Path, draft_path: Path, threads: int, load_mode: str, cache_type: str) -> dict:
    """Peak RSS of a fresh process that loads the pair at an 8k context and generates: the kernel's
    high-water mark of the process's own memory (VmHWM), which, unlike ru_maxrss, does not count
    the benchmark's pages the child shared between fork and exec."""
    options = f"ctx_size=8192, threads={threads}, load_mode={load_mode!r}, cache_type={cache_type!r}"
    code = (
        "import re\n"
        "from localspec.api import load_model, generate\n"
        f"t = load_model({str(target_path)!r}, {options})\n"
        f"d = load_model({str(draft_path)!r}, {options})\n"
        "generate(t, d, 'def fib(n):', max_tokens=32, temperature=0.8, seed=0)\n"
        "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL, check=True)
    rss = int(out.stdout.strip().splitlines()[-1]) * 1024
    files = target_path.stat().st_size + draft_path.stat().st_size
    return dict(rss=rss, files=files, overhead=rss - files)


def memory_report(target_path: Path, draft_path: Path, threads: int) -> list[str]:
    lines = ["| load mode | KV cache | peak RSS | model files | overhead (target ≤ 300 MB) |",
             "| --- | --- | ---: | ---: | ---: |"]
    for load_mode, cache_type in MEMORY_CONFIGS:
        print(f"\rmemory at 8k: {load_mode} {cache_type:<10}", end="", file=sys.stderr, flush=True)
        m = peak_rss_8k(target_path, draft_path, threads, load_mode, cache_type)
        default = " (default)" if (load_mode, cache_type) == MEMORY_CONFIGS[0] else ""
        lines.append(f"| {load_mode}{default} | {cache_type} | {m['rss'] / 1e6:,.0f} MB | {m['files'] / 1e6:,.0f} MB | "
                     f"{m['overhead'] / 1e6:,.0f} MB |")
    print("", file=sys.stderr)
    return lines

