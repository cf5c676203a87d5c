"""One way to build and run llama.cpp's own tools, the benchmarks' baselines: llama-speculative-simple,
llama-completion and llama-server, built once from the llama.cpp that the installed
llama-cpp-python vendors (portable, or natively: the CPU kernels localspec runs), and run as
fresh processes timed like localspec's (benchmarks.common.runs.Run).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common.host import llama_cpp_version
from benchmarks.common.runs import Run
from benchmarks.common.target import default_target

log = logging.getLogger("benchmarks.llama_tools")

LLAMA_TOOLS = ("llama-speculative-simple", "llama-completion", "llama-server")
LLAMA_NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")  # llama.cpp's draft-free speculative modes
BENCH_CACHE = Path.home() / ".cache" / "localspec-bench"  # where the benchmarks build the tools


# ---------------------------------------------------------------- building


def native_llama_tools() -> Path:
    """llama.cpp's tools built natively (the CPU kernels localspec runs), once, in the bench cache."""
    return build_llama_tools(BENCH_CACHE, llama_cpp_version(), os.cpu_count() or 1, native=True)


def build_llama_tools(cache: Path, version: str, jobs: int, native: bool = False) -> Path:
    """llama.cpp's llama-speculative-simple, llama-completion and llama-server, built from the llama.cpp that
    llama-cpp-python==version vendors: portable by default, `native` as llama-cpp-python's own
    default build is (-march=native: the same CPU kernels localspec runs)."""
    flags = os.environ.get("CMAKE_ARGS", "-DGGML_NATIVE=on" if native else "-DGGML_NATIVE=off").split()
    src_root = cache / f"llama.cpp-{version}"
    build = src_root / ("build-native" if native else "build")
    bindir = build / "bin"
    if all((bindir / tool).exists() for tool in LLAMA_TOOLS):
        return bindir
    if not (src_root / "src").exists():
        fetch_llama_source(src_root, version)
    log.warning("building %s (%s; a few minutes)", ", ".join(LLAMA_TOOLS), " ".join(flags))
    subprocess.run(["cmake", "-S", str(src_root / "src"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", *flags], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", *LLAMA_TOOLS, "-j", str(jobs)],
                   check=True, stdout=subprocess.DEVNULL)
    return bindir


def fetch_llama_source(src_root: Path, version: str) -> None:
    """The llama.cpp source that llama-cpp-python==version vendors, into src_root/src."""
    src_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log.warning("downloading the llama-cpp-python %s source (pip download)", version)
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}",
                        "--no-binary", ":all:", "--no-deps", "-d", tmp, "-q"], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12
                tar.extractall(tmp, filter="data")
            else:
                tar.extractall(tmp)
        vendored = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        src = src_root / "src"
        if src.exists():
            shutil.rmtree(src)
        shutil.copytree(vendored, src)


# ---------------------------------------------------------------- running


def speculative_simple(bindir: Path, args: Sequence[str], timeout: float = 900) -> Run:
    """One llama-speculative-simple run with `args`: its wall time, the tokens it decoded and their
    speed (its own log's); in `data`, the decode's seconds and, where its log gives them, the draft
    statistics (drafted, accepted)."""
    cmd = [str(bindir / "llama-speculative-simple"), *args]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    log_text = out.stdout + out.stderr
    found = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log_text)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"llama-speculative-simple failed (exit {out.returncode}):\n{log_text[-2000:]}")
    tokens, seconds = int(found.group(1)), float(found.group(2))
    data: dict[str, Any] = {"seconds": seconds}
    for key, pattern in (("drafted", r"n_drafted\s*=\s*(\d+)"), ("accepted", r"n_accept\s*=\s*(\d+)")):
        if (m := re.search(pattern, log_text)) is not None:
            data[key] = int(m.group(1))
    return Run(wall, tokens, tokens / seconds, data=data, stdout=out.stdout, stderr=out.stderr)


def completion_flags() -> list[str]:
    """The llama-completion flags of the comparisons: plain text in (the rendered chat prompt, no
    escapes, no conversation mode), greedy, and --no-repack where llama.cpp's own choice of CPU
    buffer types includes AMX (which crashes on some Xeons: the flag that makes it run there)."""
    from localspec.llama import buffer_types

    crashing = buffer_types.crashing_buffer_types()
    return ["-no-cnv", "--no-escape", "--temp", "0", "--seed", "1", "-c", "4096", *(["-nr"] if crashing else [])]


def llama_completion(bindir: Path, text: str, tokens: int, threads: int | None, extra: Sequence[str] = ()) -> Run:
    """One llama-completion run on `text` (`extra`: more flags): its wall time and generated tokens."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        cmd = [str(bindir / "llama-completion"), "-m", str(default_target()), "-f", f.name, "-n", str(tokens),
               *completion_flags(), *extra, *(["-t", str(threads)] if threads else [])]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
    found = re.search(r"eval time =\s+[\d.]+ ms /\s+(\d+) runs", out.stderr)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"llama-completion failed (exit {out.returncode}):\n{out.stderr[-1500:]}")
    return Run(wall, int(found.group(1)) + 1)  # the eval runs follow the first token, sampled from the prefill


class Server:
    """A llama-server on a free local port (the target alone, or with an n-gram speculative mode)."""

    def __init__(self, bindir: Path, threads: int | None, spec_type: str | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [str(bindir / "llama-server"), "-m", str(default_target()), "--port", str(self.port), "-c", "4096",
               "-np", "1", *completion_flags()[4:], *(["-t", str(threads)] if threads else []),
               *(["--spec-type", spec_type, "--spec-draft-n-max", "32"] if spec_type else [])]
        self.spec_type = spec_type
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                assert self.proc.stderr is not None  # stderr=PIPE above
                raise RuntimeError(f"llama-server exited: {self.proc.stderr.read().decode()[-1500:]}")
            ok = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{self.port}/health"], capture_output=True)
            if ok.returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError("llama-server did not come up in 300 s")

    def request(self, text: str, tokens: int, grammar: str | None = None, cache_prompt: bool = True) -> Run:
        """One /completion request from a fresh curl process (`grammar`: GBNF the answer follows;
        `cache_prompt`: the slot reuses what it holds of the prompt, llama-server's default)."""
        body: dict[str, Any] = {"prompt": text, "n_predict": tokens, "temperature": 0, "seed": 1,
                                "cache_prompt": cache_prompt}
        if grammar is not None:
            body["grammar"] = grammar
        with tempfile.NamedTemporaryFile("w", suffix=".json", encoding="utf-8") as f:
            json.dump(body, f)
            f.flush()
            t0 = time.perf_counter()
            out = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{self.port}/completion", "-H",
                                  "Content-Type: application/json", "--data-binary", f"@{f.name}"],
                                 capture_output=True, text=True, timeout=1800)
            wall = time.perf_counter() - t0
        if out.returncode != 0:
            raise RuntimeError(f"llama-server request failed: {out.stderr}")
        answer = json.loads(out.stdout)
        return Run(wall, int(answer["tokens_predicted"]), data={"content": answer.get("content", ""),
                                                                 "timings": answer.get("timings", {})})

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
