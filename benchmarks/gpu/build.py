"""llama-cpp-python built with CUDA from the bundle, offline (benchmarks/gpu/check.py).

:func:`install` checks the bundle and unpacks its source into WORK, finds the toolchain (nvcc, the
card's compute capability, cuBLAS: the toolkit's, else the ``nvidia-cublas`` package of PyTorch
installs), makes a virtual environment WORK/venv that also sees the packages of the Python
running the check (the machine's numpy, pip, pytest, scikit-build-core), installs the bundle's
wheels there and localspec from this tree, editable (its C verifier compiled);
:func:`build_llama_cpp` builds llama-cpp-python there from the source, its CMake tree kept in
WORK so that a second run on the same machine compiles only what is left. What was done with the
same inputs (a stamp file says so) is not done again."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable

from benchmarks.gpu import bundle, report

ROOT = Path(__file__).resolve().parents[2]
CUDA_ROOTS = ("/usr/local/cuda",)  # where a toolkit's libraries are, besides the folder above nvcc's
DRIVER_DIRS = ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64",
               "/usr/local/cuda/compat")
GRACE = 20.0  # seconds an interrupted command has to finish (pytest: to print its summary)
log = logging.getLogger("gpu_check")


class BuildFailed(Exception):
    """The build cannot go on: what failed and the lines of its log that say why."""


def failure_excerpt(text: str) -> str:
    """The lines of a build log that say what went wrong: CMake's first error and its reason, else the
    compiler's first errors, else the last lines (pip's own summary says only that it failed)."""
    lines = [line.strip()[:300] for line in text.splitlines() if line.strip()]
    cmake = next((i for i, line in enumerate(lines) if "CMake Error" in line), None)
    errors = [line for line in lines if re.search(r"\berror\b:", line) and "subprocess-exited" not in line]
    return " / ".join(lines[cmake:cmake + 4] if cmake is not None else errors[:2] or lines[-3:])


def run_logged(cmd: list, log_path: Path, env: dict | None = None, deadline: float | None = None,
               interrupt: bool = False, stdout: Path | None = None) -> int | None:
    """Run a command in its own process group, its output in `log_path` (its stdout in `stdout` if
    given); its exit status, or None when it was still running at `deadline` (time.time()): then
    the group is stopped, with `interrupt` after a Ctrl-C and GRACE seconds to finish."""
    with log_path.open("w") as sink, (stdout or Path(os.devnull)).open("w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out if stdout else sink, stderr=sink, env=env, cwd=ROOT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            if interrupt:
                proc.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=GRACE)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def run(cmd: list, log_path: Path, env: dict | None = None, deadline: float | None = None) -> None:
    """run_logged, and BuildFailed with the log's error lines when the command fails or runs out of time."""
    rc = run_logged(cmd, log_path, env, deadline)
    name = f"{Path(str(cmd[0])).name} {' '.join(map(str, cmd[1:4]))} ..."
    if rc is None:
        raise BuildFailed(f"{name} had not finished when the time budget ran out (log: {log_path}); run the "
                          "check again on this machine: the build goes on where it stopped")
    if rc != 0:
        raise BuildFailed(f"{name} exited {rc}: {failure_excerpt(log_path.read_text(errors='replace'))} (log: {log_path})")


def cmake_args(arch: str | None, cublas: dict | None = None, driver: tuple[str, ...] = ()) -> list[str]:
    """llama.cpp's CMake options: for the CPU when `arch` is None, else CUDA for that architecture, with
    a pip cuBLAS through its shim folder (`cublas`: :func:`find_cublas`) and the driver's option."""
    if arch is None:
        return list(bundle.BUILD_OPTIONS)
    args = [*bundle.BUILD_OPTIONS, "-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", *driver]
    if cublas and cublas["from"] == "pip":
        args += [f"-DCUDA_cublas_LIBRARY={cublas['lib']}/libcublas.so",
                 f"-DCUDA_cublasLt_LIBRARY={cublas['lib']}/libcublasLt.so",
                 f"-DCMAKE_CUDA_FLAGS=-I{cublas['include']}", f"-DCMAKE_CXX_FLAGS=-I{cublas['include']}"]
    return args


def find_cublas(roots: list[Path], work: Path) -> dict:
    """Where cuBLAS is: a toolkit's, else the pip package nvidia-cublas (CUDA 13: nvidia/cu13/, 12:
    nvidia/cublas/) through a shim folder in WORK that links just its headers and libraries (the
    package's include folder holds other CUDA headers, which must not shadow the toolkit's)."""
    for lib in (r / sub for r in roots for sub in ("lib64", "targets/x86_64-linux/lib")):
        if any(lib.glob("libcublas.so*")):
            return {"from": "toolkit", "lib": str(lib)}
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cublas", "cu12"):
            lib, inc = Path(base) / sub / "lib", Path(base) / sub / "include"
            libs = [sorted(lib.glob(f"{n}.so.*")) for n in ("libcublas", "libcublasLt")]
            if all(libs) and (inc / "cublas_v2.h").exists():
                shim = work / "cublas"
                links = {shim / "include" / h.name: h for h in inc.glob("*.h") if h.name.startswith(("cublas", "nvblas"))}
                for real, *_ in libs:  # libcublas.so.13 (asked for at run time) and libcublas.so (linked)
                    links[shim / "lib" / real.name] = links[shim / "lib" / (real.name.split(".so")[0] + ".so")] = real
                for link, real in links.items():
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.unlink(missing_ok=True)
                    link.symlink_to(real)
                return {"from": "pip", "lib": str(shim / "lib"), "include": str(shim / "include")}
    raise BuildFailed(f"no cuBLAS: neither the toolkit ({', '.join(map(str, roots))}) nor the nvidia-cublas package "
                      "has libcublas (llama.cpp's CUDA backend needs it)")


def driver_option(roots: list[Path]) -> tuple[str, ...]:
    """How ggml-cuda links the driver (libcuda, for its virtual-memory pool): a toolkit's stub, else the
    driver's own library (an install often lacks the unversioned name CMake looks for), else not at
    all (-DGGML_CUDA_NO_VMM=ON: the legacy memory pool)."""
    if any((r / sub / "stubs" / "libcuda.so").exists() for r in roots for sub in ("lib64", "targets/x86_64-linux/lib")):
        return ()
    found = [Path(d) / n for d in DRIVER_DIRS for n in ("libcuda.so", "libcuda.so.1") if (Path(d) / n).exists()]
    return (f"-DCUDA_cuda_driver_LIBRARY={found[0]}",) if found else ("-DGGML_CUDA_NO_VMM=ON",)


def toolchain(work: Path, cuda: bool) -> tuple[list[str], dict[str, str], dict]:
    """(CMake options, environment, facts for the report) of this machine's build."""
    missing = [t for t in ("cmake", "ninja") if shutil.which(t) is None and importlib.util.find_spec(t) is None]
    missing += [] if shutil.which("cc") or shutil.which("gcc") else ["a C compiler (cc)"]
    if missing:
        raise BuildFailed(f"missing: {', '.join(missing)}")
    if not cuda:
        return cmake_args(None), {}, {}
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)
    if nvcc is None:
        raise BuildFailed("no nvcc on PATH or in /usr/local/cuda/bin: a CUDA toolkit is needed (or --cpu)")
    roots = [Path(nvcc).resolve().parent.parent, *map(Path, CUDA_ROOTS)]  # nvcc may be a wrapper script
    cublas, arch = find_cublas(roots, work), report.gpus(("compute_cap",))[:1]
    arch = arch[0].replace(".", "") if arch else "native"  # the first card's compute capability: 90
    env = {"PATH": f"{Path(nvcc).parent}{os.pathsep}{os.environ.get('PATH', '')}", "CUDACXX": nvcc}
    if cublas["from"] == "pip":
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, (cublas["lib"], os.environ.get("LD_LIBRARY_PATH"))))
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    facts = {"nvcc": version[-1] if version else "?", "arch": arch, "cublas": cublas["from"]}
    return cmake_args(arch, cublas, driver_option(roots)), env, facts


def pip_command(python: Path, *args: str | Path) -> list[str]:
    """pip install into `python`'s environment with nothing fetched: the given files and folders only."""
    return [str(python), "-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed",
            "--disable-pip-version-check", *map(str, args)]


def once(stamp: Path, value: str, action: Callable[[], None]) -> None:
    """Do `action` unless `stamp` says it was done with `value`."""
    if not (stamp.exists() and stamp.read_text() == value):
        action()
        stamp.write_text(value)


def venv(work: Path) -> Path:
    """WORK/venv, which also sees the site folders of the Python running the check (a .pth)."""
    python = work / "venv" / "bin" / "python"
    if not python.exists():
        run([sys.executable, "-m", "venv", "--without-pip", work / "venv"], work / "venv.log")
    dirs = [d for d in dict.fromkeys(site.getsitepackages()) if Path(d).is_dir()]
    pth = Path(sysconfig.get_path("purelib", "venv", {"base": str(work / "venv")})) / "_gpu_check_base.pth"
    pth.write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    return python


def install(bundle_dir: Path, work: Path, cuda: bool) -> tuple[Path, dict[str, str], list[str], dict]:
    """Everything before llama.cpp's compile (the module's docstring): (the environment's Python, what
    its processes need in their environment, llama.cpp's CMake options, the toolchain's facts)."""
    bundle.unpack(bundle_dir, work)
    args, env, facts = toolchain(work, cuda)
    python = venv(work)
    wheels = [bundle_dir / bundle.WHEELS_DIR / w["file"] for w in bundle.manifest_of(bundle_dir)["wheels"]]
    once(work / "venv" / ".wheels", json.dumps(sorted(p.name for p in wheels)),
         lambda: run(pip_command(python, *wheels), work / "wheels.log"))
    sources = sorted((ROOT / "native").glob("*.[ch]")) + [ROOT / "setup.py", ROOT / "pyproject.toml"]
    if not (ROOT / "localspec" / f"_verifier{sysconfig.get_config_var('EXT_SUFFIX')}").exists():
        (work / "venv" / ".localspec").unlink(missing_ok=True)
    once(work / "venv" / ".localspec", hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest(),
         lambda: run(pip_command(python, "--no-build-isolation", "-e", ROOT), work / "localspec.log"))
    return python, env, args, facts


def build_llama_cpp(python: Path, work: Path, env: dict[str, str], args: list[str], deadline: float) -> float | None:
    """llama-cpp-python from the bundle's source into the environment; seconds it took (None: built before)."""
    source = next((work / "src").iterdir())  # bundle.unpack's
    value, stamp = json.dumps([(work / "src.sha256").read_text(), args]), work / "venv" / ".llama_cpp"
    if stamp.exists() and stamp.read_text() == value:
        return None
    env = {**os.environ, **env, "CMAKE_ARGS": " ".join(args), "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    log.info("compiling llama.cpp (log: %s)", work / "llama_cpp_build.log")
    t0 = time.time()
    run(pip_command(python, "--no-build-isolation", "-v", "-C",
                    f"build-dir={work / ('build-cuda' if '-DGGML_CUDA=on' in args else 'build-cpu')}", source),
        work / "llama_cpp_build.log", env, deadline)
    stamp.write_text(value)
    return time.time() - t0
