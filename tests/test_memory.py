"""The memory estimate (localspec.estimate_memory) against what llama.cpp reports when it loads.

Each configuration loads a tiny model through localspec's own loader (Model) with the context
localspec creates for its options (n_ctx = ctx_size × parallel cells, n_seq_max × parallel
sequences, n_batch, n_ubatch = min(n_batch, 512), flash attention and the cache type as asked),
captures llama.cpp's log and compares each of its buffers (weights, KV cache, compute, output) and
their total with the estimate: within 15 %, or within the 0.01 MiB llama.cpp rounds its sizes to.
The negative controls are estimates that leave out the KV cache, the slots, flash attention's
effect or the graph allocator's reuse of memory: each must fail the same comparison. (The default
pair is measured by benchmarks/memory.py; docs/memory.md has its table.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import localspec
from localspec.cli import cli
from localspec.core.entries import MEMORY_MARGIN, loaded_bytes, model_bytes
from localspec.core.pairs import ModelFile
from localspec.errors import ConfigError, ModelError
from localspec.llama import backend, compute_buffer, memory
from localspec.llama.memory import TERMS, estimate_model, one_slot, reported_mib
from localspec.llama.model import Model
from localspec.settings.models import ModelOptions

import tiny_models as tiny

MiB = 2**20
TOLERANCE = 0.15
ROUNDING = 0.006  # MiB: llama.cpp prints sizes to 0.01 MiB

# (model, options): contexts of 256 to 16,384 cells, 1 to 4 slots, 4 to 64 sequences, micro-batches
# of 16 to 512 tokens (one not a multiple of the sequences), flash attention on and off, each cache type
CONFIGS = [
    ("tiny", dict()),  # the defaults: 4 slots of 4,096 tokens, 64 sequences
    ("tiny", dict(ctx_size=100, parallel=1)),
    ("tiny", dict(ctx_size=1000, parallel=2, n_seq_max=4, batch_size=64)),
    ("tiny", dict(ctx_size=2048, parallel=3, batch_size=50)),
    ("tiny", dict(ctx_size=512, parallel=2, flash_attn="off", cache_type="f32")),
    ("tiny", dict(ctx_size=3000, parallel=1, batch_size=2048, cache_type="f32")),
    ("wide", dict(ctx_size=3000, parallel=4, cache_type="q8_0")),
    ("wide", dict(ctx_size=700, parallel=2, n_seq_max=8, batch_size=16, flash_attn="off")),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The default tiny target (heads of 16 values) and a wider qwen2 one whose 64-value heads a q8_0
    cache takes (and rotates: llama.cpp's Walsh-Hadamard inputs join the graph)."""
    directory = tmp_path_factory.mktemp("memory")
    return {"tiny": tiny.write_tiny_model(directory / "tiny.gguf"),
            "wide": tiny.write_tiny_model(directory / "wide.gguf", n_embd=128, n_head=2, n_head_kv=1, n_ff=384,
                                          n_layer=3, arch="qwen2")}


def measured(path: Path, options: ModelOptions) -> dict[str, float]:
    """The MiB llama.cpp reports for each buffer as localspec's loader loads `path` with the context
    of `options` (memory.one_slot: the same llama.cpp context whatever the loader's slot mapping)."""
    with backend.capture_log() as lines:
        Model(path, dataclasses.replace(one_slot(options), threads=1)).close()
    return reported_mib(lines)


def close(estimate: int, mib: float) -> bool:
    return abs(estimate / MiB - mib) <= max(TOLERANCE * mib, ROUNDING)


def check(estimate: memory.ModelMemory, reported: dict[str, float]) -> None:
    """Every term and the total within the tolerance; AssertionError naming the first that is not."""
    for term in TERMS:
        assert close(getattr(estimate, term), reported[term]), (term, getattr(estimate, term) / MiB, reported)
    assert close(estimate.total, sum(reported.values())), ("total", estimate.total / MiB, reported)


@pytest.fixture(scope="module")
def runs(models: dict[str, Path]) -> list[tuple[Path, ModelOptions, dict[str, float]]]:
    out = []
    for name, load in CONFIGS:
        options = ModelOptions(**load)
        out.append((models[name], options, measured(models[name], options)))
    return out


def test_every_buffer_is_estimated_as_llama_cpp_reports_it(runs: list) -> None:
    for path, options, reported in runs:
        assert reported["kv_cache"] > 0 and reported["compute"] > 0, reported  # the log was read
        check(estimate_model(path, options), reported)


def check_exact(runs: list) -> None:
    """The KV cache, compute and output buffers to the 0.01 MiB llama.cpp prints."""
    for path, options, reported in runs:
        estimate = estimate_model(path, options)
        for term in ("kv_cache", "compute", "output"):
            assert abs(getattr(estimate, term) / MiB - reported[term]) <= ROUNDING, (term, options, reported)


def test_the_estimate_follows_the_replay_of_llama_cpp_to_its_rounding(runs: list) -> None:
    """Tighter than the target: the terms are derived, not fitted, so they agree with llama.cpp's
    own sizes to its rounding."""
    check_exact(runs)


def test_negative_control_an_estimate_without_the_kv_cache_fails(runs: list) -> None:
    for path, options, reported in runs:
        broken = dataclasses.replace(estimate_model(path, options), kv_cache=0)
        with pytest.raises(AssertionError):
            check(broken, reported)


def test_negative_control_an_estimate_that_ignores_the_slots_fails(runs: list) -> None:
    """Sized for one slot of ctx_size tokens and n_seq_max sequences, as if parallel were 1."""
    several = [(p, o, r) for p, o, r in runs if o.slots > 1]
    assert len(several) >= 4
    for path, options, reported in several:
        broken = estimate_model(path, dataclasses.replace(options, parallel=1))
        with pytest.raises(AssertionError):
            check(broken, reported)


def test_negative_control_flash_attention_must_be_followed(runs: list) -> None:
    """Attention without flash attention keeps an n_kv × n_tokens × n_head score matrix: an estimate
    that takes flash attention for granted misses it (and the other way round overcounts)."""
    for path, options, reported in runs[:1] + [r for r in runs if r[1].flash_attn == "off"]:
        other = "on" if options.flash_attn == "off" else "off"
        with pytest.raises(AssertionError):
            check(estimate_model(path, dataclasses.replace(options, flash_attn=other)), reported)


def test_negative_control_the_allocator_must_reuse_memory(runs: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay without in-place reuse, or one that never frees a tensor, is off on the compute buffer."""
    path, options, reported = runs[0]
    monkeypatch.setattr(compute_buffer, "IN_PLACE", frozenset())
    with pytest.raises(AssertionError):
        check_exact([runs[0]])
    monkeypatch.undo()
    monkeypatch.setattr(compute_buffer.FreeList, "free", lambda self, offset, size: None)
    with pytest.raises(AssertionError):
        check(estimate_model(path, options), reported)


# ---------------------------------------------------------------- the API


def test_the_pair_estimate_sums_its_models(models: dict[str, Path]) -> None:
    estimate = localspec.estimate_memory(models["wide"], models["tiny"], ctx_size=1024, parallel=2)
    assert isinstance(estimate, localspec.MemoryEstimate)
    target, draft = estimate.target, estimate.draft
    assert target == estimate_model(models["wide"], ModelOptions(ctx_size=1024, parallel=2))
    assert draft == estimate_model(models["tiny"], ModelOptions(ctx_size=1024, parallel=2))
    assert estimate.total == target.total + draft.total
    assert estimate.kv_cache == target.kv_cache + draft.kv_cache and target.n_cells == 2048
    assert localspec.estimate_memory(models["tiny"]).draft is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        estimate.target = draft  # type: ignore[misc]
    data = estimate.as_dict()
    assert json.loads(json.dumps(data))["total"] == estimate.total and data["target"]["total"] == target.total


def test_keywords_apply_over_options_and_each_term_moves_as_it_should(models: dict[str, Path]) -> None:
    path = models["tiny"]
    base = localspec.estimate_memory(path, options=ModelOptions(ctx_size=2048, parallel=1)).target
    doubled = localspec.estimate_memory(path, options=ModelOptions(ctx_size=2048, parallel=1), parallel=2).target
    assert doubled.kv_cache == 2 * base.kv_cache and doubled.output == 2 * base.output
    assert doubled.weights == base.weights
    f32 = localspec.estimate_memory(path, ctx_size=2048, parallel=1, cache_type="f32").target
    assert f32.kv_cache == 2 * base.kv_cache
    small = localspec.estimate_memory(path, ctx_size=2048, parallel=1, batch_size=16).target
    assert small.compute < base.compute and small.kv_cache == base.kv_cache
    mapped = localspec.estimate_memory(path, ctx_size=2048, parallel=1, load_mode="mmap").target
    assert abs(mapped.weights - base.weights) < 32 * 64  # F32 weights: nothing repacked, the span of the data


def test_bad_options_are_config_errors(models: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="parallel must lie in"):
        localspec.estimate_memory(models["tiny"], parallel=0)
    with pytest.raises(ConfigError, match="cache_type"):
        localspec.estimate_memory(models["tiny"], cache_type="q4")


def test_files_that_cannot_be_estimated_are_model_errors_naming_them(tmp_path: Path, models: dict[str, Path]) -> None:
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ModelError, match=f"not found: {missing}"):
        localspec.estimate_memory(missing)
    with pytest.raises(ModelError, match="not a file"):
        localspec.estimate_memory(tmp_path)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model at all\n")
    with pytest.raises(ModelError, match=f"{text} is not a GGUF file"):
        localspec.estimate_memory(text)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(models["tiny"].read_bytes()[:5000])
    with pytest.raises(ModelError, match=f"cannot read the header of {cut}"):
        localspec.estimate_memory(cut)
    bare = tmp_path / "bare.gguf"
    writer = tiny.gguf_package().GGUFWriter(bare, "llama")
    writer.add_block_count(2)
    tiny.write_file(bare, writer, {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(ModelError, match=f"{bare} has no 'llama.embedding_length' in its metadata"):
        localspec.estimate_memory(bare)
    recurrent = tiny.write_tiny_recurrent(tmp_path / "mamba.gguf")
    with pytest.raises(ModelError, match="mamba.gguf is a recurrent/hybrid model"):
        localspec.estimate_memory(recurrent)
    with pytest.raises(ModelError, match=r"blocks of 32, which do not divide tiny.gguf's attention heads \(16 key"):
        localspec.estimate_memory(models["tiny"], cache_type="q8_0")
    with pytest.raises(ModelError, match="missing.gguf"):  # the draft's file is named too
        localspec.estimate_memory(models["tiny"], missing)


def test_metadata_that_is_not_a_count_is_a_model_error(tmp_path: Path) -> None:
    """Every other key a transformer needs is there; one is zero, or an array of the wrong length."""
    def model(name: str, key: str, value: object) -> Path:
        path = tmp_path / name
        gguf = tiny.gguf_package()
        writer = gguf.GGUFWriter(path, "llama")
        writer.add_block_count(2)
        writer.add_embedding_length(64)
        writer.add_head_count(4)
        writer.add_feed_forward_length(128)
        writer.add_token_list(["a", "b", "c"])
        kind = gguf.GGUFValueType.ARRAY if isinstance(value, list) else gguf.GGUFValueType.UINT32
        writer.add_key_value(key, value, kind)
        return tiny.write_file(path, writer, {"token_embd.weight": np.zeros((3, 64), np.float32)})

    fine = model("fine.gguf", "llama.attention.key_length", 16)
    assert estimate_model(fine, ModelOptions(ctx_size=256, parallel=1)).kv_cache > 0  # the control
    with pytest.raises(ModelError, match="zero.gguf: llama.attention.key_length is 0; .* positive whole number"):
        estimate_model(model("zero.gguf", "llama.attention.key_length", 0))
    with pytest.raises(ModelError, match=r"short.gguf: llama.attention.head_count_kv is \(2,\), not a count"):
        estimate_model(model("short.gguf", "llama.attention.head_count_kv", [2]))


# ---------------------------------------------------------------- the resident core and the CLI


def test_the_resident_core_checks_and_shows_the_estimate(models: dict[str, Path], tmp_path: Path) -> None:
    """model_bytes (before a load) and loaded_bytes (`ps`) are the estimate; a file that cannot be
    estimated counts its size with a margin (its load says what is wrong); a closed model nothing."""
    options = ModelOptions(ctx_size=512, parallel=2)
    file = ModelFile.at(models["tiny"])
    assert model_bytes(file, options) == estimate_model(models["tiny"], options).total
    assert model_bytes(file, dataclasses.replace(options, parallel=4)) > model_bytes(file, options)
    assert model_bytes(None, options) == 0
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf" * 100)
    assert model_bytes(ModelFile.at(junk), options) == int(MEMORY_MARGIN * 1000)
    model = Model(models["tiny"], one_slot(options))
    try:
        assert loaded_bytes(model) == estimate_model(models["tiny"], one_slot(options)).total
    finally:
        model.close()
    assert loaded_bytes(model) == 0


def test_models_inspect_shows_the_estimate_for_the_flags(models: dict[str, Path]) -> None:
    path = models["tiny"]
    result = CliRunner().invoke(cli, ["models", "inspect", str(path)])
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("memory loaded:"))
    assert "KV cache 4.0 MiB (4 × 4,096 tokens, f16)" in line  # the defaults: 16,384 cells of 256 B
    result = CliRunner().invoke(cli, ["models", "inspect", str(path), "--json", "--ctx-size", "1000", "--parallel", "2",
                                      "--cache-type", "f32"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)["memory"]
    expected = estimate_model(path, ModelOptions(ctx_size=1000, parallel=2, cache_type="f32"))
    assert shown["total"] == expected.total and shown["kv_cache"] == expected.kv_cache
    assert (shown["ctx_size"], shown["parallel"], shown["cache_type"]) == (1000, 2, "f32")
    result = CliRunner().invoke(cli, ["models", "inspect", str(path), "--parallel", "99"])
    assert result.exit_code != 0 and "Invalid value for --parallel" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["models", "inspect", str(path), "--cache-type", "q8_0"])
    assert result.exit_code == 0 and "architecture:    llama" in result.output  # the rest is shown
    assert "memory loaded:   not estimated: cache_type q8_0 stores values in blocks of 32" in result.output
