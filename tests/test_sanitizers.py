"""The C verifier under AddressSanitizer + UndefinedBehaviorSanitizer on 10,000+ random inputs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["sampling.c", "verify.c", "chain.c", "multipath.c", "tree.c"]
CC = shutil.which("gcc") or shutil.which("cc")


@pytest.mark.skipif(CC is None, reason="no C compiler on PATH")
@pytest.mark.parametrize("seed", [1, 2])
def test_fuzz_under_address_and_undefined_sanitizers(tmp_path, seed):
    exe = tmp_path / "fuzz_verifier"
    cmd = [CC, "-std=c11", "-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
           "-fno-omit-frame-pointer", "-DLS_NO_CLONES", "-ffp-contract=off", "-Wall", "-Wextra",
           "-Wpedantic", "-Wshadow", "-Werror", f"-I{ROOT / 'native'}",
           *[str(ROOT / "native" / s) for s in SOURCES], str(ROOT / "tests" / "fuzz_verifier.c"),
           "-lm", "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    res = subprocess.run([str(exe), "10000", str(seed)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "ok 10000 iterations" in res.stdout
    assert "runtime error" not in res.stderr


def test_native_sources_compile_without_warnings(tmp_path):
    if CC is None:
        pytest.skip("no C compiler on PATH")
    for src in SOURCES:
        res = subprocess.run([CC, "-std=c11", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Wpedantic",
                              "-Wshadow", "-Werror", "-c", str(ROOT / "native" / src), "-o",
                              str(tmp_path / (src + ".o"))], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
