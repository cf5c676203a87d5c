"""llama.cpp's RPC backend: a target's layers on other machines, and the server that hosts them.

llama-cpp-python's bindings expose no RPC calls, so they are reached through ctypes on the
libraries it bundles (their signatures in :mod:`localspec.llama.compat`):
``ggml_backend_reg_by_name("RPC")`` tells whether the build has the RPC backend
(``CMAKE_ARGS="-DGGML_RPC=on"``), its ``ggml_backend_rpc_add_server`` registers a server's
devices, and a model's ``llama_model_params.devices`` (a NULL-terminated device list) says where
its layers go — every registered device when NULL, so models that must stay local get an
explicit list. ``ggml_backend_rpc_start_server`` serves this machine's CPU.

llama.cpp aborts the process when an RPC server stops answering mid-computation. localspec turns
that into a clear message and a clean exit (:func:`on_fatal` hooks print what was generated
first), and bounds a remote decode in time so a server that hangs cannot hang the client.
Upstream calls RPC insecure: no authentication, no encryption. Keep servers on loopback or a
trusted network.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Sequence

from localspec.errors import DependencyError, RemoteError, exit_code
from localspec.llama import compat
from localspec.settings import environment

log = logging.getLogger(__name__)

EXIT_REMOTE = exit_code(RemoteError)  # exit status after a remote device failed (localspec.errors.EXIT_CODES)
CONNECT_TIMEOUT = 3.0  # seconds to reach a server before loading
TIMEOUT_ENV = "LOCALSPEC_RPC_TIMEOUT"  # seconds one remote decode may take before the server counts as gone
DECODE_TIMEOUT = environment.VARIABLES[TIMEOUT_ENV].default  # ... by default (120 s)
REBUILD_PREFIX = 'CMAKE_ARGS="-DGGML_RPC=on" pip install --no-cache-dir --force-reinstall'

_lock = threading.Lock()
_servers: dict[str, list[int]] = {}  # endpoint -> its registered device pointers (ggml's registry is process-wide)
_abort_callback = None  # keeps the ctypes callback alive


class FatalHooks:
    """What runs before the process exits on a remote failure (llama.cpp's abort callback is one
    per process, so this is too: :data:`FATAL_HOOKS`): each hook saves what it can (the command
    line prints the text generated so far)."""

    def __init__(self) -> None:
        self._hooks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()

    def add(self, hook: Callable[[str], None]) -> Callable[[], None]:
        """Run `hook(message)` before such an exit; returns what removes it."""
        with self._lock:
            self._hooks.append(hook)

        def remove() -> None:
            with self._lock:
                if hook in self._hooks:
                    self._hooks.remove(hook)

        return remove

    def run(self, message: str) -> None:
        with self._lock:
            hooks = list(self._hooks)
        for hook in hooks:
            try:
                hook(message)
            except Exception:  # noqa: BLE001 - the exit must happen
                log.exception("a fatal-error hook failed")


FATAL_HOOKS = FatalHooks()


# ---------------------------------------------------------------- the libraries


@functools.cache
def rebuild_command() -> str:
    """The command that rebuilds the installed llama-cpp-python version with the RPC backend."""
    from importlib.metadata import version

    return f'{REBUILD_PREFIX} "llama-cpp-python=={version("llama-cpp-python")}"'


def _reg() -> int | None:
    return compat.lib().ggml_backend_reg_by_name(b"RPC")


def available() -> bool:
    """Does this llama-cpp-python build have the RPC backend?"""
    try:
        return bool(_reg())
    except (OSError, AttributeError):
        return False


def require() -> int:
    reg = _reg() if available() else None
    if not reg:
        raise DependencyError("this llama-cpp-python build has no RPC backend; rebuild it with:\n  "
                              + rebuild_command())
    return reg


def _proc(name: str) -> Callable:
    fn = compat.proc(require(), name)
    if fn is None:
        raise DependencyError(f"this llama.cpp RPC backend has no {name}; rebuild it with:\n  "
                              + rebuild_command())
    return fn


# ---------------------------------------------------------------- the client side


def _reachable(endpoint: str) -> None:
    host, port = endpoint.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise RemoteError(f"cannot reach the RPC server at {endpoint}: {exc.strerror or exc}; start one there with "
                          f"`localspec rpc-server --host {host.strip('[]')} --port {port}`", status=503) from None


def decode_timeout() -> float:
    """Seconds one remote decode may take: $LOCALSPEC_RPC_TIMEOUT (ConfigError naming it when
    bad), else DECODE_TIMEOUT."""
    return environment.get(TIMEOUT_ENV)


def devices(endpoints: Sequence[str]) -> list[int]:
    """The devices of these servers, registered once per process (in endpoint order); the decode
    time limit is read first, so a bad one is refused before anything loads."""
    decode_timeout()
    out: list[int] = []
    with _lock:
        for endpoint in endpoints:
            if endpoint not in _servers:
                _reachable(endpoint)
                add_server = _proc("ggml_backend_rpc_add_server")
                reg = add_server(endpoint.encode())
                g = compat.lib()
                found = [g.ggml_backend_reg_dev_get(reg, i) for i in range(g.ggml_backend_reg_dev_count(reg))] \
                    if reg else []
                if not found:
                    raise RemoteError(f"the RPC server at {endpoint} offers no device (a protocol mismatch? both "
                                     "sides need the same llama.cpp RPC version)")
                g.ggml_backend_register(reg)
                _servers[endpoint] = found
                install_abort_handler()
            out += _servers[endpoint]
    return out


def in_use() -> bool:
    """Are RPC servers registered in this process (so local models need an explicit device list)?"""
    return bool(_servers)


def local_devices() -> list[int]:
    """Offload devices of this machine (GPUs; not the CPU, not RPC servers)."""
    g = compat.lib()
    out = []
    for i in range(g.ggml_backend_dev_count()):
        dev = g.ggml_backend_dev_get(i)
        reg_name = (g.ggml_backend_reg_name(g.ggml_backend_dev_backend_reg(dev)) or b"").decode()
        if g.ggml_backend_dev_type(dev) != compat.DEVICE_CPU and reg_name != "RPC":
            out.append(dev)
    return out


def device_array(devices: Sequence[int]) -> ctypes.Array:
    """A NULL-terminated ggml_backend_dev_t array (keep it alive while the model loads)."""
    return (ctypes.c_void_p * (len(devices) + 1))(*devices, None)


def describe(endpoints: Sequence[str]) -> list[dict]:
    """Name, description and memory of each server's devices (for `localspec info`)."""
    g = compat.lib()
    out = []
    for endpoint in endpoints:
        for dev in devices([endpoint]):
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            out.append({"endpoint": endpoint, "name": (g.ggml_backend_dev_name(dev) or b"").decode(),
                        "description": (g.ggml_backend_dev_description(dev) or b"").decode(),
                        "memory_free": free.value, "memory_total": total.value})
    return out


# ---------------------------------------------------------------- when a server goes away


def on_fatal(hook: Callable[[str], None]) -> Callable[[], None]:
    """Run `hook(message)` before the process exits on a remote failure (FATAL_HOOKS); returns
    what removes it."""
    return FATAL_HOOKS.add(hook)


def fatal(message: str) -> None:
    """Report a remote failure, let the hooks save what was generated, exit with EXIT_REMOTE."""
    FATAL_HOOKS.run(message)
    sys.stdout.flush()
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_REMOTE)


def install_abort_handler() -> None:
    """Turn llama.cpp's abort on a broken RPC connection into fatal() (a clean exit)."""
    global _abort_callback
    if _abort_callback is not None:
        return
    def handler(text: bytes | None) -> None:
        detail = (text or b"").decode("utf-8", "replace").strip()
        detail = re.sub(r"^\S+:\d+: ", "", detail)  # llama.cpp's "file:line: " prefix
        if "rpc" in detail.lower() or _servers:
            fatal(f"a remote device stopped answering ({detail or 'llama.cpp aborted'}); the text above is what "
                  "was generated before it did")
        sys.stderr.write(f"llama.cpp aborted: {detail}\n")

    _abort_callback = compat.ABORT_CALLBACK(handler)
    compat.lib().ggml_set_abort_callback(_abort_callback)


class DecodeWatch:
    """Bounds one remote decode: if it has not returned after decode_timeout() seconds, the server
    counts as gone (a hung server or a cut network) and the process exits through fatal()."""

    def __init__(self, endpoints: Sequence[str], timeout: float | None = None) -> None:
        self.endpoints = endpoints
        self.timeout = timeout or decode_timeout()
        self._timer: threading.Timer | None = None

    def __enter__(self) -> DecodeWatch:
        self._timer = threading.Timer(self.timeout, fatal, args=(
            f"the RPC server(s) {', '.join(self.endpoints)} did not answer within {self.timeout:g} s; the text "
            "above is what was generated before",))
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()


# ---------------------------------------------------------------- the server side


def serve(host: str, port: int, threads: int, cache_dir: str | None) -> None:
    """Serve this machine's CPU to RPC clients (blocks until the process ends)."""
    from localspec.llama import backend

    backend.init()
    require()
    start = _proc("ggml_backend_rpc_start_server")
    cpu = compat.lib().ggml_backend_dev_by_type(compat.DEVICE_CPU)
    devs = (ctypes.c_void_p * 1)(cpu)
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    start(endpoint.encode(), os.fsencode(cache_dir) if cache_dir else None, threads, 1, devs)
