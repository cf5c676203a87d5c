"""``localspec info``: versions, llama.cpp build and devices, the native verifier, the cache."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import click

from localspec import __version__
from localspec.cli.options import EnvOption
from localspec.errors import CheckFailed, exit_code
from localspec.settings import environment
from localspec.settings.models import CPU_KERNELS, MODEL_DEFAULTS

log = logging.getLogger(__name__)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpus() -> dict:
    from localspec.llama.host import usable_cores

    return {"cpu_count": os.cpu_count(), "usable_cpus": usable_cores()}


# ---------------------------------------------------------------- llama.cpp


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def backend_devices() -> list[dict] | str:
    """The ggml backend devices (name, description, type, memory), or why they are unknown."""
    try:
        from localspec.llama import compat

        g = compat.lib()
        devices = []
        for i in range(int(g.ggml_backend_dev_count())):
            dev = g.ggml_backend_dev_get(i)
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            dev_type = int(g.ggml_backend_dev_type(dev))
            devices.append({"name": _text(g.ggml_backend_dev_name(dev)),
                            "description": _text(g.ggml_backend_dev_description(dev)),
                            "type": compat.DEVICE_TYPES.get(dev_type, str(dev_type)),
                            "memory_free": int(free.value), "memory_total": int(total.value)})
        return devices
    except Exception as exc:  # a binding mismatch must not break `info`
        log.debug("listing ggml devices failed", exc_info=True)
        return f"could not list devices: {exc}"


def llama_info() -> dict:
    """llama-cpp-python's version, llama.cpp's system info, GPU offload and devices."""
    try:
        import llama_cpp

        from localspec.llama import backend
    except Exception as exc:  # the shared library failed to load
        return {"error": f"cannot load llama-cpp-python: {exc}"}
    backend.init()  # quiets llama.cpp's log and registers the backends
    return {"version": getattr(llama_cpp, "__version__", _version("llama-cpp-python")),
            "system_info": _text(llama_cpp.llama_print_system_info()).strip().rstrip("|").strip(),
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
            "devices": backend_devices()}


def kernels_info(model: str | None, cpu_kernels: str, n_gpu_layers: int = 0) -> dict:
    """The CPU's extra weight buffer types, the kernel checks recorded on this machine, and
    (with a model) the configuration and weight buffer types that model gets."""
    from localspec.llama import buffer_types, kernel_verdicts

    loaded = model_buffers(model, cpu_kernels, n_gpu_layers) if model is not None else None  # may record a check
    out: dict = {"extra_buffer_types": list(buffer_types.extra_buffer_types()),
                 "known_to_crash": {k: buffer_types.KNOWN_CRASHING[k] for k in buffer_types.crashing_buffer_types()},
                 "checks": {key: {"ok": v.ok, "detail": v.detail, "seconds": round(v.seconds, 2)}
                            for key, v in kernel_verdicts.Checks().all().items()}}
    if loaded is not None:
        out["model"] = loaded
    return out


def model_buffers(name: str, cpu_kernels: str, n_gpu_layers: int = 0) -> dict:
    """Load a model (a tiny context) with n_gpu_layers offloaded and report where llama.cpp put its weights."""
    from localspec.errors import LocalspecError
    from localspec.llama import registry
    from localspec.llama.model import Model
    from localspec.settings.models import ModelOptions

    try:
        path = registry.resolve(name)
        with Model(path, ModelOptions(ctx_size=64, batch_size=16, n_seq_max=1, cpu_kernels=cpu_kernels,
                                      n_gpu_layers=n_gpu_layers)) as m:
            chosen = m.kernels
            return {"path": str(path), "cpu_kernels": cpu_kernels, "n_gpu_layers": n_gpu_layers,
                    "config": chosen.config if chosen else None,
                    "reason": chosen.reason if chosen else None, "weight_buffers_mib": m.weight_buffers}
    except LocalspecError as exc:
        return {"path": name, "cpu_kernels": cpu_kernels, "error": str(exc)}


def default_target_if_cached() -> str | None:
    """The default pair's target when it is already on disk (info never downloads)."""
    from localspec.llama import registry

    try:
        reg = registry.load_registry()
        name = reg.pairs[reg.default_pair].target
        return name if registry.cached_path(name) is not None else None
    except Exception:  # a broken registry must not break `info`
        log.debug("no default target", exc_info=True)
        return None


# ---------------------------------------------------------------- the native verifier


def verifier_self_test() -> str | None:
    """Verify one tiny chain at temperature 0 whose draft is the target's argmax: the verifier
    must accept every node and add the argmax after the last one. None when it does; else why."""
    import numpy as np

    from localspec.settings.sampling import SamplingParams
    from localspec.verify import verifier

    logits = np.array([[0.0, 3.0, 1.0, 0.0], [0.0, 0.0, 0.0, 4.0],
                       [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0]], dtype=np.float32)
    draft = np.eye(4, dtype=np.float32)[[1, 3, 0, 0]]  # one-hot: the draft proposed 1, 3, 0
    expected = ((0, 1, 2), 2)
    for method in ("block", "traversal"):
        v = verifier.verify(method, logits, draft, [1, 3, 0], [-1, 0, 1], sampling=SamplingParams(0.0), seed=0)
        if (v.path, v.token) != expected:
            return f"{method}: accepted {v.path} + {v.token}, expected {expected[0]} + {expected[1]}"
    return None


def native_info() -> dict:
    """Where the native verifier module lives and whether it passes the self-test."""
    try:
        from localspec import _verifier
    except ImportError as exc:
        return {"path": None, "self_test": "failed", "error": f"cannot import localspec._verifier: {exc} "
                "(reinstall localspec: pip install -e . builds it)"}
    out: dict = {"path": getattr(_verifier, "__file__", None)}
    try:
        problem = verifier_self_test()
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    out["self_test"] = "ok" if problem is None else "failed"
    if problem is not None:
        out["error"] = problem
    return out


# ---------------------------------------------------------------- the report


def rpc_info(endpoints: tuple[str, ...]) -> dict:
    """Whether the build has the RPC backend, and the given servers' devices."""
    from localspec.llama import rpc

    out: dict = {"available": rpc.available()}
    if endpoints:
        try:
            out["servers"] = rpc.describe(endpoints)
        except Exception as exc:  # an unreachable server must not break `info`
            out["error"] = str(exc)
    return out


def collect(endpoints: tuple[str, ...] = (), model: str | None = None, cpu_kernels: str = "auto",
            n_gpu_layers: int = 0) -> dict:
    from localspec.decoding.profiles import Profiles
    from localspec.llama import registry
    from localspec.llama.prompt_cache import PromptCache

    store = Profiles()
    prompts = PromptCache.from_setting(None)
    llama = llama_info()
    return {
        "localspec": __version__,
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": {"system": platform.platform(), "machine": platform.machine(), **_cpus()},
        "llama_cpp": llama,
        "cpu_kernels": kernels_info(model, cpu_kernels, n_gpu_layers) if "error" not in llama else {},
        "verifier": native_info(),
        "packages": {name: _version(name) for name in ("numpy", "cffi", "click", "jinja2")},
        "cache": {"dir": str(registry.cache_dir()), "from_env": environment.is_set(registry.CACHE_ENV)},
        "profiles": {"dir": str(store.directory), "count": len(store.on_disk())},
        "prompt_cache": ({"enabled": False} if prompts is None else
                         {"enabled": True, "dir": str(prompts.root), "bytes": prompts.size(), "limit": prompts.limit}),
        "rpc": rpc_info(endpoints),
        "resident": resident_info(),
    }


def resident_info() -> dict:
    """The keep-alive a call gets here and the models the resident service keeps loaded (the
    core's status, as `localspec ps` shows it)."""
    from localspec.core.status import rows
    from localspec.resident import control
    from localspec.settings import locations

    keep = environment.get("LOCALSPEC_KEEP_ALIVE")
    return {"keep_alive_seconds": keep, "keep_alive_from_env": environment.is_set("LOCALSPEC_KEEP_ALIVE"),
            "max_loaded": environment.get("LOCALSPEC_MAX_LOADED"), "runtime_dir": str(locations.runtime_dir()),
            "models": rows([state for _, state in control.services()])}


def _prompt_cache_line(cache: dict) -> str:
    if not cache["enabled"]:
        return "prompt cache     off"
    return (f"prompt cache     {cache['bytes'] / 2**20:.1f} MB of {cache['limit'] / 2**20:.0f} MB in {cache['dir']} "
            "(`localspec cache list`)")


def _devices_lines(devices: list[dict] | str) -> list[str]:
    if isinstance(devices, str):
        return [f"  {devices}"]
    if not devices:
        return ["  none"]
    gib = 1024 ** 3
    return [f"  {d['name']} ({d['type']}): {d['description']}, "
            f"{d['memory_free'] / gib:.1f} / {d['memory_total'] / gib:.1f} GiB free" for d in devices]


def _kernels_lines(k: dict) -> list[str]:
    if not k:
        return []
    lines = ["CPU kernels      extra weight buffer types: " + (", ".join(k["extra_buffer_types"]) or "none")]
    lines += [f"  {name}: {why}; --cpu-kernels auto never uses it" for name, why in k["known_to_crash"].items()]
    for key, v in sorted(k["checks"].items()):
        config, types = key.split(":", 1)
        lines.append(f"  checked {config} on {types.replace(',', '/')} weights: "
                     f"{'ok' if v['ok'] else 'REJECTED'} ({v['detail']})")
    m = k.get("model")
    if m is None:
        lines.append("  (pass -m MODEL to see where a model's weights go)")
    elif "error" in m:
        lines.append(f"  {m['path']}: {m['error']}")
    else:
        buffers = ", ".join(f"{name} {mib:.0f} MiB" for name, mib in sorted(m["weight_buffers_mib"].items()))
        gpu = f" --n-gpu-layers {m['n_gpu_layers']}" if m.get("n_gpu_layers") else ""
        lines.append(f"  {Path(m['path']).name} with --cpu-kernels {m['cpu_kernels']}{gpu}: {m['config']} "
                     f"({m['reason']}); weights in {buffers}")
    return lines


def render(info: dict) -> str:
    lc, ver = info["llama_cpp"], info["verifier"]
    p = info["platform"]
    lines = [
        f"localspec        {info['localspec']}",
        f"python           {info['python']['version']} ({info['python']['implementation']}, "
        f"{info['python']['executable']})",
        f"platform         {p['system']} ({p['machine']}), {p['usable_cpus']} of {p['cpu_count']} CPUs usable",
    ]
    if "error" in lc:
        lines.append(f"llama-cpp-python {lc['error']}")
    else:
        lines += [f"llama-cpp-python {lc['version']}",
                  f"llama.cpp        {lc['system_info']}",
                  f"GPU offload      {'supported' if lc['gpu_offload'] else 'not supported by this build (CPU only)'}",
                  "devices:", *_devices_lines(lc["devices"])]
    lines += _kernels_lines(info.get("cpu_kernels") or {})
    status = ver["self_test"] + (f" ({ver['error']})" if "error" in ver else "")
    lines += [f"native verifier  {ver['path'] or 'missing'}",
              f"  self-test      {status}",
              "packages         " + ", ".join(f"{k} {v or 'not installed'}" for k, v in info["packages"].items()),
              f"model cache      {info['cache']['dir']}" + (" (from $LOCALSPEC_CACHE_DIR)" if info["cache"]["from_env"]
                                                          else ""),
              f"cost profiles    {info['profiles']['count']} in {info['profiles']['dir']} (`localspec profiles list`)",
              _prompt_cache_line(info["prompt_cache"])]
    from localspec.core.status import table_of_rows

    res = info["resident"]
    keep = environment.format_duration(res["keep_alive_seconds"])
    lines.append(f"resident models  kept loaded {keep} after a call"
                 + (" (from $LOCALSPEC_KEEP_ALIVE)" if res["keep_alive_from_env"] else "")
                 + ("" if res["keep_alive_seconds"] else " (off: every call loads its models)")
                 + f", at most {res['max_loaded']} pairs; sockets in {res['runtime_dir']}")
    lines += ["  " + line for line in table_of_rows(res["models"])]
    r = info["rpc"]
    lines.append("RPC backend      " + ("available" if r["available"] else "not in this build (rebuild with "
                                                                           "CMAKE_ARGS=-DGGML_RPC=on)"))
    if "error" in r:
        lines.append(f"  {r['error']}")
    for d in r.get("servers", []):
        lines.append(f"  {d['endpoint']}: {d['name']} ({d['description']}), "
                     f"{d['memory_free'] / 1024 ** 3:.1f} / {d['memory_total'] / 1024 ** 3:.1f} GiB free")
    return "\n".join(lines)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--rpc", cls=EnvOption, envvar="LOCALSPEC_RPC", default=None, metavar="HOST:PORT[,...]",
              help="Also list the devices of these RPC servers (env LOCALSPEC_RPC).")
@click.option("-m", "--model", default=None, metavar="GGUF|NAME",
              help="Load this model and show which weight buffer types it gets (default: the default "
                   "pair's target when it is cached; 'none': no model).")
@click.option("--cpu-kernels", type=click.Choice(CPU_KERNELS), default=MODEL_DEFAULTS.cpu_kernels,
              show_default=True, cls=EnvOption, envvar="LOCALSPEC_CPU_KERNELS",
              help="The configuration to load it with.")
@click.option("--n-gpu-layers", type=click.IntRange(min=-1, max=2**31 - 1), default=0, show_default=True,
              help="Layers of that model to offload to the GPU (-1: all), to see where its weights go.")
def info(as_json: bool, rpc: str | None, model: str | None, cpu_kernels: str, n_gpu_layers: int) -> None:
    """Versions, the llama.cpp build and its devices, CPU kernels, the native verifier, the model cache.

    Useful in bug reports. Shows llama.cpp's extra weight buffer types (AMX,
    CPU_REPACK), the kernel checks recorded on this machine, and where a
    model's weights go. Exit status 1 when the native verifier fails its
    self-test.

    \b
    localspec info
    localspec info --json
    localspec info -m model.gguf --cpu-kernels llama
    localspec info -m model.gguf --n-gpu-layers -1
    localspec info --rpc 192.168.1.20:50052
    """
    from localspec.settings.endpoints import parse_endpoints

    endpoints = parse_endpoints(rpc)  # ConfigError naming --rpc (and $LOCALSPEC_RPC where it came from)
    if model is None:
        model = default_target_if_cached()
    elif model.lower() == "none":
        model = None
    data = collect(endpoints, model, cpu_kernels, n_gpu_layers)
    click.echo(json.dumps(data, indent=2) if as_json else render(data))
    if data["verifier"]["self_test"] != "ok":
        raise SystemExit(exit_code(CheckFailed))

