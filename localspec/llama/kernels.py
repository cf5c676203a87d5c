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
up to TIMEOUT_TRIES times); the verdicts live in ``<profile dir>/kernel-checks``
(``localspec.llama.kernel_verdicts``). The child is ``localspec.llama.kernel_check``. What this
build and CPU offer, and a model's weights, come from ``localspec.llama.buffer_types``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from localspec.errors import ModelError
from localspec.llama import buffer_types, kernel_verdicts
from localspec.llama.buffer_types import REPACK_BUFFER, Weight
from localspec.llama.kernel_verdicts import Checks, KernelVerdict

log = logging.getLogger(__name__)

Loaded = TypeVar("Loaded")


# ---------------------------------------------------------------- a configuration, ready to load


class _Override(ctypes.Structure):
    """llama.h's struct llama_model_tensor_buft_override."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass(frozen=True)
class KernelChoice:
    """How a model's weights are placed: one configuration, and why it was chosen."""

    config: str  # llama, repack or plain
    reason: str
    pattern: str | None = None  # repack: the weights sent to CPU_REPACK

    @property
    def use_extra_bufts(self) -> bool:
        return self.config == "llama"

    def apply(self, params: Any) -> Any:
        """Set llama_model_params for this choice; returns what must stay alive during the load."""
        params.use_extra_bufts = self.use_extra_bufts
        if self.pattern is None:
            return None
        overrides = (_Override * 2)()
        overrides[0].pattern = self.pattern.encode()
        overrides[0].buft = buffer_types.extra_buffer_types()[REPACK_BUFFER]
        params.tensor_buft_overrides = ctypes.addressof(overrides)
        return overrides


def choice_for(config: str, weights: Sequence[Weight], reason: str = "", gpu_layers: int = 0) -> KernelChoice:
    """The choice of a configuration (llama, repack or plain); repack names only weights that stay
    on the CPU (an override wins over device placement in llama.cpp's loader)."""
    if config == "repack":
        extra = buffer_types.extra_buffer_types()
        if REPACK_BUFFER not in extra:
            raise ModelError(f"cpu_kernels 'repack': this llama.cpp build has no {REPACK_BUFFER} buffer type "
                             f"(extra buffer types: {', '.join(extra) or 'none'}); use 'plain' or 'auto'")
        names = [w.name for w in buffer_types.repackable(buffer_types.on_cpu(weights, gpu_layers),
                                                          buffer_types.cpu_features())]
        return KernelChoice("repack", reason or "requested", buffer_types.name_pattern(names) if names else None)
    return KernelChoice(config, reason or "requested")


def candidates(weights: Sequence[Weight], gpu_layers: int = 0) -> list[tuple[str, str]]:
    """The configurations auto may use for these weights, fastest first, each with why."""
    extra = buffer_types.extra_buffer_types()
    crashing = buffer_types.crashing_buffer_types()
    out = []
    if not crashing:
        out.append(("llama", f"llama.cpp's own choice of buffer types: {', '.join(extra) or 'no extra ones'}"))
    if REPACK_BUFFER in extra and buffer_types.repackable(buffer_types.on_cpu(weights, gpu_layers),
                                                          buffer_types.cpu_features()):
        why = (f"{REPACK_BUFFER}, never {', '.join(crashing)}: {buffer_types.KNOWN_CRASHING[crashing[0]]}"
               if crashing else f"{REPACK_BUFFER} alone")
        out.append(("repack", why))
    out.append(("plain", "no extra buffer types"))
    return out


# ---------------------------------------------------------------- auto's choice


@dataclass
class PendingChoice:
    """A choice whose configuration is being checked for the first time on this machine: load with
    it, then call confirmed() before the first decode."""

    candidate: KernelChoice
    check: kernel_verdicts.Check
    key: str
    checks: Checks
    rejected: list[str]

    def confirmed(self) -> bool:
        verdict = self.check.wait()
        self.checks.put(self.key, verdict)
        if verdict.ok:
            _notice(self.candidate, self.check.types, verdict, self.rejected)
        return verdict.ok


def _notice(choice: KernelChoice, types: Sequence[str], verdict: KernelVerdict, rejected: list[str]) -> None:
    """The one line a user reads when a configuration is chosen for the first time."""
    why = f"; not {'; not '.join(rejected)}" if rejected else ""
    log.warning("CPU kernels for %s weights: %s (%s)%s. Checked in a child process in %.1f s, once per machine "
                "and llama.cpp build; --cpu-kernels overrides", "/".join(types), choice.config, choice.reason, why,
                verdict.seconds)


def choose(path: Path, config: str, checks: Checks | None = None, gpu_layers: int = 0) -> KernelChoice | PendingChoice:
    """The choice for loading `path` under `config` (`gpu_layers`: layers that go to other devices):
    settled, or (auto, a configuration not yet checked here) pending on a check just started."""
    if config in ("plain", "llama"):
        return KernelChoice(config, "requested")
    weights = buffer_types.read_weights(path)
    if config != "auto":
        return choice_for(config, weights, gpu_layers=gpu_layers)
    types = buffer_types.checked_types(buffer_types.on_cpu(weights, gpu_layers))
    options = candidates(weights, gpu_layers)
    if not types:  # only F32 matrices on the CPU: no extra buffer type takes them, nothing to check
        name, why = options[0]
        return choice_for(name, weights, why, gpu_layers)
    checks = checks or Checks()
    rejected: list[str] = []
    timed_out = False
    for name, why in options:
        key = kernel_verdicts.check_key(name, types)
        verdict = checks.get(key)
        if verdict is None:
            check = kernel_verdicts.Check(name, types)
            return PendingChoice(choice_for(name, weights, why, gpu_layers), check, key, checks, rejected)
        if verdict.ok:
            return choice_for(name, weights, why, gpu_layers)
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


def resolve(path: Path, config: str, gpu_layers: int = 0) -> KernelChoice:
    """The settled choice for `path` under `config`, waiting for any check it needs."""
    checks = Checks() if config == "auto" else None
    while True:
        choice = choose(path, config, checks, gpu_layers)
        if isinstance(choice, KernelChoice):
            return choice
        if choice.confirmed():
            return choice.candidate


def load_checked(path: Path, config: str, gpu_layers: int, load: Callable[[KernelChoice], Loaded],
                 free: Callable[[Loaded], None]) -> tuple[Loaded, KernelChoice]:
    """Load `path` (`load`: llama.cpp's load of the weights under a choice) with the choice for `config`.
    A configuration checked for the first time on this machine is checked in a child process
    while the weights load; should the check fail, the loaded weights are freed (`free`) and
    loaded again with the next configuration, before anything is decoded."""
    choice = choose(path, config, gpu_layers=gpu_layers)
    pending = choice if isinstance(choice, PendingChoice) else None
    chosen = choice.candidate if isinstance(choice, PendingChoice) else choice
    try:
        loaded = load(chosen)
    except BaseException:
        if pending is not None:
            pending.confirmed()  # the check's verdict holds whatever became of this load
        raise
    if pending is not None and not pending.confirmed():
        free(loaded)
        chosen = resolve(path, config, gpu_layers)  # the next configuration
        loaded = load(chosen)
    return loaded, chosen
