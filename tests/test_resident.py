"""Resident models: a `localspec` call leaves its models loaded in a background service, and later
calls with the same models and options are served by it, with the same output as a call in its
own process (``--keep-alive 0``).

Every test runs real processes (`python -m localspec`, as users run `localspec`) on the tiny
models, in the session's private runtime directory (tests/conftest.py: no service outlives the
session); the `services` fixture stops what a test started.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from localspec.resident import client, control, runtime
from localspec.resident.protocol import STATUS, Channel

from children import popen

EXACT = ["--threads", "1", "--cache-type", "f32", "--ctx-size", "1024", "--prompt-cache", "off"]
LONG = ["--raw", "-t", "1", "--seed", "3", "-n", "3000", "--regex", "[a-z ]{4000,}"]  # ~4 s on the tiny pair
PROMPT = "The quick brown fox jumps over the lazy dog, and then"


def localspec(*args: str, keep_alive: str = "5m", env: dict[str, str] | None = None, timeout: float = 120,
              **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "LOCALSPEC_KEEP_ALIVE": keep_alive, **(env or {})},
                          stdin=kw.pop("stdin", subprocess.DEVNULL), **kw)


def start(*args: str, keep_alive: str = "5m") -> subprocess.Popen:
    return popen([sys.executable, "-m", "localspec", *args], stdout=subprocess.PIPE,  # SIGINT: as Ctrl-C
                 stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                 env={**os.environ, "LOCALSPEC_KEEP_ALIVE": keep_alive})


def live() -> list[tuple[runtime.Record, dict]]:
    return control.services()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_seconds(pid: int, over: float = 1.0) -> float:
    """CPU seconds a process used over `over` seconds of wall time."""
    before = cpu_seconds(pid)
    time.sleep(over)
    return cpu_seconds(pid) - before


def wait_for(check: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {check}")


@pytest.fixture()
def services() -> Iterator[None]:
    """Stop every service a test started (and check that they all went)."""
    yield
    for record, _ in live():
        control.stop_service(record, reason="test over")
    assert not live()


@pytest.fixture(scope="module")
def pair(tiny_paths: tuple[Path, Path]) -> list[str]:
    return ["-m", str(tiny_paths[0]), "-d", str(tiny_paths[1]), *EXACT]


def test_the_client_knows_every_command() -> None:
    from localspec.cli import cli

    assert sorted(client.COMMANDS) == sorted(cli.commands)
    assert set(client.SERVED) <= set(cli.commands)


@pytest.mark.parametrize("argv, served", [
    (["hello"], True), (["-v", "chat"], True), (["generate", "x"], True), (["--keep-alive", "0", "x"], False),
    (["--keep-alive=0s", "x"], False), (["info"], False), (["x", "--help"], False), (["--rpc", "h:1", "x"], False),
    (["x", "--", "--keep-alive", "0"], True), (["serve"], False), (["--keep-alive", "bad", "x"], False)])
def test_which_calls_a_service_serves(argv: list[str], served: bool) -> None:
    env = {"LOCALSPEC_KEEP_ALIVE": "5m"}
    try:
        client.served_call(argv, env, stdin_tty=True)
        assert served
    except client.Fallback:
        assert not served
    with pytest.raises(client.Fallback):
        client.served_call(["hello"], {"LOCALSPEC_KEEP_ALIVE": "0"}, stdin_tty=True)


def test_second_call_is_served_without_loading(pair: list[str], services: None) -> None:
    """The first call starts a service (one line on stderr says so), the second is served by it:
    nothing loaded, "resident": true, and the same text as a call in its own process."""
    args = [*pair, "--raw", "-t", "0", "-n", "24", "-k", "0", "--json", PROMPT]
    first = localspec(*args)
    assert first.returncode == 0, first.stderr
    assert "stays loaded for 5m" in first.stderr and "localspec stop" in first.stderr
    second = localspec(*args)
    assert second.returncode == 0, second.stderr
    assert "stays loaded" not in second.stderr
    one, two = json.loads(first.stdout), json.loads(second.stdout)
    alone = json.loads(localspec(*args, keep_alive="0").stdout)
    assert one["resident"] and two["resident"] and not alone["resident"]
    assert two["timings"]["target_load"] == 0.0 and one["timings"]["target_load"] > 0
    assert one["text"] == two["text"] == alone["text"]
    assert set(one) == set(alone)  # the same --json object (resident says where it ran)
    (record, state), = live()
    assert state["served"] == 2 and not state["busy"] and state["left"] > 250
    assert stat.S_IMODE(os.stat(record.socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(record.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(runtime.directory(create=False)).st_mode) == 0o700


@pytest.mark.parametrize("extra", [
    ["--plan", "fixed", "--drafter", "model", "-k", "3"],  # the draft model drafts every step
    ["--regex", "[a-z ]{10,40}\\."],
    ["--json-schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'],
], ids=["speculative", "regex", "schema"])
def test_same_output_as_its_own_process(pair: list[str], extra: list[str], services: None) -> None:
    args = [*pair, "--raw", "-t", "0", "-n", "40", *extra, PROMPT]
    alone = localspec(*args, keep_alive="0")
    assert alone.returncode == 0, alone.stderr
    for _ in range(2):  # starting the service, then served by it
        served = localspec(*args)
        assert served.returncode == 0, served.stderr
        assert served.stdout == alone.stdout


def test_tool_calls_are_the_same(tmp_path: Path, services: None) -> None:
    import tiny_models as tiny

    target, draft = tiny.make_pair(tmp_path / "tools", seed=0, vocab=tiny.TOOLS_VOCAB)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                           "required": ["zone"], "additionalProperties": False}}}]))
    args = ["-m", str(target), "-d", str(draft), *EXACT, "-t", "0", "-n", "60", "--tools", str(tools),
            "--tool-choice", "required", "--no-parallel-tool-calls", "what time is it?"]
    alone = localspec(*args, keep_alive="0")
    assert alone.returncode == 0, alone.stderr
    calls = [c["function"] for c in json.loads(alone.stdout)]  # (the ids are random)
    assert calls[0]["name"] == "get_time"
    for _ in range(2):
        served = localspec(*args)
        assert served.returncode == 0, served.stderr
        assert [c["function"] for c in json.loads(served.stdout)] == calls


def test_a_bad_schema_is_still_a_usage_error(pair: list[str], services: None) -> None:
    """Errors come from the same command: a usage error names the flag (exit 2), nothing on stdout."""
    assert localspec(*pair, "-n", "4", "hi").returncode == 0  # a service runs
    bad = localspec(*pair, "--json-schema", '{"type": "objekt"}', "hi")
    assert bad.returncode == 2 and "--json-schema" in bad.stderr and bad.stdout == ""
    assert len(live()) == 1


def test_chat_is_served_and_keeps_its_commands(pair: list[str], services: None) -> None:
    for i in range(2):
        out = localspec("chat", *pair, "-t", "0", "-n", "8", input="hello there\n/stats\n", stdin=None)
        assert out.returncode == 0, out.stderr
        assert "last reply: 8 tokens" in out.stderr and out.stdout.strip()
        assert ("stays loaded" in out.stderr) == (i == 0)
    assert live()[0][1]["served"] == 2


def test_idle_service_exits_after_its_keep_alive(pair: list[str], services: None) -> None:
    assert localspec(*pair, "-n", "4", "hi", keep_alive="1s").returncode == 0
    (record, _), = live()
    wait_for(lambda: not record.socket_path.exists() and not record.path.exists(), timeout=20)
    assert not live()


def test_stop_and_ps(pair: list[str], tiny_paths: tuple[Path, Path], services: None) -> None:
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    ps = localspec("ps", "--json")
    rows = json.loads(ps.stdout)
    assert len(rows) == 1 and rows[0]["requests"] == 1 and rows[0]["memory_bytes"] > 0
    assert rows[0]["target"] == str(tiny_paths[0].resolve())
    table = localspec("ps").stdout
    assert tiny_paths[0].name[:20] in table and "MEMORY" in table
    wrong = localspec("stop", "no-such-model")
    assert wrong.returncode == 2 and "no resident service" in wrong.stderr
    done = localspec("stop", tiny_paths[0].name)
    assert done.returncode == 0 and "stopped" in done.stderr
    assert not live()
    assert "no resident models" in localspec("ps").stdout


def test_a_changed_model_file_is_never_served_by_the_old_service(tmp_path: Path, tiny_paths: tuple[Path, Path],
                                                                  services: None) -> None:
    target = tmp_path / "target.gguf"
    target.write_bytes(tiny_paths[0].read_bytes())
    args = ["-m", str(target), "-d", "none", *EXACT, "-n", "4", "hi"]
    assert localspec(*args).returncode == 0
    assert localspec(*args).returncode == 0
    assert len(live()) == 1
    os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))  # the same bytes, rewritten
    again = localspec(*args)
    assert again.returncode == 0 and "stays loaded" in again.stderr
    assert len(live()) == 2  # a new service; the old one keeps the old file until it idles out
    other = localspec(*args[:-3], "--ctx-size", "512", "-n", "4", "hi")  # another load option
    assert other.returncode == 0 and "stays loaded" in other.stderr and len(live()) == 3


def test_a_stale_socket_is_replaced(pair: list[str], services: None) -> None:
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    (record, state), = live()
    os.kill(state["pid"], signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{state['pid']}/status") or
             "zombie" in Path(f"/proc/{state['pid']}/status").read_text())
    assert record.socket_path.exists()  # left behind by the killed service
    again = localspec(*pair, "-n", "4", "hi")
    assert again.returncode == 0 and "stays loaded" in again.stderr
    assert not record.socket_path.exists() and not record.path.exists()
    assert len(live()) == 1


def _service_pid() -> int:
    return wait_for(lambda: live() and live()[0][1]["busy"] and live()[0][1]["pid"])


@pytest.mark.parametrize("how, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_a_stopped_client_stops_the_generation(pair: list[str], how: int, code: int, services: None) -> None:
    """Ctrl-C, SIGTERM and SIGKILL of a client mid-generation: the service stops generating at
    once (it uses no CPU a moment later) and takes the next call. Negative control: the same
    measurement while a client is still being answered sees a busy service."""
    assert localspec(*pair, "-n", "4", "hi").returncode == 0  # the service is up
    proc = start(*pair, *LONG, "--json", "hi")
    pid = _service_pid()
    assert busy_seconds(pid, 0.5) > 0.2  # negative control: generating
    proc.send_signal(how)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    if how != signal.SIGKILL:
        partial = json.loads(out)  # the partial --json object, as an in-process run prints it
        assert partial["resident"] and 0 < partial["usage"]["completion_tokens"] < 3000
    time.sleep(0.5)
    assert busy_seconds(pid, 1.0) < 0.1
    assert not live()[0][1]["busy"]
    assert localspec(*pair, "-n", "4", "hi").returncode == 0


def test_a_closed_pipe_stops_the_generation(pair: list[str], services: None) -> None:
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    proc = subprocess.Popen(f"{sys.executable} -m localspec {' '.join(map(repr, [*pair, *LONG, 'hi']))} | head -c 20",
                            shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "LOCALSPEC_KEEP_ALIVE": "5m"})
    out, _ = proc.communicate(timeout=60)
    assert len(out) == 20
    pid = live()[0][1]["pid"]
    wait_for(lambda: not live()[0][1]["busy"], timeout=10)
    assert busy_seconds(pid, 1.0) < 0.1


def test_two_clients_take_turns(pair: list[str], services: None) -> None:
    short = [*pair, "--raw", "-t", "0", "-n", "16", "-k", "0", PROMPT]
    want = localspec(*short, keep_alive="0").stdout
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    long = start(*pair, *LONG, "hi")
    _service_pid()
    second = localspec(*short)
    assert second.returncode == 0 and "waits its turn" in second.stderr and second.stdout == want
    out, err = long.communicate(timeout=60)
    assert long.returncode == 0, err
    assert len(out) > 2000  # the first call ran to its end (3000 tokens), untouched


def test_a_service_killed_mid_answer(pair: list[str], services: None) -> None:
    """The client prints what it received, says what happened, and exits 3; the next call starts
    a new service."""
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    proc = start(*pair, *LONG, "hi")
    pid = _service_pid()
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3 and len(out) > 0
    assert "the resident service ended before the call was done" in err.decode()
    assert localspec(*pair, "-n", "4", "hi").returncode == 0


def test_another_user_is_refused(pair: list[str], services: None) -> None:
    """A connection from another uid is closed unanswered (SO_PEERCRED), even where the files'
    permissions would let it in; the same query from our own uid is answered (the control)."""
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    (record, _), = live()
    directory = record.path.parent
    for d in (directory, directory.parent):
        os.chmod(d, 0o711)
    os.chmod(record.socket_path, 0o666)
    try:
        def ask(uid: int | None) -> bytes:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: another user asks for the service's status
                os.close(read)
                try:
                    if uid is not None:
                        os.setgid(uid)
                        os.setuid(uid)
                    sock = socket.socket(socket.AF_UNIX)
                    sock.settimeout(10)
                    sock.connect(str(record.socket_path))
                    channel = Channel(sock)
                    channel.send(STATUS)
                    frame = channel.recv()
                    os.write(write, b"answered" if frame else b"closed")
                except BaseException as exc:  # noqa: BLE001
                    os.write(write, f"error {exc}".encode())
                os._exit(0)
            os.close(write)
            os.waitpid(pid, 0)
            with os.fdopen(read, "rb") as f:
                return f.read()

        assert ask(None) == b"answered"
        refused = ask(65534)  # closed unanswered: seen as the end, a reset or a broken pipe, by timing
        assert refused == b"closed" or refused.startswith((b"error [Errno 32]", b"error [Errno 104]")), refused
    finally:
        os.chmod(record.socket_path, 0o600)
        for d in (directory, directory.parent):
            os.chmod(d, 0o700)


@pytest.mark.parametrize("problem", ["symlink", "open", "other-user"])
def test_an_unsafe_runtime_directory_is_refused(pair: list[str], tmp_path: Path, problem: str) -> None:
    """The call runs in its own process, with one line saying why the models are not kept."""
    base = Path(os.environ["XDG_RUNTIME_DIR"]) / f"bad-{problem}"
    base.mkdir()
    target = base / "localspec"
    if problem == "symlink":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        target.symlink_to(elsewhere)
    else:
        target.mkdir(mode=0o700)
        os.chmod(target, 0o777 if problem == "open" else 0o700)
        if problem == "other-user":
            os.chown(target, 65534, 65534)
    out = localspec(*pair, "-n", "4", "--json", "hi", env={"XDG_RUNTIME_DIR": str(base)})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["resident"] is False
    assert "not kept loaded" in out.stderr
    assert not [p for p in (tmp_path / "elsewhere").glob("*")] if problem == "symlink" else True


def test_the_client_imports_nothing_heavy(pair: list[str], services: None) -> None:
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "localspec", *pair, "-n", "4", "hi"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LOCALSPEC_KEEP_ALIVE": "5m"})
    assert out.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in out.stderr.splitlines()
                if line.startswith("import time:")}
    assert "localspec" in imported  # the negative control: the list is read
    assert not imported & {"numpy", "llama_cpp", "llguidance", "click", "pydantic", "jinja2"}


def test_a_chat_in_progress_does_not_hold_up_other_calls(pair: list[str], services: None) -> None:
    """A chat lasts as long as the user talks: a call arriving meanwhile is not queued behind it
    but served by a second service."""
    chat = subprocess.Popen([sys.executable, "-m", "localspec", "chat", *pair, "-t", "0", "-n", "4"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "LOCALSPEC_KEEP_ALIVE": "5m"})
    assert chat.stdin is not None
    chat.stdin.write(b"hello\n")
    chat.stdin.flush()
    wait_for(lambda: any(s["busy"] for _, s in live()))
    other = localspec(*pair, "-n", "4", "hi", timeout=60)
    assert other.returncode == 0, other.stderr
    assert "waits its turn" not in other.stderr and len(live()) == 2
    out, err = chat.communicate(b"/exit\n", timeout=60)
    assert chat.returncode == 0 and b"localspec chat:" in err


def test_a_pair_that_does_not_fit_replaces_idle_services_or_is_declined(pair: list[str], tiny_paths: tuple[Path, Path],
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture,
                                                                       services: None) -> None:
    """Before a new service loads its pair it checks the memory available: idle services are
    stopped, the longest idle first (said on stderr); if the pair still does not fit, the call is
    declined with a message naming `localspec stop` (and runs in its own process)."""
    from localspec.loading import pair_names
    from localspec.resident import resources

    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    assert len(live()) == 1

    class Service:
        id = "test"

    res = resources.ServiceResources(Service())
    names = pair_names(str(tiny_paths[0]), str(tiny_paths[1]))
    monkeypatch.setattr(resources, "available_memory", lambda: 10 << 30)
    res._make_room(names, with_draft=True)  # it fits: nothing stopped
    assert len(live()) == 1
    monkeypatch.setattr(resources, "available_memory", lambda: 1 << 10)
    with pytest.raises(resources.Declined, match="localspec stop"):
        res._make_room(names, with_draft=True)
    assert not live() and "to make room" in capsys.readouterr().err


def test_a_saved_chat_resumes_on_the_service(pair: list[str], tmp_path: Path, services: None) -> None:
    """`/save NAME` in a chat served by a service, then `chat --resume NAME`: served too (no
    load), with the saved conversation."""
    env = {"LOCALSPEC_CACHE_DIR": str(tmp_path / "cache")}
    saved = localspec("chat", *pair, "-t", "0", "-n", "6", env=env, input="hello there\n/save talk\n", stdin=None)
    assert saved.returncode == 0 and "saved chat talk" in saved.stderr, saved.stderr
    resumed = localspec("chat", *pair, "-t", "0", "-n", "6", "--resume", "talk", env=env, input="/stats\n", stdin=None)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed talk: 2 messages" in resumed.stderr and "stays loaded" not in resumed.stderr
    assert live()[0][1]["served"] == 2


def test_a_rebuild_of_the_same_verifier_keeps_the_service() -> None:
    """`pip install -e .` builds the C verifier again in place from the same sources (a new time,
    other bytes). The service's code fingerprint stays, so the README's command run again finds
    its service; a module edited (a new time on a .py) still changes it, so the service stops for
    new code."""
    import localspec
    from localspec.resident.service import code_fingerprint

    root = Path(localspec.__file__).parent
    compiled, module = next(root.glob("*.so")), root / "__init__.py"
    saved = {path: path.stat() for path in (compiled, module)}
    before = code_fingerprint()
    later = time.time_ns() + 10**9
    try:
        os.utime(compiled, ns=(later, later))
        assert code_fingerprint() == before
        os.utime(module, ns=(later, later))
        assert code_fingerprint() != before
    finally:
        for path, st in saved.items():
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
