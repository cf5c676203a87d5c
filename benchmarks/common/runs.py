"""One way to run ``localspec`` as a process, and the one result of a timed process.

Every whole-process figure of the benchmarks is a fresh process timed from its spawn to its exit
(its output read while it runs): :func:`run_localspec` starts ``python -m localspec ARGS`` and
returns a :class:`Run`; :func:`localspec_json` reads a ``--json`` answer into the same Run
(tokens, decode speed, timings). llama.cpp's tools return Runs too
(benchmarks.common.llama_tools), so every table compares like with like.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TARGET_ALONE = ("-d", "none", "-k", "0")  # localspec's arguments for the target alone
IN_PROCESS = ("--keep-alive", "0")  # each call loads its models itself (resident models: benchmarks.process.resident)


@dataclass
class Run:
    """One timed process: its wall time and, where it says, what it generated."""

    wall: float  # seconds, spawn to exit
    tokens: int = 0  # generated tokens (0: the process does not say)
    decode_tps: float = 0.0  # the decode's tokens per second, as the process reports it
    timings: dict = field(default_factory=dict)  # localspec --json's timings, with import_: spawn to command start
    data: dict = field(default_factory=dict)  # the whole --json result
    stdout: str = ""
    stderr: str = ""
    cpu: float = 0.0  # seconds of CPU (user + system) the process itself used (run_localspec), not its children's

    @property
    def per_token(self) -> float:
        """Wall seconds per generated token (the tools do not all stop at the same token)."""
        return self.wall / max(self.tokens, 1)


def run_localspec(args: Sequence[str], *, env: Mapping[str, str] | None = None, stdin: str | None = None,
                  python_flags: Sequence[str] = (), cwd: str | Path | None = None,
                  timeout: float | None = 1800.0) -> Run:
    """One fresh ``python [FLAGS] -m localspec ARGS`` process (`stdin`: text piped in, else none),
    timed from spawn to exit; RuntimeError with the end of its stderr when it fails."""
    cmd = [sys.executable, *python_flags, "-m", "localspec", *args]
    feed = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
    before = _children_cpu()
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=None if env is None else dict(env), cwd=cwd,
                         timeout=timeout, **feed)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:8])} ... failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return Run(wall, stdout=out.stdout, stderr=out.stderr, cpu=_children_cpu() - before)


def _children_cpu() -> float:
    """CPU seconds of this process's waited-for children (a resident service a call starts is a
    session of its own, never waited for: not counted)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def localspec_json(args: Sequence[str], *, env: Mapping[str, str], python_flags: Sequence[str] = (),
                   timeout: float = 1800.0, cwd: str | Path | None = None) -> Run:
    """A ``localspec --json ...`` process (`args` include --json): the Run with its answer's
    tokens, decode speed, timings (import_: from the spawn to the command's start) and JSON."""
    spawned = time.time()
    run = run_localspec(args, env=env, python_flags=python_flags, timeout=timeout, cwd=cwd)
    data = json.loads(run.stdout)
    run.data = data
    run.tokens = data["usage"]["completion_tokens"]
    run.decode_tps = data["stats"]["tokens_per_second"]
    run.timings = dict(data["timings"], import_=data["timings"]["command_started"] - spawned)
    return run


def profile_env(profile_dir: Path, **settings: str) -> dict[str, str]:
    """This process's environment with localspec's cost profiles in `profile_dir` (each benchmark
    keeps its own) and `settings` (LOCALSPEC_... variables) on top."""
    return dict(os.environ, LOCALSPEC_PROFILE_DIR=str(profile_dir), **settings)


def localspec(args: Sequence[str], prompt: str, profile_dir: Path, threads: int | None) -> Run:
    """One fresh ``localspec --json`` process, its models loaded by itself (--keep-alive 0)."""
    return localspec_json(["--json", *IN_PROCESS, *(["--threads", str(threads)] if threads else []), *args, prompt],
                          env=profile_env(profile_dir), timeout=900)


def chat(args: Sequence[str], turns: Sequence[str], env: Mapping[str, str]) -> float:
    """Wall seconds of a fresh ``localspec chat ARGS`` answering `turns`, piped."""
    return run_localspec(["chat", *args], stdin="\n".join(turns) + "\n", env=env).wall
