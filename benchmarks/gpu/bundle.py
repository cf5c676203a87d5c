"""The source bundle of the GPU check (benchmarks/gpu_check.py): made here, carried to an offline machine.

A bundle is a git-ignored folder (``.gpu-bundle/`` by default) of at most 64 MiB:

    manifest.json                          versions, files, sizes, sha256, what was dropped
    llama-cpp-python-<version>-src.tar.gz  the pinned llama-cpp-python source, its vendored
                                           llama.cpp trimmed to what the CUDA (or CPU) build of
                                           libllama and ggml needs
    wheels/*.whl                           the Python packages localspec and the check need that a
                                           bare CUDA machine lacks, for its Python (3.12, x86-64)

Trimming keeps llama-cpp-python's own CMake project and Python package, and of llama.cpp its CMake
files, headers, ``src/``, ``common/`` (llama-cpp-python forces it on), ``vendor/`` and ``ggml/``
without the other backends' sources; it drops models (vocabularies), docs, examples, tests, tools
(the mtmd/llava library is not built: ``-DLLAVA_BUILD=OFF``; ``llama_cpp`` imports it only on use),
the server's web UI, gguf-py, scripts and media.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Iterable, Sequence

log = logging.getLogger("gpu_bundle")

LIMIT_BYTES = 64 * 2**20  # what may travel to the device machine, working tree included
TREE_ALLOWANCE = 8 * 2**20  # kept free for the working tree that travels with the bundle
MANIFEST = "manifest.json"
WHEELS_DIR = "wheels"
PYTHON_VERSION = "3.12"  # the device machine's Python
GLIBC = 39  # the device's glibc is 2.39 (Ubuntu 24.04, whose Python is 3.12.3); older manylinux wheels install too
PLATFORMS = tuple(f"manylinux_2_{v}_x86_64" for v in range(GLIBC, 16, -1)) + ("manylinux2014_x86_64",)
BUILD_OPTIONS = ("-DLLAVA_BUILD=OFF",)  # what the bundle's trimmed source must be built with

# Distributions a bare CUDA machine lacks (it has numpy, click, jinja2, tqdm, pyyaml, httpx, h11,
# scikit-build-core, cmake, ninja, setuptools): localspec's dependencies and its server's, and theirs
# where the machine's own may be too old (typing-extensions, anyio). Versions: those installed here,
# the set the test suite passes with.
WHEELS = ("cffi", "pycparser", "platformdirs", "gguf", "llguidance", "diskcache", "starlette", "sse-starlette",
          "uvicorn", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
          "anyio")

# Of the sdist, only these (relative to its root) are kept ...
KEEP_TOP = ("CMakeLists.txt", "pyproject.toml", "README.md", "LICENSE.md", "PKG-INFO", "llama_cpp/",
            "vendor/llama.cpp/")
_LC = "vendor/llama.cpp/"
# ... and of those, everything but these
DROP = tuple(_LC + d for d in (
    "models/", "docs/", "examples/", "tests/", "tools/", "gguf-py/", "scripts/", "media/", "benches/",
    "conversion/", "pocs/", "app/", "ci/", "grammars/", "requirements/", "skills/")) + tuple(
    f"{_LC}ggml/src/ggml-{b}/" for b in ("vulkan", "sycl", "metal", "opencl", "cann", "musa", "hip", "kompute",
                                         "webgpu", "zdnn", "zendnn", "openvino", "hexagon", "et", "virtgpu"))
DROP_SUFFIXES = (".py", ".nix", ".sh", ".ipynb")  # conversion scripts and the like, in llama.cpp's top level
# what a build needs: checked in every bundle
REQUIRED = ("CMakeLists.txt", "pyproject.toml", "README.md", "llama_cpp/__init__.py", "llama_cpp/llama_cpp.py",
            _LC + "CMakeLists.txt", _LC + "cmake/build-info.cmake", _LC + "include/llama.h", _LC + "src/llama.cpp",
            _LC + "common/CMakeLists.txt", _LC + "vendor/CMakeLists.txt", _LC + "ggml/CMakeLists.txt",
            _LC + "ggml/src/CMakeLists.txt", _LC + "ggml/src/ggml-cpu/CMakeLists.txt",
            _LC + "ggml/src/ggml-cuda/CMakeLists.txt", _LC + "ggml/src/ggml-cuda/ggml-cuda.cu",
            _LC + "ggml/include/ggml-cuda.h")


class BundleError(Exception):
    """A bundle that cannot be made or used, with what to do."""


def dropped(rel: str) -> bool:
    """Whether trimming drops this path of the sdist (POSIX, relative to its root)."""
    if not any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in KEEP_TOP):
        return True
    if any(rel.startswith(d) for d in DROP):
        return True
    parts = PurePosixPath(rel).parts
    if any(p.startswith(".") for p in parts):
        return True  # .github, .devops, editor settings, the vendored copy's .git pointer
    inside = rel[len(_LC):] if rel.startswith(_LC) else None
    return inside is not None and "/" not in inside and inside.endswith(DROP_SUFFIXES)


def trimmed_files(root: Path) -> list[str]:
    """The files of an extracted sdist that a trimmed copy keeps, sorted (POSIX relative paths);
    symbolic links are not followed and not kept."""
    out = []
    for path in sorted(root.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        if not dropped(rel):
            out.append(rel)
    return out


def missing_required(files: Iterable[str]) -> list[str]:
    have = set(files)
    return [r for r in REQUIRED if r not in have]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pack_source(root: Path, dest: Path, prefix: str) -> dict:
    """A tar.gz of the trimmed sdist at `root` (entries under `prefix`/); what it holds."""
    files = trimmed_files(root)
    missing = missing_required(files)
    if missing:
        raise BundleError(f"{root} is not a llama-cpp-python source tree: it lacks {', '.join(missing)}")
    size = 0
    with tarfile.open(dest, "w:gz", compresslevel=9) as tar:
        for rel in files:
            info = tar.gettarinfo(str(root / rel), arcname=f"{prefix}/{rel}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            size += info.size
            with (root / rel).open("rb") as fh:
                tar.addfile(info, fh)
    return {"file": dest.name, "prefix": prefix, "files": len(files), "unpacked_bytes": size}


def fetch_sdist(version: str, into: Path) -> Path:
    """pip download of llama-cpp-python==version's source distribution."""
    log.warning("downloading the llama-cpp-python %s source (pip download)", version)
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:",
                    "--no-deps", "-d", str(into), "-q"], check=True)
    return next(into.glob("llama_cpp_python-*.tar.gz"))


def extract(archive: Path, into: Path) -> Path:
    """Extract a tar.gz (no links or paths outside `into`); returns its single top directory."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for m in members:
            target = (into / m.name).resolve()
            if not (m.isfile() or m.isdir()) or not str(target).startswith(str(into.resolve())):
                raise BundleError(f"{archive}: refusing the entry {m.name!r} (a link or a path outside)")
        tar.extractall(into, members=members)
    tops = {PurePosixPath(m.name).parts[0] for m in members}
    if len(tops) != 1:
        raise BundleError(f"{archive}: expected one top directory, found {sorted(tops)[:5]}")
    return into / tops.pop()


def wheel_versions(names: Sequence[str] = WHEELS) -> dict[str, str]:
    """The version of each distribution installed here (the tested set)."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise BundleError(f"{name} is not installed here; install localspec with its test extras "
                              "(pip install -e '.[test]') before --prepare") from None
    return out


def download_wheels(versions: dict[str, str], into: Path, python_version: str = PYTHON_VERSION,
                    platforms: Sequence[str] = PLATFORMS) -> list[Path]:
    """pip download of binary wheels for the device's Python and platform, one per distribution."""
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", "-d", str(into), "-q"]
    for p in platforms:
        cmd += ["--platform", p]
    log.warning("downloading %d wheels for Python %s (%s)", len(versions), python_version, platforms[0])
    subprocess.run(cmd + [f"{n}=={v}" for n, v in versions.items()], check=True)
    return sorted(into.glob("*.whl"))


def _normal(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def wheel_name(filename: str) -> tuple[str, str, str]:
    """(distribution, version, tags) of a wheel's file name."""
    parts = filename[:-len(".whl")].split("-")
    return _normal(parts[0]), parts[1], "-".join(parts[-3:])


def wheel_fits(tags: str, python_version: str = PYTHON_VERSION) -> bool:
    """Whether a wheel's tags (python-abi-platform) install on CPython `python_version`, Linux x86-64."""
    py, abi, plat = tags.split("-")
    cp = "cp" + python_version.replace(".", "")
    py_ok = any(t in (cp, "py3", f"py{python_version.replace('.', '')}") or (abi == "abi3" and t.startswith("cp3")
                and int(t[3:] or 0) <= int(cp[3:])) for t in py.split("."))
    abi_ok = any(a in (cp, "abi3", "none") for a in abi.split("."))
    plat_ok = any(p == "any" or (p.endswith("x86_64") and p.startswith(("manylinux", "linux")))
                  for p in plat.split("."))
    return py_ok and abi_ok and plat_ok


def write_manifest(dest: Path, data: dict) -> None:
    (dest / MANIFEST).write_text(json.dumps(data, indent=1) + "\n")


def prepare(dest: Path, llama_version: str | None = None, sdist: Path | None = None,
            python_version: str = PYTHON_VERSION, wheels: dict[str, str] | None = None) -> dict:
    """Make the bundle in `dest` (replacing one there); returns its manifest. `sdist`: a
    llama-cpp-python source archive to use instead of downloading it; `wheels`: distribution
    versions (default: those installed here; {} for none)."""
    version = llama_version or metadata.version("llama-cpp-python")
    if dest.exists() and not (dest / MANIFEST).exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BundleError(f"{dest} exists and is not a bundle (no {MANIFEST}); name a new or empty folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))  # renamed to dest once complete
    try:
        manifest = _make(work, version, sdist, python_version, wheels)
        problems = check(work)
        if problems:
            raise BundleError("the bundle made is not usable: " + "; ".join(problems))
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _make(dest: Path, version: str, sdist: Path | None, python_version: str, wheels: dict[str, str] | None) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        archive = sdist or fetch_sdist(version, Path(tmp))
        root = extract(archive, Path(tmp) / "x")
        prefix = f"llama-cpp-python-{version}"
        source = pack_source(root, dest / f"{prefix}-src.tar.gz", prefix)
        source["sdist_files"] = sum(1 for p in root.rglob("*") if p.is_file())
        source["sdist_bytes"] = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    versions = wheel_versions() if wheels is None else wheels
    files = download_wheels(versions, dest / WHEELS_DIR, python_version) if versions else []
    source["sha256"] = _sha256(dest / source["file"])
    source["bytes"] = (dest / source["file"]).stat().st_size
    manifest = {"llama_cpp_python": version, "python": python_version, "platforms": list(PLATFORMS),
                "build_options": list(BUILD_OPTIONS), "source": source,
                "wheels": [{"file": f.name, "name": wheel_name(f.name)[0], "version": wheel_name(f.name)[1],
                            "bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files],
                "requested_wheels": versions, "dropped": list(DROP), "seconds": round(time.perf_counter() - t0, 1)}
    manifest["total_bytes"] = source["bytes"] + sum(w["bytes"] for w in manifest["wheels"])
    write_manifest(dest, manifest)
    return manifest


def check(bundle: Path, contents: bool = True) -> list[str]:
    """What is wrong with a bundle (empty: nothing): manifest, checksums, size, a wheel of every
    requested distribution for the manifest's Python, and (`contents`) the source's required
    files present and dropped parts absent."""
    try:
        manifest = json.loads((bundle / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return [f"no readable {MANIFEST} in {bundle} ({exc}); make one with --prepare {bundle}"]
    problems = []
    files = [manifest["source"]] + [dict(w, file=f"{WHEELS_DIR}/{w['file']}") for w in manifest["wheels"]]
    total = 0
    for f in files:
        path = bundle / f["file"]
        if not path.is_file():
            problems.append(f"{f['file']} is missing")
        elif _sha256(path) != f["sha256"]:
            problems.append(f"{f['file']} does not match its checksum (damaged in transit?)")
        else:
            total += path.stat().st_size
    if total > LIMIT_BYTES - TREE_ALLOWANCE:
        problems.append(f"the bundle holds {total / 2**20:.1f} MiB; with the working tree it must stay under "
                        f"{LIMIT_BYTES / 2**20:.0f} MiB")
    have = {w["name"]: w for w in manifest["wheels"]}
    for name in manifest.get("requested_wheels", {}):
        w = have.get(_normal(name))
        if w is None:
            problems.append(f"no wheel of {name}")
        elif not wheel_fits(wheel_name(w["file"])[2], manifest["python"]):
            problems.append(f"{w['file']} does not install on CPython {manifest['python']} x86-64 Linux")
    if contents and not problems:
        problems += source_problems(bundle / manifest["source"]["file"], manifest["source"]["prefix"])
    return problems


def source_problems(archive: Path, prefix: str) -> list[str]:
    """Required files missing from, or dropped parts present in, a trimmed source archive."""
    with tarfile.open(archive) as tar:
        names = [n[len(prefix) + 1:] for n in tar.getnames() if n.startswith(prefix + "/")]
    problems = [f"the source lacks {r}" for r in missing_required(names)]
    kept = sorted({n for n in names if dropped(n)})
    if kept:
        problems.append(f"the source holds {len(kept)} file(s) trimming drops, e.g. {kept[0]}")
    return problems


def manifest_of(bundle: Path) -> dict:
    return json.loads((bundle / MANIFEST).read_text())


@dataclass(frozen=True)
class Unpacked:
    source: Path  # the llama-cpp-python source tree
    wheels: list[Path]


def unpack(bundle: Path, work: Path) -> Unpacked:
    """The bundle's source extracted under `work` (once per archive checksum) and its wheels."""
    problems = check(bundle, contents=False)
    if problems:
        raise BundleError("; ".join(problems))
    manifest = manifest_of(bundle)
    src = manifest["source"]
    stamp = work / "src.sha256"
    tree = work / "src" / src["prefix"]
    if not (stamp.exists() and stamp.read_text() == src["sha256"] and tree.is_dir()):
        shutil.rmtree(work / "src", ignore_errors=True)
        (work / "src").mkdir(parents=True)
        extract(bundle / src["file"], work / "src")
        stamp.write_text(src["sha256"])
    return Unpacked(tree, [bundle / WHEELS_DIR / w["file"] for w in manifest["wheels"]])


def summary(manifest: dict) -> str:
    s = manifest["source"]
    return (f"llama-cpp-python {manifest['llama_cpp_python']} source: {s['files']} of {s.get('sdist_files', '?')} files, "
            f"{s['bytes'] / 2**20:.1f} MiB packed ({s['unpacked_bytes'] / 2**20:.1f} MiB unpacked, sdist "
            f"{s.get('sdist_bytes', 0) / 2**20:.0f} MiB); {len(manifest['wheels'])} wheels "
            f"{sum(w['bytes'] for w in manifest['wheels']) / 2**20:.1f} MiB; total {manifest['total_bytes'] / 2**20:.1f} MiB")


def fake_sdist(root: Path, extra: Sequence[str] = ()) -> None:
    """A small stand-in of a llama-cpp-python sdist tree (the tests' trimming subject): every
    required file, one file under each dropped part, and `extra` paths."""
    for rel in (*REQUIRED, *(d + "x.txt" for d in DROP), _LC + "convert_hf_to_gguf.py", _LC + ".github/ci.yml",
                "docs/index.md", "tests/test_x.py", _LC + "ggml/src/ggml-cuda/template-instances/fattn.cu",
                _LC + "ggml/src/ggml-cuda/vendors/cuda.h", *extra):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rel.encode())
