"""cffi build script (out-of-line API mode) for localspec's C verifier.

Run by setuptools through ``cffi_modules`` in setup.py; produces ``localspec._verifier``.
Set LOCALSPEC_CFLAGS to add compiler flags (e.g. sanitizers in tests).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SOURCES = ["sampling.c", "verify.c", "chain.c", "multipath.c", "tree.c"]
CFLAGS = [
    "-std=c11",
    "-O3",
    "-ffp-contract=off",  # scalar and vectorized evaluations of an entry must agree bit for bit
    "-fno-math-errno",
    "-fno-trapping-math",  # lets the selects in the row kernels vectorize; results unchanged
    "-fno-wrapv",  # undo Python's -fwrapv: it blocks vectorizing int32-indexed loops
    "-Wall",
    "-Wextra",
    "-Wpedantic",
    "-Wshadow",
]


def public_declarations() -> str:
    """verifier.h without comments, includes and include guards, as cdef text."""
    text = (HERE / "verifier.h").read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    lines = []
    for line in text.splitlines():
        if line.startswith("#define") and len(line.split()) >= 3:
            # cffi takes "#define NAME <integer literal>": drop the parentheses around negatives
            lines.append(re.sub(r"\((-\d+)\)", r"\1", line).rstrip())
        elif not line.startswith("#"):
            lines.append(line)
    return "\n".join(lines)


ffibuilder = FFI()
ffibuilder.cdef(public_declarations())
ffibuilder.set_source(
    "localspec._verifier",
    '#include "verifier.h"',
    sources=[str((HERE / name).relative_to(Path.cwd())) if HERE.is_relative_to(Path.cwd()) else str(HERE / name) for name in SOURCES],
    include_dirs=[str(HERE)],
    extra_compile_args=CFLAGS + os.environ.get("LOCALSPEC_CFLAGS", "").split(),
    extra_link_args=os.environ.get("LOCALSPEC_LDFLAGS", "").split(),
    libraries=["m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
