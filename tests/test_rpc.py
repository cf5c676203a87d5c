"""llama.cpp's RPC backend on loopback with the tiny models: output through --rpc equals the local
run, speculation with the target remote and the draft local, a model split over two servers, a
server killed or hung mid-generation (a clear error, the text kept, a bounded exit), a wrong
address, and a build without RPC.

Every run of the client is a subprocess: llama.cpp registers RPC devices process-wide, and a
server that dies ends the process that used it (by design: localspec exits cleanly then).
The tests skip without an RPC build (the reason is shown); CI sets TESTS_REQUIRE_RPC=1 after
rebuilding llama-cpp-python with -DGGML_RPC=on, and then they must run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from click.testing import CliRunner

from localspec.llama import rpc
from localspec.cli import cli
from localspec.errors import DependencyError
from localspec.llama.model import Model

from greedy import assert_greedy_text

PROMPT = "def add(a, b): return"
REQUIRED = os.environ.get("TESTS_REQUIRE_RPC") == "1"
needs_rpc = pytest.mark.skipif(not rpc.available() and not REQUIRED,
                               reason="this llama-cpp-python build has no RPC backend; rebuild it with "
                                      f"{rpc.rebuild_command()} (CI does, and sets TESTS_REQUIRE_RPC=1)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    """`localspec rpc-server` on a free loopback port, once it accepts connections."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "localspec", "rpc-server", "--port", str(port), "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"the RPC server did not start: {proc.stderr.read()}")
            time.sleep(0.05)


@pytest.fixture
def servers() -> Iterator[Callable[[], str]]:
    started: list[subprocess.Popen] = []

    def start() -> str:
        proc, endpoint = start_server()
        started.append(proc)
        return endpoint

    start.procs = started  # type: ignore[attr-defined]
    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def common(tiny_paths: tuple[Path, Path]) -> list[str]:
    return ["-m", str(tiny_paths[0]), "--threads", "1", "--cache-type", "f32", "--raw", "-t", "0"]


LLAMA_LOG = {"LOCALSPEC_LLAMA_LOG": "1"}


def offloaded(stderr: str) -> list[str]:
    """llama.cpp's "offloaded X/Y layers to GPU" of each model loaded (RPC devices count as GPUs)."""
    return re.findall(r"offloaded (\d+/\d+) layers to GPU", stderr)


@needs_rpc
def test_greedy_output_through_rpc_equals_the_local_run(servers, tiny_paths: tuple[Path, Path],
                                                         tiny_target: Model) -> None:
    endpoint = servers()
    remote = run("-vv", *common(tiny_paths), "-d", "none", "-n", "24", "--rpc", endpoint, PROMPT, env=LLAMA_LOG)
    assert remote.returncode == 0, remote.stderr
    assert offloaded(remote.stderr) == ["3/3"]  # 2 layers and the output layer: all on the server
    assert_greedy_text(tiny_target, PROMPT, remote.stdout.removesuffix("\n"), 24)


@needs_rpc
def test_speculation_with_the_target_remote_and_the_draft_local(servers, tiny_paths: tuple[Path, Path],
                                                                  tiny_target: Model) -> None:
    endpoint = servers()
    out = run("-vv", *common(tiny_paths), "-d", str(tiny_paths[1]), "--drafter", "model", "--plan", "fixed",
              "-k", "4", "-n", "24", "--rpc", endpoint, "--json", PROMPT, env=LLAMA_LOG)
    assert out.returncode == 0, out.stderr
    assert offloaded(out.stderr) == ["3/3", "0/3"]  # the target on the server, the draft here
    data = json.loads(out.stdout)
    assert data["stats"]["drafted_tokens"] > 0 and data["stats"]["block_efficiency"] > 1.5
    assert_greedy_text(tiny_target, PROMPT, data["text"], 24)


@needs_rpc
def test_two_servers_share_one_model(servers, tiny_paths: tuple[Path, Path], tiny_target: Model) -> None:
    a, b = servers(), servers()
    out = run("-vv", *common(tiny_paths), "-d", "none", "-n", "24", "--rpc", f"{a},{b}", PROMPT, env=LLAMA_LOG)
    assert out.returncode == 0, out.stderr
    for endpoint in (a, b):  # llama.cpp names each server's buffers after it: both hold layers
        assert re.search(rf"RPC\d\[{re.escape(endpoint)}\] model buffer size", out.stderr), endpoint
    assert_greedy_text(tiny_target, PROMPT, out.stdout.removesuffix("\n"), 24)


def _long_generation(tiny_paths: tuple[Path, Path], endpoint: str, env: dict | None = None) -> subprocess.Popen:
    args = ["-m", str(tiny_paths[0]), "-d", "none", "--threads", "1", "--raw", "-t", "1", "--seed", "3",
            "-n", "4000", "--ctx-size", "4096", "--rpc", endpoint, "hello there"]
    return subprocess.Popen([sys.executable, "-m", "localspec", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


def _await_output(proc: subprocess.Popen) -> bytes:
    first = proc.stdout.read(20)  # the generation is streaming
    assert len(first) == 20, proc.stderr.read()
    return first


@needs_rpc
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_server_that_dies_or_hangs_mid_generation(servers, tiny_paths: tuple[Path, Path], how: str) -> None:
    """Killed: the connection breaks and llama.cpp aborts; hung (SIGSTOP): a decode exceeds its time
    limit. Either way the client ends quickly with exit status 3, a clear message, and the text
    generated so far on stdout."""
    endpoint = servers()
    proc = _long_generation(tiny_paths, endpoint, env={rpc.TIMEOUT_ENV: "2"})
    try:
        first = _await_output(proc)
        server = servers.procs[-1]
        server.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        proc.kill()
        if how == "hung":
            servers.procs[-1].send_signal(signal.SIGCONT)
    err_text = err.decode()
    assert proc.returncode == rpc.EXIT_REMOTE, err_text
    assert ("stopped answering" if how == "killed" else "did not answer within 2 s") in err_text
    assert "Traceback" not in err_text and "the text above is what was generated" in err_text
    assert len(first + out) > 20 and (first + out).endswith(b"\n")
    assert took < 10


@needs_rpc
def test_wrong_addresses_are_clear_errors(tiny_paths: tuple[Path, Path]) -> None:
    refused = run(*common(tiny_paths), "-d", "none", "-n", "4", "--rpc", f"127.0.0.1:{free_port()}", PROMPT)
    assert refused.returncode == 3 and "cannot reach the RPC server at 127.0.0.1:" in refused.stderr  # EXIT_REMOTE
    assert "localspec rpc-server --host 127.0.0.1" in refused.stderr and "Traceback" not in refused.stderr
    malformed = run(*common(tiny_paths), "-d", "none", "-n", "4", "--rpc", "nowhere", PROMPT)
    assert malformed.returncode == 2 and "'nowhere' is not an RPC server address" in malformed.stderr


@needs_rpc
def test_info_lists_remote_devices(servers) -> None:
    endpoint = servers()
    out = run("info", "--rpc", endpoint)
    assert out.returncode == 0 and "RPC backend      available" in out.stdout
    assert f"{endpoint}: RPC0" in out.stdout


def test_a_build_without_rpc_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rpc, "available", lambda: False)
    with pytest.raises(DependencyError, match=re.escape(rpc.rebuild_command())):
        rpc.require()
    result = CliRunner().invoke(cli, ["rpc-server", "--port", str(free_port())])
    assert result.exit_code == 1 and "no RPC backend" in result.output and "-DGGML_RPC=on" in result.output
    assert "Traceback" not in result.output


def test_ci_runs_the_rpc_tests() -> None:
    """A negative control for the skips: where CI requires RPC, the build must have it."""
    if REQUIRED:
        assert rpc.available(), "TESTS_REQUIRE_RPC=1 but this llama-cpp-python has no RPC backend"
