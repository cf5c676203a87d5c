"""The GPU check (benchmarks/gpu_check.py) where no GPU is: its bundle, its build's command lines, its
process handling, the shaped pair it measures, its report, and the whole command on a CPU build.

Trimming keeps every file the llama.cpp build needs and drops models, docs, tests, tools and other
backends (on a small stand-in of the sdist: the real one is an 80 MB download; a real bundle in
.gpu-bundle, when there is one, is checked too); a bundle that is damaged, too large or lacks a
wheel is reported, not used. The tests named *gpu_only* need llama.cpp with a GPU backend and
skip, saying so, where it has none; benchmarks/gpu_check.py runs the whole suite on a GPU machine
with TESTS_N_GPU_LAYERS=-1, which conftest.load() and the tiny-model fixtures read.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from benchmarks.gpu import build, bundle, check, measure, report

from localspec.llama.model import Model

import conftest
from conftest import load

ROOT = Path(__file__).resolve().parents[1]
GPU = bool(llama_cpp.llama_supports_gpu_offload())
gpu_only = pytest.mark.skipif(not GPU, reason="llama.cpp has no GPU backend in this build (llama_supports_gpu_offload() "
                                              "is false): build llama-cpp-python with CMAKE_ARGS=-DGGML_CUDA=on "
                                              "(docs/gpu.md); benchmarks/gpu_check.py runs these on a GPU machine")
LC = bundle.LC


# ---------------------------------------------------------------- the bundle


def stand_in_sdist(root: Path, extra: tuple[str, ...] = ()) -> Path:
    """A small stand-in of a llama-cpp-python sdist tree: every required file, one file under each
    dropped part, and `extra` paths."""
    for rel in (*bundle.REQUIRED, *(d + "x.txt" for d in bundle.DROP), LC + "convert_hf_to_gguf.py", LC + ".github/ci.yml",
                "docs/index.md", "tests/test_x.py", LC + "ggml/src/ggml-cuda/template-instances/fattn.cu",
                LC + "ggml/src/ggml-cuda/vendors/cuda.h", *extra):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rel.encode())
    return root


def sdist_archive(root: Path) -> Path:
    tree = stand_in_sdist(root / "llama_cpp_python-0.3.36")
    with tarfile.open(root / "sdist.tar.gz", "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    return root / "sdist.tar.gz"


def test_trimming_keeps_the_build_and_drops_the_rest(tmp_path: Path) -> None:
    kept = bundle.trimmed_files(stand_in_sdist(tmp_path))
    assert set(bundle.REQUIRED) <= set(kept)
    assert {LC + "ggml/src/ggml-cuda/template-instances/fattn.cu", LC + "ggml/src/ggml-cuda/vendors/cuda.h"} <= set(kept)
    for gone in ("models/", "docs/", "tests/", "tools/", "gguf-py/", "ggml/src/ggml-vulkan/", "ggml/src/ggml-metal/"):
        assert not any(k.startswith(LC + gone) for k in kept), gone
    assert not {LC + "convert_hf_to_gguf.py", LC + ".github/ci.yml", "docs/index.md", "tests/test_x.py"} & set(kept)
    # negative control: what the rules keep and drop, one path each
    assert not bundle.dropped(LC + "ggml/src/ggml-cuda/mmq.cu") and bundle.dropped(LC + "ggml/src/ggml-sycl/x.cpp")


def test_a_source_without_a_required_file_is_refused(tmp_path: Path) -> None:
    stand_in_sdist(tmp_path)
    (tmp_path / LC / "ggml/src/ggml-cuda/CMakeLists.txt").unlink()
    with pytest.raises(bundle.BundleError, match="ggml-cuda/CMakeLists.txt"):
        bundle.pack_source(tmp_path, tmp_path / "x.tar.gz", "p")


def test_prepare_check_and_unpack_a_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / ".gpu-bundle"
    manifest = bundle.prepare(dest, version="0.3.36", sdist=sdist_archive(tmp_path / "s"), wheels={})
    assert bundle.check(dest) == [] and manifest["source"]["files"] == len(bundle.trimmed_files(
        tmp_path / "s" / "llama_cpp_python-0.3.36"))
    tree = bundle.unpack(dest, tmp_path / "work")
    assert (tree / LC / "include/llama.h").read_text() == LC + "include/llama.h"
    assert not (tree / LC / "docs").exists()
    # negative controls: too large, a wheel missing, a damaged file
    monkeypatch.setattr(bundle, "LIMIT_BYTES", bundle.TREE_ALLOWANCE + 100)
    assert [p for p in bundle.check(dest) if "must stay under" in p]
    monkeypatch.undo()
    manifest["requested"] = {"pydantic": "2.0"}
    (dest / bundle.MANIFEST).write_text(json.dumps(manifest))
    assert bundle.check(dest) == ["no wheel of pydantic"]
    with (dest / manifest["source"]["file"]).open("ab") as fh:
        fh.write(b"x")
    assert any("checksum" in p for p in bundle.check(dest))
    with pytest.raises(bundle.BundleError, match="checksum"):
        bundle.unpack(dest, tmp_path / "work2")


def test_an_archive_reaching_outside_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("x")
    with tarfile.open(tmp_path / "evil.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "x", arcname="top/../../escaped")
    with pytest.raises(bundle.BundleError, match="evil.tar.gz"):
        bundle.extract(tmp_path / "evil.tar.gz", tmp_path / "into")
    assert not (tmp_path / "escaped").exists()


def test_a_folder_that_is_not_a_bundle_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(bundle.BundleError, match="not a bundle"):
        bundle.prepare(tmp_path, version="0.3.36", sdist=tmp_path / "none.tar.gz", wheels={})
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_download_command_lines(tmp_path: Path) -> None:
    sdist = bundle.download_command(tmp_path, ["llama-cpp-python==0.3.36"])
    assert sdist[1:] == ["-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp_path), "--no-binary", ":all:",
                         "llama-cpp-python==0.3.36"]
    wheels = bundle.download_command(tmp_path, ["cffi==2.1.1"], "3.12")
    assert "--no-binary" not in wheels and wheels[-1] == "cffi==2.1.1"
    assert wheels[wheels.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in wheels
    platforms = [wheels[i + 1] for i, a in enumerate(wheels) if a == "--platform"]
    assert platforms[0] == "manylinux_2_39_x86_64" and "manylinux2014_x86_64" in platforms


def test_a_real_bundle_when_there_is_one() -> None:
    """.gpu-bundle made by --prepare here: under the limit, a wheel of each distribution the check
    needs, and the trimmed source holding what the build needs and nothing trimming drops."""
    real = ROOT / ".gpu-bundle"
    if not (real / bundle.MANIFEST).exists():
        pytest.skip("no .gpu-bundle here (python benchmarks/gpu_check.py --prepare .gpu-bundle makes one; it downloads)")
    assert bundle.check(real) == []
    manifest = bundle.manifest_of(real)
    assert {bundle.normal(n) for n in bundle.WHEELS} <= {w["name"] for w in manifest["wheels"]}
    prefix = manifest["source"]["prefix"] + "/"
    with tarfile.open(real / manifest["source"]["file"]) as tar:
        names = [n[len(prefix):] for n in tar.getnames() if n.startswith(prefix)]
    assert set(bundle.REQUIRED) <= set(names) and not [n for n in names if bundle.dropped(n)]


# ---------------------------------------------------------------- the build's command lines


def test_cmake_arguments_for_each_build() -> None:
    assert build.cmake_args(None) == ["-DLLAVA_BUILD=OFF"]
    toolkit = build.cmake_args("90", {"from": "toolkit", "lib": "/cuda/lib64"}, ("-DGGML_CUDA_NO_VMM=ON",))
    assert toolkit == ["-DLLAVA_BUILD=OFF", "-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_NO_VMM=ON"]
    pip = build.cmake_args("90", {"from": "pip", "lib": "/w/cublas/lib", "include": "/w/cublas/include"})
    assert pip[3:] == ["-DCUDA_cublas_LIBRARY=/w/cublas/lib/libcublas.so",
                       "-DCUDA_cublasLt_LIBRARY=/w/cublas/lib/libcublasLt.so",
                       "-DCMAKE_CUDA_FLAGS=-I/w/cublas/include", "-DCMAKE_CXX_FLAGS=-I/w/cublas/include"]
    cmd = build.pip_command(Path("/w/venv/bin/python"), "--no-build-isolation", Path("/src"))
    assert cmd[:4] == ["/w/venv/bin/python", "-m", "pip", "install"] and cmd[-2:] == ["--no-build-isolation", "/src"]
    assert {"--no-index", "--no-deps", "--ignore-installed"} <= set(cmd)  # nothing fetched, the build's own copy


def test_cublas_from_the_toolkit_else_from_the_pip_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch images carry cuBLAS as the nvidia-cublas wheel (CUDA 13: nvidia/cu13/); the build links it
    through a shim folder holding only cuBLAS's headers, so the wheel's other CUDA headers never shadow
    the toolkit's."""
    import importlib.util
    from types import SimpleNamespace

    toolkit, nvidia = tmp_path / "cuda", tmp_path / "site" / "nvidia"
    (toolkit / "lib64").mkdir(parents=True)
    for rel in ("cu13/lib/libcublas.so.13", "cu13/lib/libcublasLt.so.13", "cu13/include/cublas_v2.h",
                "cu13/include/cublas_api.h", "cu13/include/cuda_runtime.h"):
        (nvidia / rel).parent.mkdir(parents=True, exist_ok=True)
        (nvidia / rel).write_text(rel)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(
        submodule_search_locations=[str(nvidia)]) if name == "nvidia" else real_find(name, *a))
    got, shim = build.find_cublas([toolkit], tmp_path / "work"), tmp_path / "work" / "cublas"
    assert got == {"from": "pip", "lib": str(shim / "lib"), "include": str(shim / "include")}
    assert sorted(p.name for p in (shim / "include").iterdir()) == ["cublas_api.h", "cublas_v2.h"]
    assert (shim / "lib" / "libcublas.so").read_text() == "cu13/lib/libcublas.so.13"
    assert (shim / "lib" / "libcublasLt.so.13").resolve() == (nvidia / "cu13/lib/libcublasLt.so.13").resolve()
    (toolkit / "lib64" / "libcublas.so.13").write_text("")
    assert build.find_cublas([tmp_path / "other", toolkit], tmp_path / "work")["from"] == "toolkit"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    (toolkit / "lib64" / "libcublas.so.13").unlink()
    with pytest.raises(build.BuildFailed, match="no cuBLAS"):
        build.find_cublas([toolkit], tmp_path / "work")


def test_the_driver_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "DRIVER_DIRS", (str(tmp_path / "driver"),))
    assert build.driver_option([tmp_path]) == ("-DGGML_CUDA_NO_VMM=ON",)  # no stub, no driver
    (tmp_path / "driver").mkdir()
    (tmp_path / "driver" / "libcuda.so.1").write_text("")
    assert build.driver_option([tmp_path]) == (f"-DCUDA_cuda_driver_LIBRARY={tmp_path / 'driver' / 'libcuda.so.1'}",)
    (tmp_path / "lib64" / "stubs").mkdir(parents=True)
    (tmp_path / "lib64" / "stubs" / "libcuda.so").write_text("")
    assert build.driver_option([tmp_path]) == ()


def test_a_failed_build_says_why(tmp_path: Path) -> None:
    log = ["-- Configuring", "CMake Error at ggml/CMakeLists.txt:12 (message):", "  CUDA toolkit not found", "x", "y",
           "ERROR: Failed building wheel"]
    assert build.failure_excerpt("\n".join(log)).startswith("CMake Error at ggml/CMakeLists.txt:12 (message): / CUDA")
    assert build.failure_excerpt("a\nfattn.cu(3): error: identifier x\nb") == "fattn.cu(3): error: identifier x"
    assert build.failure_excerpt("a\nb\nc\nd") == "b / c / d"
    with pytest.raises(build.BuildFailed, match="exited 3: oops"):
        build.run([sys.executable, "-c", "import sys; print('oops'); sys.exit(3)"], tmp_path / "x.log")


def test_a_command_is_stopped_at_the_deadline(tmp_path: Path) -> None:
    """With `interrupt`, Ctrl-C first (pytest then prints its summary), the whole group killed after."""
    code = ("import signal, sys, time\n"
            "def stop(*a): print('summary', flush=True); sys.exit(2)\n"
            "signal.signal(signal.SIGINT, stop); print('started', flush=True); time.sleep(60)")
    t0 = time.time()
    assert build.run_logged([sys.executable, "-c", code], tmp_path / "a.log", deadline=t0 + 2, interrupt=True) is None
    assert (tmp_path / "a.log").read_text().split() == ["started", "summary"] and time.time() - t0 < 20
    assert build.run_logged([sys.executable, "-c", code], tmp_path / "b.log", deadline=time.time() + 2) is None
    assert (tmp_path / "b.log").read_text().split() == ["started"]  # killed, no Ctrl-C
    assert build.run_logged([sys.executable, "-c", "print(1)"], tmp_path / "c.log", deadline=time.time() + 60) == 0


# ---------------------------------------------------------------- the shaped pair


def test_successors_make_one_cycle_and_the_draft_agree_as_asked() -> None:
    ids = list(range(100, 300))
    tokens, target, draft = measure.successors(ids, 0.8)
    assert sorted(tokens) == ids and sorted(target) == ids
    follow = dict(zip(tokens, target))
    t, seen = tokens[0], set()
    while t not in seen:
        seen.add(t)
        t = follow[t]
    assert len(seen) == len(ids)  # one cycle through all of them
    assert np.mean(target == draft) == pytest.approx(0.8)
    assert np.mean(measure.successors(ids, 0.0)[2] == target) == 0  # negative control


def test_the_shaped_pair_follows_its_successors(tmp_path: Path, tiny_target: Model) -> None:
    """The small shapes, Q4_K_M, as the check writes them: they load with their padded vocabulary,
    the target's next token after each cycle token is its successor, and the draft's agrees on
    AGREEMENT of them (exactly the share successors() made: a wrong construction gives about none)."""
    target, draft = measure.quantized_pair(tmp_path, "small")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small-draft-q4_k_m.gguf", "small-target-q4_k_m.gguf"]
    normal = [i for i, t in enumerate(measure.padded_vocab(4096).types) if t == 1]
    tokens, nexts, draft_nexts = measure.successors(normal, measure.AGREEMENT)
    with load(target) as t, load(draft) as d:
        assert t.n_vocab == 4096 and t.meta("general.architecture") == "qwen2"
        assert t.tokenize("hello World 42") == tiny_target.tokenize("hello World 42")  # spm406's ids
        got = {}
        for m in (t, d):
            for tok in tokens[:40]:
                m.clear()
                m.prefill([1, int(tok)], 0)
                got.setdefault(m is t, []).append(int(np.argmax(m.logits_array(1)[0])))
            m.clear()
    assert got[True] == nexts[:40].tolist() and got[False] == draft_nexts[:40].tolist()


# ---------------------------------------------------------------- the report


PYTEST_OUT = """....F..s
FAILED tests/test_engine.py::test_x - AssertionError: tokens differ
ERROR tests/test_server.py::test_y - RuntimeError: boom
= 1 failed, 6 passed, 1 skipped, 1 error, 2 warnings in 12.30s ="""


def test_pytest_outcome_is_read_from_its_output() -> None:
    got = report.pytest_summary(PYTEST_OUT, stopped=False)
    assert got["counts"] == {"failed": 1, "passed": 6, "skipped": 1, "error": 1}
    assert got["failed"] == PYTEST_OUT.splitlines()[1:3] and got["line"].endswith("in 12.30s")
    assert report.pytest_summary("Fatal Python error: Segmentation fault\n", stopped=False)["counts"] == {}


def given_result() -> dict:
    return {"host": {"cpu": "Xeon", "cores": 16, "memory_gib": 128, "python": "3.12.3",
                     "gpus": ["NVIDIA H200, 580.1, 143771 MiB, 9.0"]},
            "budget_s": 540, "seconds": 500.4, "problems": [],
            "build": {"seconds": 300.2, "cmake_args": ["-DGGML_CUDA=on"]},
            "measure": {"shapes": "default", "curve": {"1": 0.002, "2": 0.0025, "32": 0.008}, "draft_c1": 0.001, "rounds": 5,
                        "agreement": 0.8, "llama_cpp": "0.3.36", "build": "CUDA : ARCHS = 900",
                        "weights_mib": {"target": {"CUDA0": 900.0, "CPU_Mapped": 120.0}, "draft": {"CUDA0": 300.0}}},
            "bench": {"table": ["| T | verifier | speedup |", "|---|---|---:|", "| 0 | block | 1.50x |"]},
            "tests": report.pytest_summary(PYTEST_OUT, stopped=False)}


def test_the_report_of_a_given_measurement() -> None:
    text = report.render(given_result())
    assert "GPU: NVIDIA H200, 580.1, 143771 MiB, 9.0" in text and "(built in 300 s with -DGGML_CUDA=on): CUDA" in text
    assert "| 2 | 2.50 ms | 1.25 |\n| 32 | 8.00 ms | 4.00 |" in text and "The draft's c(1): 1.00 ms, 0.50 of" in text
    assert "target weights: CPU_Mapped 120 MiB, CUDA0 900 MiB" in text and "after 80% of tokens" in text
    assert "| 0 | block | 1.50x |" in text and "- FAILED tests/test_engine.py::test_x" in text
    assert "stopped at the time limit" not in text and "## Problems" not in text
    # negative controls: a suite cut short, nothing measured, a problem
    result = given_result()
    del result["measure"], result["bench"]
    result["tests"] = report.pytest_summary("...\n= 3 passed in 1.0s =", stopped=True)
    result["problems"] = ["the cost curve: killed by SIGSEGV"]
    text = report.render(result)
    assert "## Cost" not in text and "## Speedups" not in text and "llama-cpp-python built in 300 s with" in text
    assert "3 passed in 1.0s (stopped at the time limit" in text and "- the cost curve: killed by SIGSEGV" in text


# ---------------------------------------------------------------- the command


def run_check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args,flag", [(["--budget", "5"], "--budget"), (["--bundle", "/nonexistent"], "--prepare")])
def test_usage_errors_name_the_flag(args: list[str], flag: str) -> None:
    r = run_check(*args)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr


def test_the_check_on_a_cpu_build(tmp_path: Path) -> None:
    """The whole command with the llama-cpp-python installed here, the small shapes and two tests of
    its own (one failing): the curve, bench's table and the tests' outcome in the report, exit 1."""
    (tmp_path / "test_two.py").write_text("def test_ok():\n    pass\n\n\ndef test_bad():\n    assert False\n")
    r = run_check("--no-build", "--cpu", "--shapes", "small", "--tests", str(tmp_path / "test_two.py"), "--bench",
                  "--verifiers block,traversal --shapes k4,t3x2x1 --temperatures 0.8 --prompts code --raw -n 4",
                  "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"))
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert r.returncode == 1 and r.stdout == (tmp_path / "out" / "gpu_check.md").read_text()
    assert result["problems"] == ["the test suite: 1 failed, 1 passed in " + result["tests"]["line"].split(" in ")[1]]
    assert set(result["measure"]["curve"]) == {str(n) for n in measure.CURVE}
    assert {row["verifier"] for row in result["bench"]["results"]} >= {"target only", "block", "traversal"}
    assert "## Cost of one target pass" in r.stdout and "| code | 0.8 | traversal |" in r.stdout


# ---------------------------------------------------------------- offloading


def test_the_fixture_setting(monkeypatch: pytest.MonkeyPatch, tiny_paths: tuple[Path, Path]) -> None:
    assert [conftest.gpu_layers({"TESTS_N_GPU_LAYERS": v}) for v in ("-1", "", " 12 ")] == [-1, 0, 12]
    assert conftest.gpu_layers({}) == 0
    for bad in ("all", "-2", "1.5"):
        with pytest.raises(pytest.UsageError, match="TESTS_N_GPU_LAYERS"):
            conftest.gpu_layers({"TESTS_N_GPU_LAYERS": bad})
    monkeypatch.setenv("TESTS_N_GPU_LAYERS", "-1")
    with load(tiny_paths[0]) as m:
        assert m.options.n_gpu_layers == -1


def test_info_reports_where_the_weights_go(tiny_paths: tuple[Path, Path]) -> None:
    from click.testing import CliRunner

    from localspec.cli import cli

    r = CliRunner().invoke(cli, ["info", "--json", "-m", str(tiny_paths[0]), "--n-gpu-layers", "-1"])
    assert r.exit_code == 0, r.output
    model = json.loads(r.output)["cpu_kernels"]["model"]
    assert model["n_gpu_layers"] == -1 and sum(model["weight_buffers_mib"].values()) > 0
    bad = CliRunner().invoke(cli, ["info", "-m", str(tiny_paths[0]), "--n-gpu-layers", "-2"])
    assert bad.exit_code == 2 and "--n-gpu-layers" in bad.output


def device_share(model: Model) -> float:
    buffers = model.weight_buffers
    return sum(v for k, v in buffers.items() if not k.upper().startswith("CPU")) / sum(buffers.values())


@gpu_only
def test_gpu_only_the_fixture_setting_offloads(quantized_paths: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = quantized_paths["q4_k_m"]
    monkeypatch.setenv("TESTS_N_GPU_LAYERS", "-1")
    with load(target) as t, load(draft) as d:
        assert device_share(t) > 0.5 and device_share(d) > 0.5
    monkeypatch.setenv("TESTS_N_GPU_LAYERS", "0")
    with load(target) as cpu:
        assert device_share(cpu) == 0  # negative control: no layers asked for, none offloaded


@gpu_only
def test_gpu_only_prompt_cache_restores_device_kv_bit_for_bit(quantized_paths: dict, tmp_path: Path) -> None:
    from localspec.api import Generation
    from localspec.decoding.profiles import Profiles
    from localspec.llama.prompt_cache import PromptCache
    from localspec.settings.generation import GenerationConfig

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
