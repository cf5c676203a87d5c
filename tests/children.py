"""Child processes started as a terminal starts them, however the tests themselves were started.

A process started with SIGINT ignored (a background job of a script, some CI runners) passes the
ignore on to the processes it starts, and a Python child then installs no KeyboardInterrupt
handler: a test that stops it with SIGINT, as Ctrl-C would, waits in vain. `popen` starts a
command through a small launcher that sets SIGINT to its default disposition and then execs the
command (the same process, so the same pid), as a shell does for a foreground job.

subprocess.Popen's `restore_signals` restores SIGPIPE and SIGXFSZ only, and its `preexec_fn` is
not safe in a process with threads (the tests run servers and model workers in threads)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Sequence

_LAUNCHER = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execvp(sys.argv[1], sys.argv[1:])")


def as_from_a_terminal(argv: Sequence[str]) -> list[str]:
    """`argv` behind the launcher: the command starts with SIGINT at its default disposition."""
    return [sys.executable, "-S", "-c", _LAUNCHER, *argv]


def popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen(argv, **kwargs), the child starting with SIGINT at its default disposition."""
    return subprocess.Popen(as_from_a_terminal(argv), **kwargs)
