"""The GPU check's offline build. Here, ``--prepare DIR`` makes the bundle: manifest.json (sizes,
sha256), the pinned llama-cpp-python source with its vendored llama.cpp trimmed to what building
libllama and ggml needs, and wheels of what localspec and its tests need that the GPU machine lacks
(CPython 3.12, x86-64 Linux), within the 64 MiB that travel with the working tree. There, install()
checks and unpacks it into a virtual environment WORK/venv that also sees the packages of the Python
running the check (numpy, pytest, scikit-build-core), with the wheels and localspec installed
(editable: localspec.models maps to models/), and compile_llama_cpp() builds llama-cpp-python with
CUDA into it, its CMake tree kept in WORK so that a second run compiles only what is left."""

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
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 56 * 2**20  # of the 64 MiB that may travel, 8 MiB are left for the working tree
MANIFEST = "manifest.json"
WHEELS_DIR = "wheels"
PLATFORMS = tuple(f"manylinux_2_{v}_x86_64" for v in range(39, 16, -1)) + ("manylinux2014_x86_64",)  # glibc 2.39
BUILD_OPTIONS = ("-DLLAVA_BUILD=OFF",)  # the trimmed source has no tools/ (llava, mtmd) to build
# What localspec, its server and its tests need that the machine lacks or may hold too old (it has numpy,
# scipy, click, jinja2, tqdm, pyyaml, httpx, packaging, pytest, pytest-xdist, scikit-build-core, cmake, ninja).
WHEELS = ("cffi", "pycparser", "platformdirs", "gguf", "llguidance", "diskcache", "starlette", "sse-starlette",
          "uvicorn", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
          "anyio", "openai", "jiter", "sniffio", "httpx2", "httpcore2", "truststore", "h11", "idna", "jsonschema",
          "jsonschema-specifications", "referencing", "rpds-py")

# Of the sdist, only KEEP_TOP is kept, and of that everything but DROP and hidden files.
LC = "vendor/llama.cpp/"
KEEP_TOP = ("CMakeLists.txt", "pyproject.toml", "README.md", "LICENSE.md", "PKG-INFO", "llama_cpp/", LC)
DROP = tuple(LC + d for d in (
    "models/", "docs/", "examples/", "tests/", "tools/", "gguf-py/", "scripts/", "media/", "benches/",
    "conversion/", "pocs/", "app/", "ci/", "grammars/", "requirements/", "skills/")) + tuple(
    f"{LC}ggml/src/ggml-{b}/" for b in ("vulkan", "sycl", "metal", "opencl", "cann", "musa", "hip", "kompute",
                                        "webgpu", "zdnn", "zendnn", "openvino", "hexagon", "et", "virtgpu"))
# What the build needs: a bundle lacking one is not made.
REQUIRED = ("CMakeLists.txt", "pyproject.toml", "llama_cpp/__init__.py", "llama_cpp/llama_cpp.py", *(LC + p for p in (
    "CMakeLists.txt", "cmake/build-info.cmake", "include/llama.h", "src/llama.cpp", "common/CMakeLists.txt",
    "vendor/CMakeLists.txt", "ggml/CMakeLists.txt", "ggml/src/CMakeLists.txt", "ggml/src/ggml-cpu/CMakeLists.txt",
    "ggml/src/ggml-cuda/CMakeLists.txt", "ggml/src/ggml-cuda/ggml-cuda.cu", "ggml/include/ggml-cuda.h")))

TOOLKIT = Path("/usr/local/cuda")  # where a toolkit's libraries are, besides the folder above nvcc's
PIP = ("-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed", "--disable-pip-version-check")
GRACE = 20.0  # seconds a command stopped with Ctrl-C at its deadline has to finish (pytest: its summary)
log = logging.getLogger("gpu_check")


class BuildFailed(Exception):
    """A bundle that cannot be made or used, or a build that cannot go on: what failed, why, what to do."""


def dropped(rel: str) -> bool:
    """Whether trimming drops this path of the sdist (POSIX, relative to its root)."""
    kept = any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in KEEP_TOP)
    return not kept or rel.startswith(DROP) or any(p.startswith(".") for p in PurePosixPath(rel).parts)


def trimmed_files(root: Path) -> list[str]:
    """The files of an extracted sdist that trimming keeps, sorted; symbolic links are not kept."""
    return [p.relative_to(root).as_posix() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and not dropped(p.relative_to(root).as_posix())]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extract(archive: Path, into: Path) -> Path:
    """Extract a tar.gz of one top folder (tarfile's "data" filter: nothing outside `into`); that folder."""
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
    except tarfile.TarError as exc:
        raise BuildFailed(f"{archive}: {exc}") from None
    return next(into.iterdir())


def prepare(dest: Path) -> dict:
    """Download the pinned sdist and the wheels, and make the bundle of them in `dest`; its manifest."""
    if dest.exists() and not (dest / MANIFEST).exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BuildFailed(f"{dest} exists and is not a bundle (no {MANIFEST}); name a new or empty folder")
    try:
        wheels = [f"{name}=={metadata.version(name)}" for name in WHEELS]
        sdist = f"llama-cpp-python=={metadata.version('llama-cpp-python')}"
    except metadata.PackageNotFoundError as exc:
        raise BuildFailed(f"{exc.name} is not installed here: install localspec with its test and server extras "
                          "(pip install -e '.[test,server]') before --prepare") from None
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d"]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, tmp, "--no-binary", ":all:", sdist], check=True)
        subprocess.run([*pip, f"{tmp}/{WHEELS_DIR}", "--only-binary=:all:", "--python-version", "3.12",
                        "--implementation", "cp", *platforms, *wheels], check=True)
        return assemble(dest, next(Path(tmp).glob("llama_cpp_python-*.tar.gz")), Path(tmp) / WHEELS_DIR)


def assemble(dest: Path, sdist: Path, wheels: Path) -> dict:
    """The bundle in `dest` (replacing it) of a llama-cpp-python sdist, trimmed, and folder `wheels`."""
    with tempfile.TemporaryDirectory() as tmp:
        root = extract(sdist, Path(tmp))
        files = trimmed_files(root)
        missing = sorted(set(REQUIRED) - set(files))
        if missing:
            raise BuildFailed(f"{sdist} is not a llama-cpp-python source: it lacks {', '.join(missing)}")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(wheels, dest / WHEELS_DIR)
        archive = dest / f"{root.name}-src.tar.gz"
        with tarfile.open(archive, "w:gz", compresslevel=9) as tar:
            for rel in files:
                tar.add(root / rel, arcname=f"{root.name}/{rel}", recursive=False)
    manifest = {"llama_cpp_python": root.name.rpartition("-")[2],
                "source": {"file": archive.name, "files": len(files), "bytes": archive.stat().st_size,
                           "sha256": sha256(archive)},
                "wheels": [{"file": f.name, "bytes": f.stat().st_size, "sha256": sha256(f)}
                           for f in sorted((dest / WHEELS_DIR).glob("*.whl"))]}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return check(dest)


def check(bundle: Path) -> dict:
    """The manifest of a bundle whose files are all there, whole (their checksums), and small enough;
    else BuildFailed naming each problem."""
    try:
        manifest = json.loads((bundle / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise BuildFailed(f"no readable {MANIFEST} in {bundle} ({exc}); make one with benchmarks/gpu_check.py "
                          f"--prepare {bundle}") from None
    problems, total = [], 0
    for f in [manifest["source"]] + [dict(w, file=f"{WHEELS_DIR}/{w['file']}") for w in manifest["wheels"]]:
        path = bundle / f["file"]
        if not path.is_file():
            problems.append(f"{f['file']} is missing")
        elif sha256(path) != f["sha256"]:
            problems.append(f"{f['file']} does not match its checksum (damaged in transit?)")
        else:
            total += path.stat().st_size
    if total > LIMIT_BYTES:
        problems.append(f"the bundle holds {total / 2**20:.1f} MiB; it must stay under {LIMIT_BYTES / 2**20:.0f} MiB "
                        "to travel with the working tree")
    if problems:
        raise BuildFailed(f"the bundle in {bundle}: " + "; ".join(problems))
    return manifest


def run(cmd: list, log_path: Path, env: dict | None = None, deadline: float | None = None,
        stdout: Path | None = None) -> int | None:
    """A command's exit status, its output in `log_path` (stdout in `stdout` if given); None if not done GRACE
    seconds before `deadline` (time.time()): its process group then gets a Ctrl-C, and is killed at the deadline."""
    with log_path.open("w") as sink, (stdout or Path(os.devnull)).open("w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out if stdout else sink, stderr=sink, env=env, cwd=ROOT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=None if deadline is None else max(0.0, deadline - GRACE - time.time()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):  # the group may be gone
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(timeout=GRACE)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def failure(what: str, rc: int | None, log_path: Path) -> str:
    """How a command ended, and why from its log: CMake's first error, else the compiler's first errors,
    else the last lines (pip's own summary says only that it failed)."""
    if rc is None or rc < 0:
        how = "stopped at the time limit" if rc is None else f"killed by {signal.Signals(-rc).name}"
        return f"{what}: {how} (log: {log_path})"
    lines = [line.strip()[:300] for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    cmake = next((i for i, line in enumerate(lines) if "CMake Error" in line), None)
    errors = [line for line in lines if re.search(r"\berror\b:", line) and "subprocess-exited" not in line]
    excerpt = " / ".join(lines[cmake:cmake + 4] if cmake is not None else errors[:2] or lines[-3:])
    return f"{what}: exited {rc}: {excerpt} (log: {log_path})"


def must(cmd: list, log_path: Path, env: dict | None = None, deadline: float | None = None) -> None:
    """run, and BuildFailed saying why when the command fails or runs out of time."""
    rc = run(cmd, log_path, env, deadline)
    if rc != 0:
        raise BuildFailed(failure(f"{Path(str(cmd[0])).name} {' '.join(map(str, cmd[1:4]))} ...", rc, log_path))


def gpus(fields: str = "name,driver_version,memory.total,compute_cap") -> list[str]:
    """A line of `fields` for each GPU nvidia-smi sees (none without it)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def pip_cublas(work: Path) -> tuple[Path, list[Path], Path]:
    """The nvidia-cublas package's cuBLAS (CUDA 13: nvidia/cu13/, 12: nvidia/cublas/): its library folder,
    libcublas and libcublasLt, and a folder in WORK of links to its cuBLAS headers alone (the package's
    include folder holds other CUDA headers, which must not shadow the toolkit's)."""
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cublas", "cu12"):
            lib, inc = Path(base) / sub / "lib", Path(base) / sub / "include"
            libs = [min(lib.glob(f"{n}.so.*"), default=None) for n in ("libcublas", "libcublasLt")]
            if libs[0] and libs[1] and (inc / "cublas_v2.h").exists():
                headers = work / "cublas-include"
                headers.mkdir(parents=True, exist_ok=True)
                for h in inc.glob("*.h"):
                    if h.name.startswith(("cublas", "nvblas")):
                        (headers / h.name).unlink(missing_ok=True)
                        (headers / h.name).symlink_to(h)
                return lib, [libs[0], libs[1]], headers
    raise BuildFailed("no cuBLAS: neither the CUDA toolkit nor the nvidia-cublas package has libcublas "
                      "(llama.cpp's CUDA backend needs it)")


def toolchain(work: Path, cuda: bool) -> tuple[list[str], dict[str, str]]:
    """(llama.cpp's CMake options, what the environment of the build and of its users adds)."""
    if not cuda:
        return list(BUILD_OPTIONS), {}
    nvcc = shutil.which("nvcc") or (str(TOOLKIT / "bin/nvcc") if (TOOLKIT / "bin/nvcc").exists() else None)
    if nvcc is None:
        raise BuildFailed(f"no nvcc on PATH or in {TOOLKIT}/bin: a CUDA toolkit is needed (or --cpu)")
    roots = [Path(nvcc).resolve().parent.parent, TOOLKIT]  # nvcc may be a wrapper script
    caps = gpus("compute_cap")
    arch = caps[0].replace(".", "") if caps else "native"  # the first card's compute capability: 90
    # GGML_CUDA_NO_VMM: ops' scratch buffers from the plain pool, so nothing links libcuda, for which a
    # toolkit assembled from pip packages has no stub (weights and KV cache are allocated alike either way).
    args = [*BUILD_OPTIONS, "-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", "-DGGML_CUDA_NO_VMM=ON"]
    env = {"PATH": f"{Path(nvcc).parent}{os.pathsep}{os.environ.get('PATH', '')}", "CUDACXX": nvcc}
    if not any(any((r / d).glob("libcublas.so*")) for r in roots for d in ("lib64", "lib", "targets/x86_64-linux/lib")):
        # ggml-cuda links CUDA::cublas, so CMake stops on a toolkit without it; images with PyTorch carry
        # cuBLAS as the nvidia-cublas wheel instead: CMake, the compilers and the loader are pointed there.
        lib, (blas, blas_lt), headers = pip_cublas(work)
        args += [f"-DCUDA_cublas_LIBRARY={blas}", f"-DCUDA_cublasLt_LIBRARY={blas_lt}",
                 f"-DCMAKE_CUDA_FLAGS=-I{headers}", f"-DCMAKE_CXX_FLAGS=-I{headers}"]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, (str(lib), os.environ.get("LD_LIBRARY_PATH"))))
    return args, env


def install(bundle_dir: Path, work: Path, cuda: bool) -> tuple[Path, dict[str, str], list[str]]:
    """All before llama.cpp's compile: (the environment's Python, what its environment adds, CMake's options)."""
    manifest = check(bundle_dir)
    shutil.rmtree(work / "src", ignore_errors=True)  # extracted again with the files' times: the CMake tree stays valid
    extract(bundle_dir / manifest["source"]["file"], work / "src")
    args, env = toolchain(work, cuda)
    python = work / "venv" / "bin" / "python"
    if not python.exists():
        must([sys.executable, "-m", "venv", "--without-pip", work / "venv"], work / "venv.log")
    pth = Path(sysconfig.get_path("purelib", "venv", {"base": str(work / "venv")})) / "_gpu_check_base.pth"
    pth.write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dict.fromkeys(site.getsitepackages())))
    must([python, *PIP, *(bundle_dir / WHEELS_DIR / w["file"] for w in manifest["wheels"])], work / "wheels.log")
    must([python, *PIP, "--no-build-isolation", "-e", ROOT], work / "localspec.log")  # compiles the C verifier
    return python, env, args


def compile_llama_cpp(python: Path, work: Path, env: dict[str, str], args: list[str], deadline: float) -> float:
    """llama-cpp-python from the unpacked source into the environment: the seconds it took."""
    env = {**os.environ, **env, "CMAKE_ARGS": " ".join(args), "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    log.info("compiling llama.cpp (log: %s)", work / "llama_cpp_build.log")
    t0, source = time.time(), next((work / "src").iterdir())
    must([python, *PIP, "--no-build-isolation", "-v", "-C", f"build-dir={work / 'build'}", source],
         work / "llama_cpp_build.log", env, deadline)
    return time.time() - t0
