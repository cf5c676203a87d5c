"""The GPU check (benchmarks/gpu_check.py) where no GPU is: its bundle, its build's toolchain and
process handling on stand-ins, the shaped pair it measures, its report, and the whole command on a
CPU build.

Trimming keeps every file the llama.cpp build needs and drops models, docs, tests, tools and other
backends (on a small stand-in of the sdist: the real one is an 80 MB download; a real bundle in
.gpu-bundle, when there is one, is checked too); a bundle that is damaged, too large or lacks a
file is refused. The tests named *gpu_only* need llama.cpp with a GPU backend and skip, saying so,
where it has none; benchmarks/gpu_check.py runs the whole suite on a GPU machine with
TESTS_N_GPU_LAYERS=-1, which conftest.load() and the tiny-model fixtures read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import conftest
import llama_cpp
import numpy as np
import pytest
from conftest import load

from localspec.llama.model import Model

from benchmarks.gpu import build, check, measure

ROOT = Path(__file__).resolve().parents[1]
GPU = bool(llama_cpp.llama_supports_gpu_offload())
gpu_only = pytest.mark.skipif(not GPU, reason="llama.cpp has no GPU backend in this build (llama_supports_gpu_offload() "
                                              "is false): build llama-cpp-python with CMAKE_ARGS=-DGGML_CUDA=on "
                                              "(docs/gpu.md); benchmarks/gpu_check.py runs these on a GPU machine")
LC = build.LC


# ---------------------------------------------------------------- the bundle


def stand_in_sdist(root: Path, extra: tuple[str, ...] = ()) -> Path:
    """A small stand-in of a llama-cpp-python sdist tree: every required file, one file under each
    dropped part, and `extra` paths."""
    for rel in (*build.REQUIRED, *(d + "x.txt" for d in build.DROP), LC + ".github/ci.yml", "docs/index.md",
                "tests/test_x.py", LC + "ggml/src/ggml-cuda/template-instances/fattn.cu",
                LC + "ggml/src/ggml-cuda/vendors/cuda.h", *extra):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rel.encode())
    return root


def sdist_archive(root: Path, without: str | None = None) -> Path:
    """The stand-in packed as pip downloads an sdist, `without` one of its files."""
    tree = stand_in_sdist(root / "llama_cpp_python-0.3.36")
    if without:
        (tree / without).unlink()
    with tarfile.open(root / "llama_cpp_python-0.3.36.tar.gz", "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    return root / "llama_cpp_python-0.3.36.tar.gz"


def wheels_folder(root: Path) -> Path:
    (root / "wheels").mkdir(parents=True)
    (root / "wheels" / "cffi-2.0.0-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"a wheel")
    return root / "wheels"


def test_trimming_keeps_the_build_and_drops_the_rest(tmp_path: Path) -> None:
    kept = build.trimmed_files(stand_in_sdist(tmp_path))
    assert set(build.REQUIRED) <= set(kept)
    assert {LC + "ggml/src/ggml-cuda/template-instances/fattn.cu", LC + "ggml/src/ggml-cuda/vendors/cuda.h"} <= set(kept)
    for gone in ("models/", "docs/", "tests/", "tools/", "gguf-py/", "ggml/src/ggml-vulkan/", "ggml/src/ggml-metal/"):
        assert not any(k.startswith(LC + gone) for k in kept), gone
    assert not {LC + ".github/ci.yml", "docs/index.md", "tests/test_x.py"} & set(kept)
    # negative control: what the rules keep and drop, one path each
    assert not build.dropped(LC + "ggml/src/ggml-cuda/mmq.cu") and build.dropped(LC + "ggml/src/ggml-sycl/x.cpp")


def test_a_source_without_a_required_file_is_refused(tmp_path: Path) -> None:
    sdist = sdist_archive(tmp_path / "s", without=LC + "ggml/src/ggml-cuda/CMakeLists.txt")
    with pytest.raises(build.BuildFailed, match="ggml-cuda/CMakeLists.txt"):
        build.assemble(tmp_path / "bundle", sdist, wheels_folder(tmp_path))
    assert not (tmp_path / "bundle").exists()  # refused before anything is written


def test_assemble_and_check_a_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / ".gpu-bundle"
    manifest = build.assemble(dest, sdist_archive(tmp_path / "s"), wheels_folder(tmp_path))
    assert build.check(dest) == manifest and manifest["llama_cpp_python"] == "0.3.36"
    assert manifest["source"]["files"] == len(build.trimmed_files(tmp_path / "s" / "llama_cpp_python-0.3.36"))
    tree = build.extract(dest / manifest["source"]["file"], tmp_path / "src")
    assert (tree / LC / "include/llama.h").read_text() == LC + "include/llama.h"
    assert not (tree / LC / "docs").exists()
    # negative controls: too large, a file missing, a file damaged
    monkeypatch.setattr(build, "LIMIT_BYTES", 100)
    with pytest.raises(build.BuildFailed, match="must stay under"):
        build.check(dest)
    monkeypatch.undo()
    wheel = dest / build.WHEELS_DIR / manifest["wheels"][0]["file"]
    wheel.rename(wheel.with_suffix(".gone"))
    with pytest.raises(build.BuildFailed, match="cffi-2.0.0-.*whl is missing"):
        build.check(dest)
    wheel.with_suffix(".gone").rename(wheel)
    with (dest / manifest["source"]["file"]).open("ab") as fh:
        fh.write(b"x")
    with pytest.raises(build.BuildFailed, match="does not match its checksum"):
        build.check(dest)


def test_an_archive_reaching_outside_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("x")
    with tarfile.open(tmp_path / "evil.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "x", arcname="top/../../escaped")
    with pytest.raises(build.BuildFailed, match="evil.tar.gz"):
        build.extract(tmp_path / "evil.tar.gz", tmp_path / "into")
    assert not (tmp_path / "escaped").exists()


def test_a_folder_that_is_not_a_bundle_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(build.BuildFailed, match="not a bundle"):
        build.prepare(tmp_path)  # refused before anything is downloaded
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_a_real_bundle_when_there_is_one() -> None:
    """.gpu-bundle made by --prepare here: whole, under the limit, a wheel of each distribution the
    check needs, and the trimmed source holding what the build needs and nothing trimming drops."""
    real = ROOT / ".gpu-bundle"
    if not (real / build.MANIFEST).exists():
        pytest.skip("no .gpu-bundle here (python benchmarks/gpu_check.py --prepare .gpu-bundle makes one; it downloads)")
    manifest = build.check(real)

    def normal(name: str) -> str:
        return name.lower().replace("-", "_").replace(".", "_")

    assert {normal(n) for n in build.WHEELS} <= {normal(w["file"].split("-")[0]) for w in manifest["wheels"]}
    with tarfile.open(real / manifest["source"]["file"]) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert set(build.REQUIRED) <= set(names) and not [n for n in names if build.dropped(n)]


# ---------------------------------------------------------------- the build


def stand_in_toolkit(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """nvcc and nvidia-smi (compute capability 9.0) on PATH, in a toolkit folder of no libraries."""
    bin_dir = root / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    for name, out in (("nvcc", "Cuda compilation tools, release 13.0"), ("nvidia-smi", "9.0")):
        (bin_dir / name).write_text(f"#!/bin/sh\necho '{out}'\n")
        (bin_dir / name).chmod(0o755)
    (root / "cuda" / "lib64").mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(build, "TOOLKIT", root / "none")  # not this machine's /usr/local/cuda
    return root / "cuda"


def test_the_toolchain_with_cublas_from_the_toolkit_else_from_the_pip_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch images carry cuBLAS as the nvidia-cublas wheel (CUDA 13: nvidia/cu13/); the build links
    its libraries and reads its cuBLAS headers through a folder holding only those, so the wheel's
    other CUDA headers never shadow the toolkit's."""
    import importlib.util

    toolkit, work = stand_in_toolkit(tmp_path, monkeypatch), tmp_path / "work"
    assert build.toolchain(work, cuda=False) == (["-DLLAVA_BUILD=OFF"], {})
    (toolkit / "lib64" / "libcublas.so.13").write_text("")
    args, env = build.toolchain(work, cuda=True)
    assert args == ["-DLLAVA_BUILD=OFF", "-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_NO_VMM=ON"]
    assert env["CUDACXX"] == str(toolkit / "bin" / "nvcc") and "LD_LIBRARY_PATH" not in env
    (toolkit / "lib64" / "libcublas.so.13").unlink()
    nvidia = tmp_path / "site" / "nvidia"
    for rel in ("cu13/lib/libcublas.so.13", "cu13/lib/libcublasLt.so.13", "cu13/include/cublas_v2.h",
                "cu13/include/cublas_api.h", "cu13/include/cuda_runtime.h"):
        (nvidia / rel).parent.mkdir(parents=True, exist_ok=True)
        (nvidia / rel).write_text(rel)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(
        submodule_search_locations=[str(nvidia)]) if name == "nvidia" else real_find(name, *a))
    args, env = build.toolchain(work, cuda=True)
    headers = work / "cublas-include"
    assert args[4:] == [f"-DCUDA_cublas_LIBRARY={nvidia}/cu13/lib/libcublas.so.13",
                        f"-DCUDA_cublasLt_LIBRARY={nvidia}/cu13/lib/libcublasLt.so.13",
                        f"-DCMAKE_CUDA_FLAGS=-I{headers}", f"-DCMAKE_CXX_FLAGS=-I{headers}"]
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(nvidia / "cu13" / "lib")
    assert sorted(p.name for p in headers.iterdir()) == ["cublas_api.h", "cublas_v2.h"]  # not cuda_runtime.h
    assert (headers / "cublas_v2.h").read_text() == "cu13/include/cublas_v2.h"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # negative control: no cuBLAS anywhere
    with pytest.raises(build.BuildFailed, match="no cuBLAS"):
        build.toolchain(work, cuda=True)


def test_a_failed_build_says_why(tmp_path: Path) -> None:
    def said(text: str) -> str:
        (tmp_path / "x.log").write_text(text)
        return build.failure("it", 1, tmp_path / "x.log")

    log = ["-- Configuring", "CMake Error at ggml/CMakeLists.txt:12 (message):", "  CUDA toolkit not found", "x", "y",
           "ERROR: Failed building wheel"]
    assert said("\n".join(log)).startswith("it: exited 1: CMake Error at ggml/CMakeLists.txt:12 (message): / CUDA")
    assert said("a\nfattn.cu(3): error: identifier x\nb").startswith("it: exited 1: fattn.cu(3): error: identifier x (")
    assert said("a\nb\nc\nd").startswith("it: exited 1: b / c / d (")
    assert build.failure("it", -11, tmp_path / "x.log").startswith("it: killed by SIGSEGV")
    with pytest.raises(build.BuildFailed, match="exited 3: oops"):
        build.must([sys.executable, "-c", "import sys; print('oops'); sys.exit(3)"], tmp_path / "x.log")


def test_a_command_is_stopped_at_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GRACE seconds before the deadline a Ctrl-C (pytest then prints its summary); at the deadline
    the whole group is killed, a command that ignores the Ctrl-C too."""
    monkeypatch.setattr(build, "GRACE", 1.0)
    code = ("import signal, sys, time\n"
            "def stop(*a): print('summary', flush=True); sys.exit(2)\n"
            "signal.signal(signal.SIGINT, stop if sys.argv[1] == 'stop' else signal.SIG_IGN)\n"
            "print('started', flush=True); time.sleep(60)")
    t0 = time.time()
    assert build.run([sys.executable, "-c", code, "stop"], tmp_path / "a.log", deadline=t0 + 4) is None
    assert (tmp_path / "a.log").read_text().split() == ["started", "summary"] and time.time() - t0 < 20
    t0 = time.time()
    assert build.run([sys.executable, "-c", code, "ignore"], tmp_path / "b.log", deadline=t0 + 4) is None
    assert (tmp_path / "b.log").read_text().split() == ["started"] and time.time() - t0 < 20  # killed
    assert build.run([sys.executable, "-c", "print(1)"], tmp_path / "c.log", deadline=time.time() + 60) == 0


# ---------------------------------------------------------------- the shaped pair


def test_successors_make_one_cycle_and_the_draft_agree_as_asked() -> None:
    ids = list(range(100, 300))
    tokens, target, draft = measure.successors(ids, 0.8)
    assert sorted(tokens) == ids and sorted(target) == ids
    follow = dict(zip(tokens, target, strict=True))
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
    AGREEMENT of them (exactly the share successors() made: a wrong construction gives about none).
    Once quantized, the F32 files are not written again (the check's writer runs on every build)."""
    target, draft = measure.write_pair(tmp_path, "small", quantized=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small-draft-q4_k_m.gguf", "small-target-q4_k_m.gguf"]
    measure.write_pair(tmp_path, "small")
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
    got = check.pytest_summary(PYTEST_OUT, stopped=False)
    assert got["line"] == "1 failed, 6 passed, 1 skipped, 1 error, 2 warnings in 12.30s"
    assert got["failed"] == PYTEST_OUT.splitlines()[1:3] and not got["stopped"]
    assert check.pytest_summary("Fatal Python error: Segmentation fault\n", stopped=False)["line"] == ""


def given_result() -> dict:
    return {"host": "Xeon, 16 cores, 128 GiB; GPU: NVIDIA H200, 580.1, 143771 MiB, 9.0",
            "budget_s": 540, "seconds": 500.4, "problems": [],
            "build": {"seconds": 300.2, "cmake_args": ["-DGGML_CUDA=on"]},
            "measure": {"shapes": "default", "curve": {"1": 0.002, "2": 0.0025, "32": 0.008}, "draft_c1": 0.001, "rounds": 5,
                        "agreement": 0.8, "llama_cpp": "0.3.36", "build": "CUDA : ARCHS = 900",
                        "weights_mib": {"target": {"CUDA0": 900.0, "CPU_Mapped": 120.0}, "draft": {"CUDA0": 300.0}}},
            "bench": {"table": ["| T | verifier | speedup |", "|---|---|---:|", "| 0 | block | 1.50x |"]},
            "tests": check.pytest_summary(PYTEST_OUT, stopped=False)}


def test_the_report_of_a_given_measurement() -> None:
    text = check.render(given_result())
    assert "GPU: NVIDIA H200, 580.1, 143771 MiB, 9.0" in text and "(built in 300 s with -DGGML_CUDA=on): CUDA" in text
    assert "| target | 2 | 2.50 ms | 1.25 |\n| target | 32 | 8.00 ms | 4.00 |\n| draft | 1 | 1.00 ms | 0.50 |" in text
    assert "target weights: CPU_Mapped 120 MiB, CUDA0 900 MiB" in text and "after 80% of tokens" in text
    assert "| 0 | block | 1.50x |" in text and "- FAILED tests/test_engine.py::test_x" in text
    assert "stopped at the time limit" not in text and "## Problems" not in text
    # negative controls: a suite cut short, nothing measured, a problem
    result = given_result()
    del result["measure"], result["bench"]
    result["tests"] = check.pytest_summary("...\n= 3 passed in 1.0s =", stopped=True)
    result["problems"] = ["the cost curve: killed by SIGSEGV"]
    text = check.render(result)
    assert "## Cost" not in text and "## Speedups" not in text and "llama-cpp-python built in 300 s with" in text
    assert "3 passed in 1.0s (stopped at the time limit" in text and "- the cost curve: killed by SIGSEGV" in text


# ---------------------------------------------------------------- the command


def run_check(*args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | ({"OUT": str(out)} if out else {})
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, stdin=subprocess.DEVNULL, env=env)


@pytest.mark.parametrize("args,flag", [(["--budget", "5"], "--budget"), (["--bundle", "/nonexistent"], "--prepare")])
def test_usage_errors_name_the_flag(args: list[str], flag: str) -> None:
    r = run_check(*args)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr


def test_the_check_on_a_cpu_build(tmp_path: Path) -> None:
    """The whole command with the llama-cpp-python installed here, the small shapes and two tests of
    its own (one failing): the curve, bench's table and the tests' outcome in the report, exit 1."""
    (tmp_path / "test_two.py").write_text("def test_ok():\n    pass\n\n\ndef test_bad():\n    assert False\n")
    r = run_check("--no-build", "--cpu", "--tests", str(tmp_path / "test_two.py"), "--bench",
                  "--verifiers block,traversal --shapes k4,t3x2x1 --temperatures 0.8 --prompts code --raw -n 4",
                  "--work", str(tmp_path / "work"), out=tmp_path / "out")
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert r.returncode == 1 and r.stdout == (tmp_path / "out" / "gpu_check.md").read_text()
    assert result["problems"] == ["the test suite: 1 failed, 1 passed in " + result["tests"]["line"].split(" in ")[1]]
    assert set(result["measure"]["curve"]) == {str(n) for n in measure.CURVE}
    assert {row["verifier"] for row in result["bench"]["results"]} >= {"target only", "block", "traversal"}
    assert "## Cost of one pass" in r.stdout and "| code | 0.8 | traversal |" in r.stdout
    assert not (tmp_path / "work" / "out").exists()  # the report went to $OUT


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
