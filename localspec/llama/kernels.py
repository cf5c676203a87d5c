"""CPU kernels: which of llama.cpp's weight buffer types a model uses, checked before first use.

llama.cpp's CPU backend can move weights into "extra" buffer types whose kernels are faster:
``CPU_REPACK`` (weights re-laid for AVX2/AVX-512/NEON kernels), ``AMX`` (Intel's matrix units,
compiled in by a native build on a CPU that has them), KleidiAI on Arm. On some Intel Xeons the
AMX kernels crash on the first decode (llama.cpp issue 20824), in llama.cpp's own tools too. So
localspec chooses one of these configurations (``--cpu-kernels``, env ``LOCALSPEC_CPU_KERNELS``,
API ``cpu_kernels=``):

* ``llama``: llama.cpp's own choice, every extra buffer type of this build (AMX included);
* ``repack``: ``CPU_REPACK`` for exactly the matrix weights its kernels take on this CPU and no
  other extra buffer type (``use_extra_bufts = false`` plus ``tensor_buft_overrides``);
* ``plain``: no extra buffer type (what ``llama-completion --no-repack`` does);
* ``auto`` (the default): the first of llama, repack, plain that may run here. ``llama`` is a
  candidate only when none of this build's extra buffer types is known to crash, ``repack`` only
  when the model has weights it takes. Measured on an AMD Zen 4 (docs/cpu-kernels.md): the
  repacked kernels decode 15-25 % faster per token and are faster at every pass of up to 16
  tokens (plain ones prefill long prompts faster), and llama.cpp's own choice there is exactly
  the repacked one.

Under ``auto``, a configuration is checked the first time it is used on a machine (again when the
CPU, its flags or the llama.cpp build change): a child process quantizes a tiny model to the
weight types of the model being loaded, decodes with that configuration and compares the logits
with the plain kernels'. A configuration whose child dies (or computes something else) is never
used on that machine again (one that timed out, on a busy machine, is checked again on later runs,
up to TIMEOUT_TRIES times); the verdicts live in ``<profile dir>/kernel-checks``. The child is
``localspec.llama.kernel_check``.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from localspec.errors import ConfigError, ModelError
from localspec.files import STATE_LIMIT, Foreign, StateDir, state_root

log = logging.getLogger(__name__)

KNOWN_CRASHING = {"AMX": "llama.cpp's AMX kernels crash on the first decode on some Intel Xeons "
                         "(llama.cpp issue 20824)"}
REPACK_BUFFER = "CPU_REPACK"
CHECK_TIMEOUT = 180.0  # seconds a check may take before its configuration counts as hanging
TIMEOUT_TRIES = 3  # runs whose check timed out before a configuration counts as hanging for good
FAULT_ENV = "LOCALSPEC_KERNEL_CHECK_FAULT"  # tests: the child dies (SIGSEGV) checking these configurations
CHECK_TOLERANCE = 0.1  # relative RMS difference between a configuration's logits and the plain kernels'
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
    from localspec.llama import backend, ggml

    backend.init()
    lib = ggml.lib()
    dev = lib.ggml_backend_dev_by_type(ggml.DEVICE_CPU)
    if not dev:
        return {}
    get = ggml.proc(lib.ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts",
                    ctypes.POINTER(ctypes.c_void_p), [ctypes.c_void_p])
    if get is None:
        return {}
    array, out = get(dev), {}
    for i in range(64):
        if not array or not array[i]:
            break
        out[lib.ggml_backend_buft_name(array[i]).decode()] = int(array[i])
    return out


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
    from localspec.llama import ggml

    found = ggml.tensors(str(path))
    if found is None:
        raise ModelError(f"llama.cpp could not load {path}: its header or tensor list is damaged or cut short "
                         "(an interrupted download? fetch or copy it again)")
    return tuple(Weight(name, type_name.upper(), dims, rows) for name, type_name, dims, rows in found)


def checked_types(weights: Sequence[Weight]) -> tuple[str, ...]:
    """The weight types a configuration's kernels must be checked on: every type of a matrix
    weight but F32 (which no extra buffer type takes), for which a tiny model can be made."""
    return tuple(sorted({w.type for w in weights if w.matmul and w.type in CHECK_FTYPES}))


def repack_rows(weight_type: str, features: frozenset[str]) -> int | None:
    """The row multiple CPU_REPACK needs for a weight type on this CPU, or None when it takes none.
    (ggml-cpu/repack.cpp, ggml_repack_get_optimal_repack_type, at llama-cpp-python 0.3.36.)"""
    avx2, neon = "AVX2" in features, "NEON" in features
    i8mm, dot = neon and "MATMUL_INT8" in features, neon and "DOTPROD" in features
    if weight_type == "Q4_0":
        return 8 if avx2 else 4 if (i8mm or dot) else None
    if weight_type == "Q4_K":
        return 8 if (avx2 or i8mm or dot) else None
    if weight_type == "Q2_K":
        return 8 if "AVX512" in features else None
    if weight_type in ("Q5_K", "Q6_K"):
        return 8 if (i8mm or dot) else None
    if weight_type in ("IQ4_NL", "MXFP4"):
        return 8 if avx2 else 4 if dot else None
    if weight_type in ("Q8_0", "Q1_0"):
        return 4 if (i8mm or dot) else None
    return None


def repackable(weights: Sequence[Weight], features: frozenset[str]) -> list[Weight]:
    """The weights CPU_REPACK takes on this CPU: matrix weights of a type it has kernels for,
    with a row count its interleave divides."""
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
    parts = [rf"blk\.(?:{'|'.join(sorted(ids, key=int))})\.{re.escape(kind)}\.weight"
             for kind, ids in sorted(blocks.items())]
    return "^(?:" + "|".join(parts + sorted(others)) + ")$"


# ---------------------------------------------------------------- a configuration, ready to load


class _Override(ctypes.Structure):
    """llama.h's struct llama_model_tensor_buft_override."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass(frozen=True)
class KernelPlan:
    """How a model's weights are placed: one configuration, and why it was chosen."""

    config: str  # llama, repack or plain
    reason: str
    pattern: str | None = None  # repack: the weights sent to CPU_REPACK

    @property
    def use_extra_bufts(self) -> bool:
        return self.config == "llama"

    def apply(self, params: Any) -> Any:
        """Set llama_model_params for this plan; returns what must stay alive during the load."""
        params.use_extra_bufts = self.use_extra_bufts
        if self.pattern is None:
            return None
        overrides = (_Override * 2)()
        overrides[0].pattern = self.pattern.encode()
        overrides[0].buft = extra_buffer_types()[REPACK_BUFFER]
        params.tensor_buft_overrides = ctypes.addressof(overrides)
        return overrides


def plan_for(config: str, weights: Sequence[Weight], reason: str = "", gpu_layers: int = 0) -> KernelPlan:
    """A plan for a configuration (llama, repack or plain); repack names only weights that stay
    on the CPU (an override wins over device placement in llama.cpp's loader)."""
    if config == "repack":
        if REPACK_BUFFER not in extra_buffer_types():
            raise ModelError(f"cpu_kernels 'repack': this llama.cpp build has no {REPACK_BUFFER} buffer type "
                             f"(extra buffer types: {', '.join(extra_buffer_types()) or 'none'}); "
                             "use 'plain' or 'auto'")
        names = [w.name for w in repackable(on_cpu(weights, gpu_layers), cpu_features())]
        return KernelPlan("repack", reason or "requested", name_pattern(names) if names else None)
    return KernelPlan(config, reason or "requested")


def crashing_buffer_types() -> list[str]:
    """This build's extra buffer types that are known to crash (KNOWN_CRASHING)."""
    return [name for name in extra_buffer_types() if name in KNOWN_CRASHING]


def candidates(weights: Sequence[Weight], gpu_layers: int = 0) -> list[tuple[str, str]]:
    """The configurations auto may use for these weights, fastest first, each with why."""
    extra = extra_buffer_types()
    crashing = crashing_buffer_types()
    out = []
    if not crashing:
        out.append(("llama", f"llama.cpp's own choice of buffer types: {', '.join(extra) or 'no extra ones'}"))
    if REPACK_BUFFER in extra and repackable(on_cpu(weights, gpu_layers), cpu_features()):
        why = (f"{REPACK_BUFFER}, never {', '.join(crashing)}: {KNOWN_CRASHING[crashing[0]]}"
               if crashing else f"{REPACK_BUFFER} alone")
        out.append(("repack", why))
    out.append(("plain", "no extra buffer types"))
    return out


# ---------------------------------------------------------------- checks in a child process


def host_key() -> str:
    """What a check's verdict depends on besides the configuration: the CPU, its flags and the
    llama.cpp build."""
    from localspec.llama.host import cpuinfo, machine

    ident = {**machine(), "flags": cpuinfo("flags", "Features") or "", "extra": sorted(extra_buffer_types())}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Verdict:
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
        from localspec.llama.host import profile_dir

        self.parent = None if directory is not None else profile_dir()  # created private when absent
        self.path = (directory or profile_dir() / "kernel-checks") / f"{host_key()}.json"
        self._memory: dict[str, Verdict] = {}

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

    def get(self, key: str) -> Verdict | None:
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
            return Verdict(False, f"no answer in time on {tries} runs: taken for a hang", float(seconds))
        return Verdict(ok, detail, float(seconds))

    def put(self, key: str, verdict: Verdict) -> None:
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

    def all(self) -> dict[str, Verdict]:
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


class Check:
    """One configuration checked on tiny models of some weight types, in a child process that
    runs while the caller goes on (a model load overlaps it)."""

    def __init__(self, config: str, types: Sequence[str]) -> None:
        self.config, self.types = config, tuple(types)
        env = {k: v for k, v in os.environ.items() if k != "LOCALSPEC_LLAMA_LOG"}
        self.started = time.perf_counter()
        self.process = subprocess.Popen([sys.executable, "-m", "localspec.llama.kernel_check", config, *types],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=env)

    def wait(self) -> Verdict:
        """The child's verdict (it is killed after CHECK_TIMEOUT seconds)."""
        left = max(CHECK_TIMEOUT - (time.perf_counter() - self.started), 0.1)
        try:
            out, err = self.process.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            return Verdict(False, f"no answer within {CHECK_TIMEOUT:.0f} s (a busy machine? checked again on a "
                                  "later run)", time.perf_counter() - self.started, timed_out=True)
        seconds = time.perf_counter() - self.started
        said = out.strip().splitlines()
        if self.process.returncode == 0:
            return Verdict(True, said[-1] if said else "ran", seconds)
        tail = (err.strip().splitlines() or said)[-1:]
        return Verdict(False, _death(self.process.returncode) + (f": {tail[0]}" if tail else ""), seconds)


def run_check(config: str, types: Sequence[str]) -> Verdict:
    """Check a configuration and wait for the verdict (not recorded)."""
    return Check(config, types).wait()


@dataclass
class PendingPlan:
    """A plan whose configuration is being checked for the first time on this machine: load with
    it, then call confirmed() before the first decode."""

    plan: KernelPlan
    check: Check
    key: str
    checks: Checks
    rejected: list[str]

    def confirmed(self) -> bool:
        verdict = self.check.wait()
        self.checks.put(self.key, verdict)
        if verdict.ok:
            _notice(self.plan, self.check.types, verdict, self.rejected)
        return verdict.ok


def _notice(plan: KernelPlan, types: Sequence[str], verdict: Verdict, rejected: list[str]) -> None:
    """The one line a user reads when a configuration is chosen for the first time."""
    why = f"; not {'; not '.join(rejected)}" if rejected else ""
    log.warning("CPU kernels for %s weights: %s (%s)%s. Checked in a child process in %.1f s, once per machine "
                "and llama.cpp build; --cpu-kernels overrides", "/".join(types), plan.config, plan.reason, why,
                verdict.seconds)


def choose(path: Path, config: str, checks: Checks | None = None, gpu_layers: int = 0) -> KernelPlan | PendingPlan:
    """The plan for loading `path` under `config` (`gpu_layers`: layers that go to other devices):
    settled, or (auto, a configuration not yet checked here) pending on a check just started."""
    if config in ("plain", "llama"):
        return KernelPlan(config, "requested")
    weights = read_weights(path)
    if config != "auto":
        return plan_for(config, weights, gpu_layers=gpu_layers)
    types = checked_types(on_cpu(weights, gpu_layers))
    options = candidates(weights, gpu_layers)
    if not types:  # only F32 matrices on the CPU: no extra buffer type takes them, nothing to check
        name, why = options[0]
        return plan_for(name, weights, why, gpu_layers)
    checks = checks or Checks()
    rejected: list[str] = []
    timed_out = False
    for name, why in options:
        key = check_key(name, types)
        verdict = checks.get(key)
        if verdict is None:
            return PendingPlan(plan_for(name, weights, why, gpu_layers), Check(name, types), key, checks, rejected)
        if verdict.ok:
            return plan_for(name, weights, why, gpu_layers)
        rejected.append(f"{name} ({verdict.detail})")
        timed_out = timed_out or verdict.timed_out
    raise ModelError(no_configuration(path, types, rejected, checks, timed_out))


def no_configuration(path: Path, types: Sequence[str], rejected: Sequence[str], checks: Checks,
                     timed_out: bool = False) -> str:
    """The error when every configuration failed its check: what failed, and how to go on."""
    again = "; checks that timed out run again by themselves on a later run" if timed_out else ""
    return (f"every CPU kernel configuration failed its check on {'/'.join(types)} weights ({'; '.join(rejected)}): "
            f"this llama.cpp build may not run {path.name} on this CPU. To go on, try --cpu-kernels plain "
            f"(llama.cpp's plain kernels, used without a check); to check every configuration again, delete "
            f"{checks.path} (the record of this machine's checks){again}")


def resolve(path: Path, config: str, gpu_layers: int = 0) -> KernelPlan:
    """The settled plan for `path` under `config`, waiting for any check it needs."""
    checks = Checks() if config == "auto" else None
    while True:
        choice = choose(path, config, checks, gpu_layers)
        if isinstance(choice, KernelPlan):
            return choice
        if choice.confirmed():
            return choice.plan
