"""The GPU check's build (benchmarks/gpu/check.py): from the bundle, offline, into WORK.

1. bundle     the manifest and checksums; the trimmed llama-cpp-python source extracted (once)
2. toolchain  cmake, ninja, a C compiler; with CUDA: nvcc, the card's compute capability, cuBLAS
              (the toolkit's, else the pip package nvidia-cublas that PyTorch images carry)
3. venv       WORK/venv, which also sees the packages of the Python that runs the check (a .pth)
4. wheels     the bundle's wheels, installed into it (--no-index --no-deps)
5. localspec  this working tree, editable (builds the C verifier)
6. llama_cpp  llama-cpp-python from the bundle's source: CMAKE_ARGS -DGGML_CUDA=on
              -DCMAKE_CUDA_ARCHITECTURES=<cc> -DLLAVA_BUILD=OFF (CPU: -DLLAVA_BUILD=OFF), the CMake
              build tree kept in WORK/build-<mode> so a second run rebuilds nothing
7. imports    everything the steps import, and whether the build offloads to a GPU

Each step is recorded in the state like a check step; a step that is already done (same inputs)
says so and takes no time. While llama.cpp compiles, the shaped models' F16 files are written in
the background (benchmarks/gpu/models.py), so only their quantization is left for the check.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.gpu import bundle as gpu_bundle, report

ROOT = Path(__file__).resolve().parents[2]  # the repository
STEPS = ("build:bundle", "build:toolchain", "build:venv", "build:wheels", "build:localspec", "build:llama_cpp",
         "build:imports")
IMPORTS = ("llama_cpp", "localspec", "localspec._verifier", "llguidance", "gguf", "pydantic", "starlette",
           "sse_starlette", "uvicorn", "httpx", "cffi", "platformdirs", "diskcache", "numpy")
RESERVE = 60.0  # seconds of the budget the build leaves for at least the first check steps


class BuildFailed(Exception):
    pass


@dataclass
class Built:
    python: str  # the virtual environment's interpreter
    env: dict  # what the steps' environment needs (PATH, LD_LIBRARY_PATH for a pip cuBLAS)


@dataclass
class Build:
    args: argparse.Namespace
    work: Path
    cuda: bool
    source: Path | None = None
    cmake_args: list | None = None
    env: dict | None = None
    prewrite: subprocess.Popen | None = None

    @property
    def venv(self) -> Path:
        return self.work / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def _stamp_ok(path: Path, value: str) -> bool:
    return path.exists() and path.read_text() == value


def _run(cmd: list, log: Path | None = None, timeout: float | None = None, env: dict | None = None) -> None:
    """Run a command; BuildFailed with the end of its output when it fails."""
    with (log.open("w") if log else open(os.devnull, "w")) as sink:
        proc = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE if log is None else sink,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env, cwd=ROOT,
                              stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        text = log.read_text(errors="replace") if log else (proc.stdout or "")
        raise BuildFailed(f"{Path(str(cmd[0])).name} {' '.join(map(str, cmd[1:4]))} ... exited {proc.returncode}: "
                          + " / ".join(e.strip()[:300] for e in failure_excerpt(text)) + (f" (log: {log})" if log else ""))


def failure_excerpt(text: str) -> list[str]:
    """The lines of a build log that say what went wrong: CMake's first error and its reason, else
    the compiler's first error, else the last lines (pip's own summary says only that it failed)."""
    lines = [line for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "CMake Error" in line:
            return lines[i:i + 4]
    compiler = [line for line in lines if re.search(r"\berror\b:", line) and "subprocess-exited" not in line]
    return compiler[:2] or lines[-3:]


# ---------------------------------------------------------------- steps


def step_bundle(b: Build) -> tuple[str, dict]:
    unpacked = gpu_bundle.unpack(b.args.bundle.resolve(), b.work)
    b.source = unpacked.source
    manifest = gpu_bundle.manifest_of(b.args.bundle.resolve())
    return gpu_bundle.summary(manifest), {"source": str(b.source), "manifest": {
        k: manifest[k] for k in ("llama_cpp_python", "python", "build_options", "total_bytes")}}


def _cublas(cuda_root: Path, work: Path) -> dict:
    """Where cuBLAS is: the toolkit's own, else the pip package nvidia-cublas that PyTorch images
    carry (CUDA 13: nvidia/cu13/{lib,include}; CUDA 12: nvidia/cublas/...). For the pip one, a shim
    folder in WORK holds links to just its headers and libraries (its include folder also holds
    other CUDA headers, which must not shadow the toolkit's)."""
    for lib in (cuda_root / "lib64", cuda_root / "targets" / "x86_64-linux" / "lib"):
        if any(lib.glob("libcublas.so*")):
            return {"from": "toolkit", "lib": str(lib)}
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cublas", "cu12"):
            lib, inc = Path(base) / sub / "lib", Path(base) / sub / "include"
            blas, lt = sorted(lib.glob("libcublas.so.*")), sorted(lib.glob("libcublasLt.so.*"))
            if blas and lt and (inc / "cublas_v2.h").exists():
                return {"from": "pip", **_cublas_shim(work / "cublas", inc, blas[0], lt[0])}
    raise BuildFailed(f"no cuBLAS: neither {cuda_root}/lib64 nor the nvidia-cublas package has libcublas "
                      "(llama.cpp's CUDA backend needs it)")


def _cublas_shim(shim: Path, include: Path, blas: Path, lt: Path) -> dict:
    (shim / "include").mkdir(parents=True, exist_ok=True)
    (shim / "lib").mkdir(parents=True, exist_ok=True)
    links = {shim / "include" / h.name: h for h in include.glob("*.h") if h.name.startswith(("cublas", "nvblas"))}
    for real in (blas, lt):
        links[shim / "lib" / real.name] = real  # libcublas.so.13: what the built library asks for at run time
        links[shim / "lib" / (real.name.split(".so")[0] + ".so")] = real  # libcublas.so: what the linker takes
    for link, real in links.items():
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(real)
    return {"lib": str(shim / "lib"), "include": str(shim / "include"), "cublas": str(shim / "lib" / "libcublas.so"),
            "cublasLt": str(shim / "lib" / "libcublasLt.so"), "pip_lib": str(blas.parent)}


DRIVER_DIRS = ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64",
               "/usr/local/cuda/compat")


def _cuda_driver(cuda_root: Path) -> dict:
    """How ggml-cuda links the driver library (libcuda, for its virtual-memory pool): the toolkit's
    stub, else the driver's own libcuda.so(.1) (a driver install often lacks the unversioned name
    CMake looks for), else not at all (-DGGML_CUDA_NO_VMM=ON: the legacy memory pool)."""
    for stubs in (cuda_root / "lib64" / "stubs", cuda_root / "targets" / "x86_64-linux" / "lib" / "stubs"):
        if (stubs / "libcuda.so").exists():
            return {"from": "toolkit stubs", "cmake_args": []}
    found = [Path(d) / n for d in DRIVER_DIRS for n in ("libcuda.so", "libcuda.so.1") if (Path(d) / n).exists()]
    if not found:
        try:
            listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
            found = [Path(m) for m in re.findall(r"=> (\S*/libcuda\.so(?:\.1)?)$", listing, re.M)]
        except (OSError, subprocess.SubprocessError):
            pass
    if found:
        return {"from": str(found[0]), "cmake_args": [f"-DCUDA_cuda_driver_LIBRARY={found[0]}"]}
    return {"from": "none found", "cmake_args": ["-DGGML_CUDA_NO_VMM=ON"]}


def _arch(requested: str | None) -> str:
    if requested:
        return requested
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.split()
        return out[0].replace(".", "") if out else "native"
    except (OSError, subprocess.SubprocessError):
        return "native"


def step_toolchain(b: Build) -> tuple[str, dict]:
    missing = [t for t in ("cmake", "ninja") if shutil.which(t) is None and importlib.util.find_spec(t) is None]
    if not (shutil.which("cc") or shutil.which("gcc")):
        missing.append("a C compiler (cc)")
    if missing:
        raise BuildFailed(f"missing: {', '.join(missing)}")
    env = dict(os.environ)
    args = list(gpu_bundle.BUILD_OPTIONS)
    cmake = shutil.which("cmake")
    data: dict = {"cmake": subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
                  if cmake else "the cmake Python package"}
    if b.cuda:
        nvcc = shutil.which("nvcc") or next((str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.exists()), None)
        if nvcc is None:
            raise BuildFailed("no nvcc on PATH or in /usr/local/cuda/bin: a CUDA toolkit is needed (or run --cpu)")
        root = Path(nvcc).resolve().parent.parent
        env["PATH"] = f"{Path(nvcc).parent}{os.pathsep}{env.get('PATH', '')}"
        env["CUDACXX"] = nvcc
        arch = _arch(b.args.arch)
        blas = _cublas(root, b.work)
        driver = _cuda_driver(root)
        args += ["-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", *driver["cmake_args"]]
        if blas["from"] == "pip":
            flags = f"-I{blas['include']}"
            args += [f"-DCUDA_cublas_LIBRARY={blas['cublas']}", f"-DCUDA_cublasLt_LIBRARY={blas['cublasLt']}",
                     f"-DCMAKE_CUDA_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
            env["LD_LIBRARY_PATH"] = f"{blas['lib']}{os.pathsep}{env.get('LD_LIBRARY_PATH', '')}"
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        data.update(nvcc=nvcc, nvcc_version=version[-1] if version else "?", arch=arch, cublas=blas, driver=driver)
    b.cmake_args, b.env = args, env
    data["cmake_args"] = args
    return " ".join(args) + (f"; {data['nvcc_version']}; cuBLAS from the {data['cublas']['from']}" if b.cuda else ""), data


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def step_venv(b: Build) -> tuple[str, dict]:
    if not b.python.exists():
        _run([sys.executable, "-m", "venv", "--without-pip", b.venv])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    pth = b.venv / "lib" / version / "site-packages" / "_gpu_check_base.pth"
    dirs = _site_dirs()
    pth.write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    out = subprocess.run([b.python, "-c", "import numpy, pip; print(numpy.__version__, pip.__version__)"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise BuildFailed(f"the virtual environment does not see numpy and pip of {sys.executable}: {out.stderr[-300:]}")
    numpy_v, pip_v = out.stdout.split()
    return f"{b.venv} (sees {len(dirs)} site folder(s) of {sys.executable}: numpy {numpy_v}, pip {pip_v})", {
        "venv": str(b.venv), "base_site": dirs}


def _pip(b: Build, *args: str, log: Path | None = None, timeout: float | None = None, env: dict | None = None) -> None:
    _run([b.python, "-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed", "--disable-pip-version-check",
          *args], log=log, timeout=timeout, env=env)


def step_wheels(b: Build) -> tuple[str, dict]:
    manifest = gpu_bundle.manifest_of(b.args.bundle.resolve())
    stamp_value = json.dumps(sorted(w["sha256"] for w in manifest["wheels"]))
    stamp = b.venv / ".wheels"
    names = [w["file"] for w in manifest["wheels"]]
    if _stamp_ok(stamp, stamp_value):
        return f"{len(names)} wheels already installed", {"wheels": names}
    _pip(b, *[str(b.args.bundle.resolve() / gpu_bundle.WHEELS_DIR / n) for n in names])
    stamp.write_text(stamp_value)
    return f"{len(names)} wheels installed", {"wheels": names}


def _tree_hash(*paths: Path) -> str:
    """A hash of the sources under `paths` (not of build products, which a build changes)."""
    h = hashlib.sha256()
    files = (f for path in paths for f in (path.rglob("*") if path.is_dir() else [path]))
    for p in sorted(f for f in files if f.is_file() and "_build" not in f.parts
                    and f.suffix in (".c", ".h", ".py", ".toml", ".cfg")):
        h.update(str(p.relative_to(ROOT)).encode() + p.read_bytes())
    return h.hexdigest()


def step_localspec(b: Build) -> tuple[str, dict]:
    value = _tree_hash(ROOT / "native", ROOT / "setup.py", ROOT / "pyproject.toml")
    stamp = b.venv / ".localspec"
    if not (_stamp_ok(stamp, value) and any(ROOT.glob("localspec/_verifier*.so"))):
        _pip(b, "--no-build-isolation", "-e", str(ROOT), log=b.work / "localspec_build.log", timeout=600)
        stamp.write_text(value)
        return "installed (editable; the C verifier built)", {}
    return "already installed (editable)", {}


def start_prewrite(b: Build, shapes: str) -> None:
    """Write the shaped models' F16 files in the background while llama.cpp compiles."""
    log = (b.work / "prewrite.log").open("w")
    b.prewrite = subprocess.Popen([b.python, "-m", "benchmarks.gpu.models", "--f16",
                                   str(b.work / "models"), shapes], stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, cwd=ROOT)


def step_llama_cpp(b: Build, deadline: float) -> tuple[str, dict]:
    value = json.dumps([gpu_bundle.manifest_of(b.args.bundle.resolve())["source"]["sha256"], b.cmake_args])
    stamp = b.venv / ".llama_cpp"
    check = subprocess.run([b.python, "-c", "import llama_cpp"], capture_output=True, env=b.env)
    if _stamp_ok(stamp, value) and check.returncode == 0:
        return "already built with these options", {"cmake_args": b.cmake_args}
    env = dict(b.env or os.environ, CMAKE_ARGS=" ".join(b.cmake_args or []),
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    build_dir = b.work / f"build-{'cuda' if b.cuda else 'cpu'}"
    t0 = time.perf_counter()
    _pip(b, "--no-build-isolation", "-v", "-C", f"build-dir={build_dir}", str(b.source),
         log=b.work / "llama_cpp_build.log", timeout=max(60.0, deadline - time.time() - RESERVE), env=env)
    stamp.write_text(value)
    secs = time.perf_counter() - t0
    return f"built in {secs:.0f} s ({os.cpu_count()} cores)", {"seconds": secs, "cmake_args": b.cmake_args,
                                                               "log": str(b.work / "llama_cpp_build.log")}


def step_imports(b: Build) -> tuple[str, dict]:
    code = ("import importlib, json, llama_cpp\nfrom importlib import metadata\n"
            f"mods = {IMPORTS!r}\nfor m in mods: importlib.import_module(m)\n"
            "print(json.dumps({'llama_cpp': llama_cpp.__version__, 'gpu_offload': bool(llama_cpp.llama_supports_gpu_offload()),"
            " 'numpy': metadata.version('numpy'), 'pydantic': metadata.version('pydantic')}))")
    out = subprocess.run([b.python, "-c", code], capture_output=True, text=True, env=b.env, cwd=ROOT, timeout=300)
    if out.returncode != 0:
        raise BuildFailed(f"an import failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else '?'}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    if b.cuda and not data["gpu_offload"]:
        raise BuildFailed("llama-cpp-python was built, but llama_supports_gpu_offload() is false: no CUDA backend "
                          "in the build, or no GPU visible to it (nvidia-smi?)")
    return (f"all {len(IMPORTS)} modules import; llama-cpp-python {data['llama_cpp']}, GPU offload "
            f"{'yes' if data['gpu_offload'] else 'no'}"), data


def build(args: argparse.Namespace, state: dict, state_path: Path) -> Built | None:
    """Run the build steps, recording each; the environment's interpreter, or None if a step failed."""
    b = Build(args, args.work.resolve(), cuda=not args.cpu)
    ok = False
    steps: dict[str, Callable[[], tuple[str, dict]]] = {
        "build:bundle": lambda: step_bundle(b), "build:toolchain": lambda: step_toolchain(b),
        "build:venv": lambda: step_venv(b), "build:wheels": lambda: step_wheels(b),
        "build:localspec": lambda: step_localspec(b), "build:llama_cpp": lambda: step_llama_cpp(b, state["deadline"]),
        "build:imports": lambda: step_imports(b)}
    try:
        for name in STEPS:
            report.record(state, name, "running")
            report.save(state, state_path)
            print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            try:
                summary, data = steps[name]()
            except (BuildFailed, gpu_bundle.BundleError, subprocess.TimeoutExpired, OSError) as exc:
                report.record(state, name, "failed", time.perf_counter() - t0, str(exc))
                report.skip_rest(state, f"{name} failed")
                report.save(state, state_path)
                for log in b.work.glob("*.log"):  # the whole log comes back with the report
                    shutil.copy(log, state_path.parent / log.name)
                return None
            report.record(state, name, "ok", time.perf_counter() - t0, summary, data)
            print(f"gpu_check: {name}: {summary}", file=sys.stderr, flush=True)
            report.save(state, state_path)
            if name == "build:localspec" and b.cuda and "shaped_models" in args.steps and args.scale == "full":
                start_prewrite(b, "default")
        ok = True
    finally:
        if b.prewrite is not None and not ok:
            b.prewrite.kill()
            b.prewrite.wait()
        elif b.prewrite is not None:
            try:
                b.prewrite.wait(timeout=max(1.0, state["deadline"] - time.time() - RESERVE))
            except subprocess.TimeoutExpired:
                b.prewrite.kill()
                b.prewrite.wait()
            state["prewrite_exit"] = b.prewrite.returncode
    env = {k: v for k, v in (b.env or {}).items() if k in ("PATH", "LD_LIBRARY_PATH") and v != os.environ.get(k)}
    return Built(str(b.python), env)
