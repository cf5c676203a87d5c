"""``localspec info``: versions, llama.cpp build and devices, the native verifier, the cache."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import sys
from importlib import metadata
from typing import Any

import click

from localspec import __version__

log = logging.getLogger(__name__)

# ggml's enum ggml_backend_dev_type
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpus() -> dict:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_count": os.cpu_count(), "usable_cpus": usable}


# ---------------------------------------------------------------- llama.cpp


def _ggml_functions() -> Any:
    """An object with the ggml_backend_dev_* functions: llama_cpp's bindings when it has them,
    else the ggml shared library that llama_cpp loaded, with ctypes signatures set here."""
    import llama_cpp

    if hasattr(llama_cpp, "ggml_backend_dev_count") and hasattr(llama_cpp, "ggml_backend_dev_get"):
        return llama_cpp
    from llama_cpp import _ggml  # llama-cpp-python's handle on libggml

    lib = _ggml.libggml
    names = ("ggml_backend_dev_count", "ggml_backend_dev_get", "ggml_backend_dev_name",
             "ggml_backend_dev_description", "ggml_backend_dev_type", "ggml_backend_dev_memory")
    if not all(hasattr(lib, n) for n in names):
        return None
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_count.argtypes = []
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.restype = None
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    return lib


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def backend_devices() -> list[dict] | str:
    """The ggml backend devices (name, description, type, memory), or why they are unknown."""
    try:
        g = _ggml_functions()
        if g is None:
            return "this llama-cpp-python build exposes no ggml_backend_dev_* functions"
        devices = []
        for i in range(int(g.ggml_backend_dev_count())):
            dev = g.ggml_backend_dev_get(i)
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            kind = int(g.ggml_backend_dev_type(dev))
            devices.append({"name": _text(g.ggml_backend_dev_name(dev)),
                            "description": _text(g.ggml_backend_dev_description(dev)),
                            "type": DEVICE_TYPES.get(kind, str(kind)),
                            "memory_free": int(free.value), "memory_total": int(total.value)})
        return devices
    except Exception as exc:  # a binding mismatch must not break `info`
        log.debug("listing ggml devices failed", exc_info=True)
        return f"could not list devices: {exc}"


def llama_info() -> dict:
    """llama-cpp-python's version, llama.cpp's system info, GPU offload and devices."""
    try:
        import llama_cpp

        from localspec.model import _init_backend
    except Exception as exc:  # the shared library failed to load
        return {"error": f"cannot load llama-cpp-python: {exc}"}
    _init_backend()  # quiets llama.cpp's log and registers the backends
    return {"version": getattr(llama_cpp, "__version__", _version("llama-cpp-python")),
            "system_info": _text(llama_cpp.llama_print_system_info()).strip().rstrip("|").strip(),
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
            "devices": backend_devices()}


# ---------------------------------------------------------------- the native verifier


def verifier_self_test() -> str | None:
    """Verify one tiny chain at temperature 0 whose draft is the target's argmax: the verifier
    must accept every node and add the argmax after the last one. None when it does; else why."""
    import numpy as np

    from localspec import verifier
    from localspec.config import SamplingParams

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
    from localspec import rpc

    out: dict = {"available": rpc.available()}
    if endpoints:
        try:
            out["servers"] = rpc.describe(endpoints)
        except Exception as exc:  # an unreachable server must not break `info`
            out["error"] = str(exc)
    return out


def collect(endpoints: tuple[str, ...] = ()) -> dict:
    from localspec import registry
    from localspec.profiles import STORE

    return {
        "localspec": __version__,
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": {"system": platform.platform(), "machine": platform.machine(), **_cpus()},
        "llama_cpp": llama_info(),
        "verifier": native_info(),
        "packages": {name: _version(name) for name in ("numpy", "cffi", "click", "jinja2")},
        "cache": {"dir": str(registry.cache_dir()), "from_env": bool(os.environ.get(registry.CACHE_ENV))},
        "profiles": {"dir": str(STORE.directory), "count": len(STORE.on_disk())},
        "rpc": rpc_info(endpoints),
    }


def _devices_lines(devices: list[dict] | str) -> list[str]:
    if isinstance(devices, str):
        return [f"  {devices}"]
    if not devices:
        return ["  none"]
    gib = 1024 ** 3
    return [f"  {d['name']} ({d['type']}): {d['description']}, "
            f"{d['memory_free'] / gib:.1f} / {d['memory_total'] / gib:.1f} GiB free" for d in devices]


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
    status = ver["self_test"] + (f" ({ver['error']})" if "error" in ver else "")
    lines += [f"native verifier  {ver['path'] or 'missing'}",
              f"  self-test      {status}",
              "packages         " + ", ".join(f"{k} {v or 'not installed'}" for k, v in info["packages"].items()),
              f"model cache      {info['cache']['dir']}" + (" (from $LOCALSPEC_CACHE_DIR)" if info["cache"]["from_env"]
                                                          else ""),
              f"cost profiles    {info['profiles']['count']} in {info['profiles']['dir']} (`localspec profiles list`)"]
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
@click.option("--rpc", envvar="LOCALSPEC_RPC", default=None, metavar="HOST:PORT[,...]",
              help="Also list the devices of these RPC servers (env LOCALSPEC_RPC).")
def info(as_json: bool, rpc: str | None) -> None:
    """Versions, the llama.cpp build and its devices, the native verifier, the model cache.

    Useful in bug reports. Exit status 1 when the native verifier fails its
    self-test.

    \b
    localspec info
    localspec info --json
    localspec info --rpc 192.168.1.20:50052
    """
    from localspec.config import parse_endpoints
    from localspec.errors import ConfigError

    try:
        endpoints = parse_endpoints(rpc)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--rpc") from None
    data = collect(endpoints)
    click.echo(json.dumps(data, indent=2) if as_json else render(data))
    if data["verifier"]["self_test"] != "ok":
        raise SystemExit(1)


COMMANDS = (info,)
