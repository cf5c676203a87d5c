"""The GPU check (benchmarks/gpu_check.py) where no GPU is: its bundle, its CPU dry run, its prediction.

What is proved here: trimming keeps every file the llama.cpp build needs and drops models, docs,
tests, tools and other backends (on a small stand-in of the sdist: the real prepare downloads
80 MB; a real bundle in .gpu-bundle, when there is one, is checked too); a bundle whose file was
damaged or lacks a wheel is reported, not used; the dry run (`--cpu --no-build`) runs every
check step on tiny models and records each, a step whose process crashes is recorded as failed
while the others go on, and a step that no longer fits the budget is skipped; the shaped models
load with their padded vocabulary; the prediction's arithmetic is exact where it can be computed
by hand, and it runs on traces recorded here with a curve measured here; `localspec info
--n-gpu-layers` reports where a model's weights go.

The tests named *gpu_only* need llama.cpp with a GPU backend and skip, saying so, where it has
none (CI); benchmarks/gpu_check.py runs them on the GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import llama_cpp
import pytest

from benchmarks.gpu import (bundle, check as gpu_check, models as gpu_models, predict as gpu_predict,
                            report as gpu_report, traces as gpu_traces)

from localspec.settings.generation import VERIFIERS
from localspec.llama.model import Model

from conftest import load

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"  # the commands the docs show (python benchmarks/gpu_check.py ...), and its data
GPU = bool(llama_cpp.llama_supports_gpu_offload())
gpu_only = pytest.mark.skipif(not GPU, reason="llama.cpp has no GPU backend in this build (llama_supports_gpu_offload() "
                                              "is false): build llama-cpp-python with CMAKE_ARGS=-DGGML_CUDA=on "
                                              "(docs/gpu.md); benchmarks/gpu_check.py runs these on a GPU machine")


def run_check(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "LOCALSPEC_KEEP_ALIVE": "0", **(env or {})},
                          stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------- the bundle


def make_sdist(root: Path, extra: tuple[str, ...] = ()) -> Path:
    """A small stand-in of the llama-cpp-python sdist, as a tar.gz."""
    tree = root / "llama_cpp_python-0.3.36"
    bundle.fake_sdist(tree, extra)
    archive = root / "llama_cpp_python-0.3.36.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    return archive


def test_trimming_keeps_the_build_and_drops_the_rest(tmp_path: Path) -> None:
    bundle.fake_sdist(tmp_path)
    kept = bundle.trimmed_files(tmp_path)
    assert bundle.missing_required(kept) == []
    lc = "vendor/llama.cpp/"
    assert lc + "ggml/src/ggml-cuda/template-instances/fattn.cu" in kept
    assert lc + "ggml/src/ggml-cuda/vendors/cuda.h" in kept
    for gone in ("models/", "docs/", "tests/", "tools/", "gguf-py/", "ggml/src/ggml-vulkan/", "ggml/src/ggml-metal/"):
        assert not any(k.startswith(lc + gone) for k in kept), gone
    assert lc + "convert_hf_to_gguf.py" not in kept and lc + ".github/ci.yml" not in kept
    assert "docs/index.md" not in kept and "tests/test_x.py" not in kept
    # negative control: what the rules keep and drop, one path each
    assert not bundle.dropped(lc + "ggml/src/ggml-cuda/mmq.cu") and bundle.dropped(lc + "ggml/src/ggml-sycl/x.cpp")


def test_a_source_without_a_required_file_is_refused(tmp_path: Path) -> None:
    bundle.fake_sdist(tmp_path)
    (tmp_path / "vendor/llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt").unlink()
    with pytest.raises(bundle.BundleError, match="ggml-cuda/CMakeLists.txt"):
        bundle.pack_source(tmp_path, tmp_path / "x.tar.gz", "p")


def test_prepare_and_check_a_bundle(tmp_path: Path) -> None:
    sdist = make_sdist(tmp_path / "sdist")
    dest = tmp_path / ".gpu-bundle"
    manifest = bundle.prepare(dest, llama_version="0.3.36", sdist=sdist, wheels={})
    assert bundle.check(dest) == []
    assert manifest["total_bytes"] < bundle.LIMIT_BYTES and manifest["source"]["files"] < manifest["source"]["sdist_files"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("..gpu-bundle")] == []  # no leftover temp folder
    unpacked = bundle.unpack(dest, tmp_path / "work")
    assert (unpacked.source / "vendor/llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu").is_file()
    assert not (unpacked.source / "vendor/llama.cpp/models").exists()
    # damaged in transit: reported, and unpack refuses it
    archive = dest / manifest["source"]["file"]
    archive.write_bytes(archive.read_bytes()[:-10])
    assert any("checksum" in p for p in bundle.check(dest))
    with pytest.raises(bundle.BundleError, match="checksum"):
        bundle.unpack(dest, tmp_path / "work2")


def test_a_bundle_lacking_a_wheel_or_holding_dropped_files_is_reported(tmp_path: Path) -> None:
    dest = tmp_path / "b"
    bundle.prepare(dest, llama_version="0.3.36", sdist=make_sdist(tmp_path / "s"), wheels={})
    manifest = bundle.manifest_of(dest)
    manifest["requested_wheels"] = {"pydantic": "2.0"}
    bundle.write_manifest(dest, manifest)
    assert bundle.check(dest) == ["no wheel of pydantic"]
    untrimmed = tmp_path / "u.tar.gz"
    with tarfile.open(untrimmed, "w:gz") as tar:
        bundle.fake_sdist(tmp_path / "tree")
        tar.add(tmp_path / "tree", arcname="p")
    assert any("trimming drops" in p for p in bundle.source_problems(untrimmed, "p"))


def test_a_folder_that_is_not_a_bundle_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(bundle.BundleError, match="not a bundle"):
        bundle.prepare(tmp_path, llama_version="0.3.36", sdist=tmp_path / "none.tar.gz", wheels={})
    assert (tmp_path / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize("name,fits", [
    ("cffi-2.1.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
    ("llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl", True),
    ("pydantic-2.14.4-py3-none-any.whl", True),
    ("cffi-2.1.1-cp311-cp311-manylinux2014_x86_64.whl", False),
    ("cffi-2.1.1-cp312-cp312-manylinux2014_aarch64.whl", False),
    ("cffi-2.1.1-cp312-cp312-macosx_11_0_arm64.whl", False),
])
def test_wheel_tags_for_the_device_python(name: str, fits: bool) -> None:
    assert bundle.wheel_fits(bundle.wheel_name(name)[2], "3.12") is fits


def test_a_real_bundle_when_there_is_one() -> None:
    """.gpu-bundle made by `--prepare` here: under the limit, the trimmed source, a cp312 x86-64 wheel of each
    distribution localspec needs on the device."""
    real = ROOT / ".gpu-bundle"
    if not (real / bundle.MANIFEST).exists():
        pytest.skip("no .gpu-bundle here (python benchmarks/gpu_check.py --prepare .gpu-bundle makes one; it downloads)")
    assert bundle.check(real) == []
    manifest = bundle.manifest_of(real)
    assert manifest["total_bytes"] < bundle.LIMIT_BYTES - bundle.TREE_ALLOWANCE
    assert {bundle._normal(n) for n in bundle.WHEELS} <= {w["name"] for w in manifest["wheels"]}


def test_cublas_from_the_toolkit_else_from_the_pip_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch images carry cuBLAS as the nvidia-cublas wheel (CUDA 13: nvidia/cu13/); the build links it
    through a shim folder holding only cuBLAS's headers, so the wheel's other CUDA headers never shadow
    the toolkit's."""
    import importlib.util
    from types import SimpleNamespace

    from benchmarks.gpu import build as gpu_build

    toolkit, nvidia = tmp_path / "cuda", tmp_path / "site" / "nvidia"
    (toolkit / "lib64").mkdir(parents=True)
    for rel in ("cu13/lib/libcublas.so.13", "cu13/lib/libcublasLt.so.13", "cu13/include/cublas_v2.h",
                "cu13/include/cublas_api.h", "cu13/include/cuda_runtime.h"):
        (nvidia / rel).parent.mkdir(parents=True, exist_ok=True)
        (nvidia / rel).write_text(rel)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(
        submodule_search_locations=[str(nvidia)]) if name == "nvidia" else real_find(name, *a))
    got = gpu_build._cublas(toolkit, tmp_path / "work")
    shim = tmp_path / "work" / "cublas"
    assert got["from"] == "pip" and got["include"] == str(shim / "include")
    assert sorted(p.name for p in (shim / "include").iterdir()) == ["cublas_api.h", "cublas_v2.h"]
    assert (shim / "lib" / "libcublas.so").read_text() == "cu13/lib/libcublas.so.13"
    assert (shim / "lib" / "libcublasLt.so.13").resolve() == (nvidia / "cu13/lib/libcublasLt.so.13").resolve()
    (toolkit / "lib64" / "libcublas.so.13").write_text("")
    assert gpu_build._cublas(toolkit, tmp_path / "work")["from"] == "toolkit"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    (toolkit / "lib64" / "libcublas.so.13").unlink()
    with pytest.raises(gpu_build.BuildFailed, match="no cuBLAS"):
        gpu_build._cublas(toolkit, tmp_path / "work")


# ---------------------------------------------------------------- the dry run


def test_cpu_dry_run_records_every_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    t0 = time.perf_counter()
    r = run_check("--cpu", "--no-build", "--out", str(out), "--work", str(tmp_path / "work"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    state = json.loads((out / gpu_report.JSON_NAME).read_text())
    status = {s["name"]: s["status"] for s in state["steps"]}
    assert list(status) == list(gpu_check.CHECK_STEPS)
    assert status.pop("gpu_tests") == "skipped"
    assert set(status.values()) == {"ok"}, {n: s for n, s in status.items() if s != "ok"}
    steps = {s["name"]: s for s in state["steps"]}
    curve = steps["cost_curve"]["data"]["target_seconds"]
    assert {str(n) for n in range(1, 17)} <= set(curve) and all(v > 0 for v in curve.values())
    assert set(steps["verifier_share"]["data"]) == set(VERIFIERS)
    md = (out / gpu_report.MD_NAME).read_text()
    assert "| lossless | ok |" in md and "## Pass cost on this machine" in md and md in r.stdout
    assert time.perf_counter() - t0 < 120


def test_a_crashing_step_is_recorded_and_the_rest_go_on(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = run_check("--cpu", "--no-build", "--steps", "tiny_models,info,prompt_cache", "--out", str(out), "--work",
                  str(tmp_path / "work"), env={"GPU_CHECK_CRASH_AT": "info"})
    assert r.returncode == 1
    steps = {s["name"]: s for s in json.loads((out / gpu_report.JSON_NAME).read_text())["steps"]}
    assert steps["info"]["status"] == "failed" and "SIGABRT" in steps["info"]["summary"]
    assert steps["tiny_models"]["status"] == steps["prompt_cache"]["status"] == "ok"


def test_steps_past_the_budget_are_skipped(tmp_path: Path) -> None:
    state = gpu_report.new_state("cpu", "quick", 60, ["tiny_models", "greedy"], [], tmp_path)
    state["deadline"] = time.time() - 1
    path = tmp_path / "state.json"
    gpu_report.save(state, path)
    assert gpu_check.runner_main(path) == 0
    steps = gpu_report.load(path)["steps"]
    assert [s["status"] for s in steps] == ["skipped", "skipped"] and "time budget" in steps[0]["summary"]


@pytest.mark.parametrize("args,flag", [(["--steps", "tiny_models,bogus"], "--steps"), (["--budget", "5"], "--budget")])
def test_usage_errors_name_the_flag(args: list[str], flag: str) -> None:
    r = run_check(*args)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- shaped models


def test_shaped_models_load_with_their_padded_vocabulary(tmp_path: Path, tiny_target: Model) -> None:
    target, draft = gpu_models.shaped_pair(tmp_path, "small")
    assert not list(tmp_path.glob("*f16*")) and not list(tmp_path.glob("*.part"))  # only the quantized files stay
    with load(target) as t, load(draft) as d:
        for m, shape in ((t, gpu_models.SMALL_TARGET), (d, gpu_models.SMALL_DRAFT)):
            assert m.meta("general.architecture") == "qwen2"
            assert int(m.meta("qwen2.embedding_length")) == shape.n_embd and m.n_vocab == shape.n_vocab
        text = "hello World 42"
        assert t.tokenize(text) == tiny_target.tokenize(text)  # tiny's spm406 ids, padding after them
    assert gpu_models.TARGET_1_5B.parameters > 1.7e9 and gpu_models.DRAFT_0_5B.parameters > 0.6e9


# ---------------------------------------------------------------- prediction


def step(kind: str, depth: int, accepted: int) -> list:
    return [kind, [1] * depth, accepted]


def traces(runs: list[dict]) -> dict:
    return {"max_tokens": 64, "recorded_on": {"cpu": "test", "llama_cpp": "x"}, "runs": runs}


def run(config: str, drafter: str, verifier: str, steps: list, t: float = 0.0) -> dict:
    tokens = sum(a + 1 for _, _, a in steps)
    return {"prompt": "p", "config": config, "drafter": drafter, "verifier": verifier, "temperature": t,
            "tokens": tokens, "steps": steps, "prompt_tokens": [1, 2, 3], "output": list(range(tokens))}


def test_prediction_arithmetic_by_hand() -> None:
    steps = [step("model", 4, 4), step("model", 4, 1), step("ngram", 2, 0), step("-", 0, 0)]  # 5 + 2 + 1 + 1 tokens
    t = traces([run("block k4", "model", "block", steps)])
    flat = gpu_predict.Costs({1: 1.0, 16: 1.0}, {1: 0.0, 16: 0.0})
    (row,) = gpu_predict.predict(t, flat)
    assert row["speedup"] == pytest.approx(9 / 4)  # free drafts, free verification: tokens per step
    linear = gpu_predict.Costs({1: 1.0, 16: 16.0}, {1: 0.0, 16: 0.0})
    assert gpu_predict.predict(t, linear)[0]["speedup"] == pytest.approx(9 / (5 + 5 + 3 + 1))
    drafts = gpu_predict.Costs({1: 1.0, 16: 1.0}, {1: 0.5, 16: 0.5}, overhead=0.25)
    # model steps: 1 pass + 4 draft decodes (root and 3 levels, not the leaf) of 0.5; + 0.25 overhead per step
    want = 9 * 1.25 / (2 * (1 + 4 * 0.5 + 0.25) + 2 * 1.25)
    assert gpu_predict.predict(t, drafts)[0]["speedup"] == pytest.approx(want)
    assert gpu_predict.acceptance_alpha(t["runs"]) == pytest.approx(1 - 1 / (4 + 2))


def test_prediction_from_traces_and_a_curve_measured_here(tiny_target: Model, tiny_draft: Model) -> None:
    from benchmarks.common.target import cost_curve

    prompts = {"rep": tiny_target.tokenize("def add(a, b): return a + b. def add(a, b): return")}
    configs = [c for c in gpu_traces.TRACE_CONFIGS if c[0] in ("greedy k4", "block k4", "traversal t3x2x1x1",
                                                                  "ngram block k4")]
    recorded = traces(gpu_traces.record_traces(tiny_target, tiny_draft, prompts, 16, 1, configs, progress=False))
    costs = gpu_predict.Costs(cost_curve(tiny_target, sizes=(1, 2, 4, 8, 16), rounds=2),
                              cost_curve(tiny_draft, sizes=(1, 2, 4, 8), rounds=2), source="this CPU")
    rows = gpu_predict.predict(recorded, costs)
    assert {(r["config"], r["temperature"]) for r in rows} == {(c[0], t) for c in configs for t in c[4]}
    assert all(r["speedup"] > 0 and r["tokens"] == 16 for r in rows)
    assert gpu_predict.ngram_auto(recorded, costs)[0]["speedup"] > 0
    planner = gpu_predict.planner_rows(recorded, costs, tiny_target.file_bytes, tiny_draft.file_bytes, 0.1)
    text = gpu_predict.markdown(recorded, costs, rows, [], planner)
    assert text.startswith("**Prediction, not a measurement**") and "traversal t3x2x1x1" in text


def test_the_recorded_traces_cover_every_verifier() -> None:
    path = BENCH / "data" / "acceptance_traces.json"
    data = json.loads(path.read_text())
    assert {r["verifier"] for r in data["runs"]} == set(VERIFIERS)
    assert {r["drafter"] for r in data["runs"]} == {"model", "ngram", "hybrid"}
    rows = gpu_predict.predict(data, gpu_predict.costs_from_ratios({1: 1.0, 2: 1.8, 4: 3.0, 8: 6.5, 16: 9.0}, 0.6))
    assert all(0 < r["speedup"] < 3 and (r["acceptance"] is None or 0 <= r["acceptance"] <= 1) for r in rows)


def test_predict_usage_errors() -> None:
    r = subprocess.run([sys.executable, str(BENCH / "gpu_predict.py"), "--curve", "2:1.5"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2 and "--draft-ratio" in r.stderr
    r = subprocess.run([sys.executable, str(BENCH / "gpu_predict.py"), "--curve", "2:9", "--draft-ratio", "0.5"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "2:9" in r.stderr


# ---------------------------------------------------------------- localspec info --n-gpu-layers


def test_info_reports_where_the_weights_go(tiny_paths: tuple[Path, Path]) -> None:
    from click.testing import CliRunner

    from localspec.cli import cli

    r = CliRunner().invoke(cli, ["info", "--json", "-m", str(tiny_paths[0]), "--n-gpu-layers", "-1"])
    assert r.exit_code == 0, r.output
    model = json.loads(r.output)["cpu_kernels"]["model"]
    assert model["n_gpu_layers"] == -1 and sum(model["weight_buffers_mib"].values()) > 0
    bad = CliRunner().invoke(cli, ["info", "-m", str(tiny_paths[0]), "--n-gpu-layers", "-2"])
    assert bad.exit_code == 2 and "--n-gpu-layers" in bad.output


# ---------------------------------------------------------------- on a GPU build only


def device_share(model: Model) -> float:
    buffers = model.weight_buffers
    return sum(v for k, v in buffers.items() if not k.upper().startswith("CPU")) / sum(buffers.values())


@gpu_only
def test_gpu_only_all_layers_go_to_the_device(quantized_paths: dict) -> None:
    target, draft = quantized_paths["q4_k_m"]
    with load(target, n_gpu_layers=-1) as t, load(draft, n_gpu_layers=-1) as d, load(target) as cpu:
        assert device_share(t) > 0.5 and device_share(d) > 0.5
        assert device_share(cpu) == 0  # negative control: no layers asked for, none offloaded


@gpu_only
def test_gpu_only_greedy_speculation_equals_the_target_alone(quantized_paths: dict) -> None:
    from greedy import assert_greedy_equal

    from localspec.api import stream_generate

    target, draft = quantized_paths["q4_k_m"]
    with load(target, n_gpu_layers=-1) as t, load(draft, n_gpu_layers=-1) as d:
        plain = [r.token for r in stream_generate(t, None, "def add(a, b):", temperature=0, max_tokens=32,
                                                  num_draft_tokens=0)]
        for verifier, shape in (("block", dict(num_draft_tokens=4)), ("traversal", dict(tree=(3, 2, 1)))):
            spec = [r.token for r in stream_generate(t, d, "def add(a, b):", temperature=0, max_tokens=32,
                                                     verifier=verifier, plan="fixed", drafter="model", **shape)]
            assert_greedy_equal(t, "def add(a, b):", spec, plain, f"{verifier} on the GPU", tol=0.02)


@gpu_only
def test_gpu_only_prompt_cache_restores_device_kv_bit_for_bit(quantized_paths: dict, tmp_path: Path) -> None:
    from localspec.api import Generation
    from localspec.settings.generation import GenerationConfig
    from localspec.decoding.profiles import Profiles
    from localspec.llama.prompt_cache import PromptCache

    cache = PromptCache(tmp_path)
    config = GenerationConfig.from_options(temperature=0.0, max_tokens=8, num_draft_tokens=0)
    with load(quantized_paths["q4_k_m"][0], n_gpu_layers=-1) as m:
        prompt = m.tokenize("def add(a, b):\n    return a + b\n\n" * 6)
        first = [r.token for r in Generation(m, None, prompt, config, Profiles.in_memory(), cache)]
        saved = cache.entries()[0]
        m.clear()
        assert cache.restore(m, prompt) == len(prompt) - 1
        assert m.seq_state() == cache.load(saved)
        m.clear()
        g = Generation(m, None, prompt, config, Profiles.in_memory(), cache)
        assert [r.token for r in g] == first and g.restored == len(prompt) - 1
