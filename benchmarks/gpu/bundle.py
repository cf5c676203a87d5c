"""What travels to an offline CUDA machine for the GPU check (``benchmarks/gpu_check.py --prepare DIR``):
a git-ignored folder of manifest.json (versions, sizes, sha256), the pinned llama-cpp-python source
with its vendored llama.cpp trimmed to what the build of libllama and ggml needs (no models, docs,
examples, tests, tools, gguf-py, scripts or other backends' sources), and wheels/ of the packages
localspec and its tests need that such a machine lacks, for its Python (3.12, x86-64 Linux). With
the working tree it stays within the 64 MiB such a machine receives."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Iterable

LIMIT_BYTES = 64 * 2**20  # what may travel to the machine, working tree included
TREE_ALLOWANCE = 8 * 2**20  # kept free for the working tree
MANIFEST = "manifest.json"
WHEELS_DIR = "wheels"
PYTHON_VERSION = "3.12"  # the machine's Python
PLATFORMS = tuple(f"manylinux_2_{v}_x86_64" for v in range(39, 16, -1)) + ("manylinux2014_x86_64",)  # glibc 2.39
BUILD_OPTIONS = ("-DLLAVA_BUILD=OFF",)  # what the trimmed source must be built with
# Distributions the machine lacks or may hold too old (it has numpy, scipy, click, jinja2, tqdm, pyyaml,
# httpx, pytest, pytest-xdist, scikit-build-core, cmake, ninja): localspec's, its server's and its tests'
# dependencies. Versions: those installed here, the set the test suite passes with.
WHEELS = ("cffi", "pycparser", "platformdirs", "gguf", "llguidance", "diskcache", "starlette", "sse-starlette",
          "uvicorn", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
          "anyio", "openai", "jiter", "sniffio", "httpx2", "httpcore2", "truststore", "h11", "idna", "jsonschema",
          "jsonschema-specifications", "referencing", "rpds-py")

KEEP_TOP = ("CMakeLists.txt", "pyproject.toml", "README.md", "LICENSE.md", "PKG-INFO", "llama_cpp/",
            "vendor/llama.cpp/")  # of the sdist, only these are kept ...
LC = "vendor/llama.cpp/"
DROP = tuple(LC + d for d in (  # ... and of those, everything but these
    "models/", "docs/", "examples/", "tests/", "tools/", "gguf-py/", "scripts/", "media/", "benches/",
    "conversion/", "pocs/", "app/", "ci/", "grammars/", "requirements/", "skills/")) + tuple(
    f"{LC}ggml/src/ggml-{b}/" for b in ("vulkan", "sycl", "metal", "opencl", "cann", "musa", "hip", "kompute",
                                        "webgpu", "zdnn", "zendnn", "openvino", "hexagon", "et", "virtgpu"))
DROP_SUFFIXES = (".py", ".nix", ".sh", ".ipynb")  # conversion scripts and the like, in llama.cpp's top level
REQUIRED = ("CMakeLists.txt", "pyproject.toml", "llama_cpp/__init__.py", "llama_cpp/llama_cpp.py",
            LC + "CMakeLists.txt", LC + "cmake/build-info.cmake", LC + "include/llama.h", LC + "src/llama.cpp",
            LC + "common/CMakeLists.txt", LC + "vendor/CMakeLists.txt", LC + "ggml/CMakeLists.txt",
            LC + "ggml/src/CMakeLists.txt", LC + "ggml/src/ggml-cpu/CMakeLists.txt",
            LC + "ggml/src/ggml-cuda/CMakeLists.txt", LC + "ggml/src/ggml-cuda/ggml-cuda.cu",
            LC + "ggml/include/ggml-cuda.h")  # what the build needs: checked in every bundle


class BundleError(Exception):
    """A bundle that cannot be made or used, with what to do."""


def dropped(rel: str) -> bool:
    """Whether trimming drops this path of the sdist (POSIX, relative to its root)."""
    if not any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in KEEP_TOP):
        return True
    if rel.startswith(DROP) or any(p.startswith(".") for p in PurePosixPath(rel).parts):
        return True  # and .github, .devops, editor settings, the vendored copy's .git pointer
    inside = rel[len(LC):] if rel.startswith(LC) else None
    return inside is not None and "/" not in inside and inside.endswith(DROP_SUFFIXES)


def trimmed_files(root: Path) -> list[str]:
    """The files of an extracted sdist that trimming keeps, sorted; symbolic links are not kept."""
    return [p.relative_to(root).as_posix() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and not dropped(p.relative_to(root).as_posix())]


def sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def pack_source(root: Path, dest: Path, prefix: str) -> dict:
    """A reproducible tar.gz of the trimmed sdist at `root` (entries under `prefix`/); what it holds."""
    files = trimmed_files(root)
    missing = sorted(set(REQUIRED) - set(files))
    if missing:
        raise BundleError(f"{root} is not a llama-cpp-python source tree: it lacks {', '.join(missing)}")
    with tarfile.open(dest, "w:gz", compresslevel=9) as tar:
        for rel in files:
            info = tar.gettarinfo(str(root / rel), arcname=f"{prefix}/{rel}")
            info.uid = info.gid = info.mtime = 0
            info.uname = info.gname = ""
            with (root / rel).open("rb") as fh:
                tar.addfile(info, fh)
    return {"file": dest.name, "prefix": prefix, "files": len(files), "bytes": dest.stat().st_size,
            "sha256": sha256(dest)}


def download_command(into: Path, requirements: Iterable[str], python_version: str | None = None) -> list[str]:
    """pip download of `requirements` without their dependencies: source distributions, or with
    `python_version` binary wheels for that CPython on x86-64 Linux."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into)]
    if python_version is None:
        cmd += ["--no-binary", ":all:"]
    else:
        cmd += ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
        cmd += [arg for p in PLATFORMS for arg in ("--platform", p)]
    return cmd + list(requirements)


def extract(archive: Path, into: Path) -> Path:
    """Extract a tar.gz (tarfile's "data" filter: nothing outside `into`); its single top directory."""
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
            tops = {PurePosixPath(m.name).parts[0] for m in tar.getmembers()}
    except tarfile.TarError as exc:
        raise BundleError(f"{archive}: {exc}") from None
    if len(tops) != 1:
        raise BundleError(f"{archive}: expected one top directory, found {sorted(tops)[:5]}")
    return into / tops.pop()


def normal(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def prepare(dest: Path, version: str | None = None, sdist: Path | None = None,
            wheels: dict[str, str] | None = None) -> dict:
    """Make the bundle in `dest` (replacing an earlier bundle there); its manifest. `sdist`: a
    llama-cpp-python source archive instead of downloading one; `wheels`: distribution versions
    (default: those installed here)."""
    version = version or metadata.version("llama-cpp-python")
    if dest.exists() and not (dest / MANIFEST).exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BundleError(f"{dest} exists and is not a bundle (no {MANIFEST}); name a new or empty folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))  # renamed to dest once complete
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if sdist is None:
                subprocess.run(download_command(Path(tmp), [f"llama-cpp-python=={version}"]), check=True)
                sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            prefix = f"llama-cpp-python-{version}"
            source = pack_source(extract(sdist, Path(tmp) / "x"), work / f"{prefix}-src.tar.gz", prefix)
        try:
            versions = {name: metadata.version(name) for name in WHEELS} if wheels is None else wheels
        except metadata.PackageNotFoundError as exc:
            raise BundleError(f"{exc.name} is not installed here: install localspec with its test and server extras "
                              "(pip install -e '.[test,server]') before --prepare") from None
        if versions:
            (work / WHEELS_DIR).mkdir()
            subprocess.run(download_command(work / WHEELS_DIR, [f"{n}=={v}" for n, v in versions.items()],
                                            PYTHON_VERSION), check=True)
        files = sorted((work / WHEELS_DIR).glob("*.whl"))
        manifest = {"llama_cpp_python": version, "python": PYTHON_VERSION, "source": source, "requested": versions,
                    "wheels": [{"file": f.name, "name": normal(f.name.split("-")[0]), "bytes": f.stat().st_size,
                                "sha256": sha256(f)} for f in files]}
        (work / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        problems = check(work)
        if problems:
            raise BundleError("the bundle made is not usable: " + "; ".join(problems))
        shutil.rmtree(dest, ignore_errors=True)
        work.rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def check(bundle: Path) -> list[str]:
    """What is wrong with a bundle (nothing: []): its manifest, checksums and size, and a wheel of every
    requested distribution (the source's contents are checked when it is packed)."""
    try:
        manifest = manifest_of(bundle)
    except (OSError, ValueError) as exc:
        return [f"no readable {MANIFEST} in {bundle} ({exc}); make one with benchmarks/gpu_check.py --prepare {bundle}"]
    problems, total = [], 0
    for f in [manifest["source"]] + [dict(w, file=f"{WHEELS_DIR}/{w['file']}") for w in manifest["wheels"]]:
        path = bundle / f["file"]
        if not path.is_file():
            problems.append(f"{f['file']} is missing")
        elif sha256(path) != f["sha256"]:
            problems.append(f"{f['file']} does not match its checksum (damaged in transit?)")
        else:
            total += path.stat().st_size
    if total > LIMIT_BYTES - TREE_ALLOWANCE:
        problems.append(f"the bundle holds {total / 2**20:.1f} MiB; with the working tree it must stay under "
                        f"{LIMIT_BYTES / 2**20:.0f} MiB")
    have = {w["name"] for w in manifest["wheels"]}
    return problems + [f"no wheel of {name}" for name in manifest["requested"] if normal(name) not in have]


def manifest_of(bundle: Path) -> dict:
    return json.loads((bundle / MANIFEST).read_text())


def unpack(bundle: Path, work: Path) -> Path:
    """The bundle checked and its source extracted under `work` (once per archive checksum): the source tree."""
    problems = check(bundle)
    if problems:
        raise BundleError("; ".join(problems))
    source = manifest_of(bundle)["source"]
    stamp, tree = work / "src.sha256", work / "src" / source["prefix"]
    if not (stamp.exists() and stamp.read_text() == source["sha256"] and tree.is_dir()):
        shutil.rmtree(work / "src", ignore_errors=True)
        (work / "src").mkdir(parents=True)
        extract(bundle / source["file"], work / "src")
        stamp.write_text(source["sha256"])
    return tree


def summary(manifest: dict) -> str:
    s, wheels = manifest["source"], sum(w["bytes"] for w in manifest["wheels"]) / 2**20
    return (f"llama-cpp-python {manifest['llama_cpp_python']} source: {s['files']} files, {s['bytes'] / 2**20:.1f} MiB; "
            f"{len(manifest['wheels'])} wheels, {wheels:.1f} MiB; total {s['bytes'] / 2**20 + wheels:.1f} MiB")
