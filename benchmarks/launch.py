"""How the scripts beside this file run: ``python benchmarks/head_to_head.py ARGS`` (a command the
docs show) becomes ``python -m benchmarks.decode.head_to_head ARGS``, the same process replaced,
so the module runs inside the benchmarks package with its absolute imports. ``python -m`` finds
the package from the working directory, the repository root where the docs give their commands;
from another directory the root is put first on PYTHONPATH (for the benchmark's own processes
too). The interpreter's options (``-u``, ``-X importtime``) go with it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent


def interpreter_options() -> list[str]:
    """The options this interpreter was started with, before the script's path."""
    try:
        return list(sys.orig_argv[1:sys.orig_argv.index(sys.argv[0])])
    except ValueError:
        return []


def run_module(module: str) -> NoReturn:
    """Replace this process by ``python -m MODULE`` with this script's arguments."""
    argv = [sys.executable, *interpreter_options(), "-m", module, *sys.argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    if Path.cwd().resolve() == ROOT:
        os.execv(sys.executable, argv)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    os.execve(sys.executable, argv, {**os.environ, "PYTHONPATH": path})
