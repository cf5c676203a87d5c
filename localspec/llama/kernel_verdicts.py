"""The checks of CPU kernel configurations: what a check found (:class:`KernelVerdict`), the child
process that finds it (:class:`Check`, running ``localspec.llama.kernel_check``), and this
machine's record of verdicts (:class:`Checks`, ``<profile dir>/kernel-checks``), kept per CPU,
CPU flags and llama.cpp build."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localspec.errors import ConfigError
from localspec.llama import buffer_types
from localspec.settings.files import STATE_LIMIT, Foreign, StateDir, state_root

log = logging.getLogger(__name__)

CHECK_TIMEOUT = 180.0  # seconds a check may take before its configuration counts as hanging
TIMEOUT_TRIES = 3  # runs whose check timed out before a configuration counts as hanging for good


def host_key() -> str:
    """What a check's verdict depends on besides the configuration: the CPU, its flags and the
    llama.cpp build."""
    from localspec.llama.host import cpuinfo, machine

    ident = {**machine(), "flags": cpuinfo("flags", "Features") or "",
             "extra": sorted(buffer_types.extra_buffer_types())}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class KernelVerdict:
    ok: bool
    detail: str  # what the child reported, or how it died
    seconds: float
    timed_out: bool = False  # no answer in time: a busy machine, or a hang (checked again on later runs)


class Checks:
    """The verdicts of this machine's checks, one JSON file per host key (written atomically;
    kept in memory too, so a directory that cannot be written never repeats a check). A check
    that timed out counts as failed in this process only: later runs check again, until it has
    timed out TIMEOUT_TRIES times."""

    def __init__(self, directory: Path | None = None) -> None:
        from localspec.settings.locations import profile_dir

        self.parent = None if directory is not None else profile_dir()  # created private when absent
        self.path = (directory or profile_dir() / "kernel-checks") / f"{host_key()}.json"
        self._memory: dict[str, KernelVerdict] = {}

    def _store(self, create: bool) -> StateDir:
        if create and self.parent is not None:
            state_root(self.parent, what="the profile directory")
        return StateDir.open(self.path.parent, what="the kernel check records", create=create, private=False)

    def _read(self) -> dict[str, Any]:
        try:
            with self._store(create=False) as store:
                data = json.loads(store.read(self.path.name, STATE_LIMIT).decode("utf-8"))
        except FileNotFoundError:
            return {}
        except Foreign as exc:
            log.warning("ignoring %s: %s (localspec reads only the records it wrote); the checks will run again",
                        self.path, exc)
            return {}
        except (ConfigError, OSError, ValueError, RecursionError) as exc:
            log.warning("ignoring the unreadable kernel checks %s (%s); they will run again", self.path, exc)
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> KernelVerdict | None:
        if key in self._memory:
            return self._memory[key]
        entry = self._read().get(key)
        if entry is None:
            return None
        ok, detail, seconds = (entry.get(k) for k in ("ok", "detail", "seconds")) if isinstance(entry, dict) else (None,) * 3
        if not (isinstance(ok, bool) and isinstance(detail, str) and isinstance(seconds, (int, float))
                and not isinstance(seconds, bool)):  # "ok": "false" must not pass for a verdict of ok
            log.warning("ignoring the malformed kernel check %r in %s; it will run again", key, self.path)
            return None
        if entry.get("timed_out") is True and not ok:
            tries = _timeouts(entry)
            if tries < TIMEOUT_TRIES:
                log.info("the kernel check %r timed out %d time(s) before: checked again", key, tries)
                return None
            return KernelVerdict(False, f"no answer in time on {tries} runs: taken for a hang", float(seconds))
        return KernelVerdict(ok, detail, float(seconds))

    def put(self, key: str, verdict: KernelVerdict) -> None:
        self._memory[key] = verdict
        data = self._read()
        record: dict[str, Any] = {"ok": verdict.ok, "detail": verdict.detail, "seconds": round(verdict.seconds, 3),
                                  "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if verdict.timed_out:
            before = data.get(key)
            record.update(timed_out=True, timeouts=_timeouts(before) + 1 if isinstance(before, dict)
                          and before.get("timed_out") is True else 1)
        data[key] = record
        try:
            with self._store(create=True) as store:
                store.write(self.path.name, json.dumps(data, indent=1, sort_keys=True).encode("utf-8"))
        except (ConfigError, Foreign, OSError) as exc:
            log.warning("cannot save the kernel checks in %s: %s", self.path.parent, exc)

    def all(self) -> dict[str, KernelVerdict]:
        out = {}
        for key in self._read():
            verdict = self.get(key)
            if verdict is not None:
                out[key] = verdict
        return out


def _timeouts(entry: dict) -> int:
    tries = entry.get("timeouts", 1)
    return tries if isinstance(tries, int) and not isinstance(tries, bool) and tries > 0 else 1


def check_key(config: str, types: Sequence[str]) -> str:
    return f"{config}:{','.join(types)}"


def _death(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


CHILD = [sys.executable, "-m", "localspec.llama.kernel_check"]  # the check's child, before CONFIG TYPE...
# (tests/test_kernels.py starts one that crashes instead: a fault must reach the child process)


class Check:
    """One configuration checked on tiny models of some weight types, in a child process that
    runs while the caller goes on (a model load overlaps it)."""

    def __init__(self, config: str, types: Sequence[str]) -> None:
        self.config, self.types = config, tuple(types)
        env = {k: v for k, v in os.environ.items() if k != "LOCALSPEC_LLAMA_LOG"}
        self.started = time.perf_counter()
        self.process = subprocess.Popen([*CHILD, config, *types],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=env)

    def wait(self) -> KernelVerdict:
        """The child's verdict (it is killed after CHECK_TIMEOUT seconds)."""
        left = max(CHECK_TIMEOUT - (time.perf_counter() - self.started), 0.1)
        try:
            out, err = self.process.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            return KernelVerdict(False, f"no answer within {CHECK_TIMEOUT:.0f} s (a busy machine? checked again on a "
                                  "later run)", time.perf_counter() - self.started, timed_out=True)
        seconds = time.perf_counter() - self.started
        said = out.strip().splitlines()
        if self.process.returncode == 0:
            return KernelVerdict(True, said[-1] if said else "ran", seconds)
        tail = (err.strip().splitlines() or said)[-1:]
        return KernelVerdict(False, _death(self.process.returncode) + (f": {tail[0]}" if tail else ""), seconds)


def run_check(config: str, types: Sequence[str]) -> KernelVerdict:
    """Check a configuration and wait for the verdict (not recorded)."""
    return Check(config, types).wait()
