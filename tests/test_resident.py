"""Resident models: a `localspec` call leaves its pair loaded in the user's one resident service,
and later calls are served by it with the same output, errors and exit status as a call in its
own process (``--keep-alive 0``).

Every test runs real processes (`python -m localspec`, as users run `localspec`) on the tiny
models, in the session's private runtime directory (tests/conftest.py: no service outlives the
session); the `services` fixture stops what a test started. The classes of failure the issue
that asked for one typed core found each have a test here, with a negative control.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from localspec.core.pairs import ModelFile
from localspec.resident import control, runtime
from localspec.resident.protocol import ACCEPT, CALL, EVENT, STATUS, Channel

from children import popen

EXACT = ["--threads", "1", "--cache-type", "f32", "--ctx-size", "1024", "--prompt-cache", "off"]
LONG = ["--raw", "-t", "1", "--seed", "3", "-n", "3000", "--regex", "[a-z ]{4000,}"]  # ~4 s on the tiny pair
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
ENV = {"LOCALSPEC_KEEP_ALIVE": "5m"}


def localspec(*args: str | bytes, keep_alive: str = "5m", env: dict | None = None, timeout: float = 120,
              **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "LOCALSPEC_KEEP_ALIVE": keep_alive, **(env or {})},
                          stdin=kw.pop("stdin", subprocess.DEVNULL), **kw)


def start(*args: str, keep_alive: str = "5m", **kw: Any) -> subprocess.Popen:
    return popen([sys.executable, "-m", "localspec", *args], stdout=subprocess.PIPE,  # SIGINT: as Ctrl-C
                 stderr=subprocess.PIPE, stdin=kw.pop("stdin", subprocess.DEVNULL),
                 env={**os.environ, "LOCALSPEC_KEEP_ALIVE": keep_alive, **kw.pop("env", {})}, **kw)


def live() -> list[tuple[Path, Any]]:
    return control.services()


def pairs() -> list[Any]:
    return [pair for _, state in live() for pair in state.pairs]


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


def service_pid() -> int:
    return wait_for(lambda: live() and live()[0][1].pid)


def busy_pid() -> int:
    """The service's pid once a call is generating on it."""
    return wait_for(lambda: [s.pid for _, s in live() if any(p.state == "busy" for p in s.pairs)] or None)[0]


def gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


@pytest.fixture()
def services() -> Iterator[None]:
    """Stop every service a test started (and check that they all went)."""
    yield
    for path, _ in live():
        control.stop(path, None)
    assert not live()


@pytest.fixture(scope="module")
def pair(tiny_paths: tuple[Path, Path]) -> list[str]:
    return ["-m", str(tiny_paths[0]), "-d", str(tiny_paths[1]), *EXACT]


# ---------------------------------------------------------------- one service, the same answers


def test_second_call_is_served_without_loading(pair: list[str], services: None) -> None:
    """The first call loads the pair in a new service (one line on stderr says it stays), the
    second is served by it: nothing loaded, "resident": true, and the same text as a call in its
    own process; `ps` shows one service holding the pair, its socket 0600 in a 0700 directory."""
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
    ((path, state),) = live()
    (held,) = state.pairs
    assert held.calls == 2 and held.state == "idle" and held.left_seconds > 250
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(runtime.directory(create=False)).st_mode) == 0o700
    ps = localspec("ps")
    assert ps.returncode == 0 and ps.stdout.count("tiny-target") == 1 and str(state.pid) in ps.stdout


@pytest.mark.parametrize("extra", [
    ["--plan", "fixed", "--drafter", "model", "-k", "3"],  # the draft model drafts every step
    ["--regex", "[a-z ]{10,40}\\."],
    ["--json-schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'],
], ids=["speculative", "regex", "schema"])
def test_same_output_as_its_own_process(pair: list[str], extra: list[str], services: None) -> None:
    args = [*pair, "--raw", "-t", "0", "-n", "40", *extra, PROMPT]
    alone = localspec(*args, keep_alive="0")
    assert alone.returncode == 0, alone.stderr
    for _ in range(2):  # loading the pair in the service, then served by it
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


@pytest.mark.parametrize("args, code, message", [
    (["--json-schema", '{"type": "objekt"}', "hi"], 2, "--json-schema"),
    (["--regex", "(unclosed", "hi"], 2, "Invalid value for --regex"),
    (["--tools", "/no/such/tools.json", "hi"], 2, "--tools"),
    (["--raw", "-s", "be brief", "hi"], 2, "Invalid value for --system"),
    (["-k", "99", "hi"], 2, "Invalid value for --num-draft-tokens"),
], ids=["schema", "regex", "tools-file", "system-raw", "depth"])
def test_errors_are_those_of_a_call_in_its_own_process(pair: list[str], args: list[str], code: int, message: str,
                                                        services: None) -> None:
    """A usage error is the same message and exit status wherever the call runs (2 names the flag),
    with nothing on stdout; the service goes on."""
    assert localspec(*pair, "-n", "4", "hi").returncode == 0  # a service runs
    served, alone = localspec(*pair, *args), localspec(*pair, *args, keep_alive="0")
    assert served.returncode == alone.returncode == code and message in served.stderr
    assert served.stderr == alone.stderr and served.stdout == alone.stdout == ""
    assert len(live()) == 1 and localspec(*pair, "-n", "4", "hi").returncode == 0


def test_chat_runs_in_the_client_and_keeps_its_commands(pair: list[str], services: None) -> None:
    """Each reply is a call to the service (the pair stays loaded between them); /stats, /save
    and --resume work as in a chat of its own process."""
    for i in range(2):
        out = localspec("chat", *pair, "-t", "0", "-n", "8", input="hello there\n/stats\n", stdin=None)
        assert out.returncode == 0, out.stderr
        assert "last reply: 8 tokens" in out.stderr and out.stdout.strip()
        assert ("stays loaded" in out.stderr) == (i == 0)
    (held,) = pairs()
    assert held.calls == 4  # each chat: its first call (the pair checked) and one reply


def test_a_saved_chat_resumes_on_the_service(pair: list[str], tmp_path: Path, services: None) -> None:
    env = {"LOCALSPEC_CACHE_DIR": str(tmp_path / "cache")}
    saved = localspec("chat", *pair, "-t", "0", "-n", "6", env=env, input="hello there\n/save talk\n", stdin=None)
    assert saved.returncode == 0 and "saved chat talk" in saved.stderr, saved.stderr
    resumed = localspec("chat", *pair, "-t", "0", "-n", "6", "--resume", "talk", env=env, input="/stats\n", stdin=None)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed talk: 2 messages" in resumed.stderr and "stays loaded" not in resumed.stderr


def test_drafted_text_is_marked_in_the_events(pair: list[str], services: None) -> None:
    """Text events say which tokens came from an accepted draft: on a terminal --show-drafts
    colours them (not in a pipe, and never in --json)."""
    from localspec.core.calls import Text
    from localspec.core.run import LocalCall
    from test_core import request_for

    args = [*pair, "--raw", "-t", "0", "-n", "40", "--plan", "fixed", "--drafter", "model", "-k", "3"]
    call = LocalCall(request_for(pair, PROMPT, max_tokens=40, plan="fixed", drafter="model", num_draft_tokens=3))
    texts = [e for e in call.events() if isinstance(e, Text)]
    assert any(t.drafted for t in texts) and any(not t.drafted for t in texts)
    plain = localspec(*args, "--show-drafts", PROMPT)
    assert plain.returncode == 0 and "\x1b[" not in plain.stdout  # a pipe: no colour
    assert plain.stdout == localspec(*args, PROMPT).stdout


# ---------------------------------------------------------------- lifecycle


def test_idle_pair_unloads_and_the_service_ends(pair: list[str], services: None) -> None:
    assert localspec(*pair, "-n", "4", "hi", keep_alive="1s").returncode == 0
    ((path, state),) = live()
    wait_for(lambda: gone(state.pid) and not path.exists(), timeout=20)
    assert not live()
    log = list(path.parent.glob(path.stem + "-*.log"))
    assert not log  # a clean end removes its log


def test_stop_and_ps(pair: list[str], tiny_paths: tuple[Path, Path], services: None) -> None:
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    rows = json.loads(localspec("ps", "--json").stdout)
    assert len(rows) == 1 and rows[0]["calls"] == 1 and rows[0]["memory_bytes"] > 0
    assert rows[0]["target"] == str(tiny_paths[0])
    table = localspec("ps").stdout
    assert tiny_paths[0].stem[:20] in table and "MEMORY" in table
    wrong = localspec("stop", "no-such-model")
    assert wrong.returncode == 2 and "no resident model" in wrong.stderr
    done = localspec("stop", tiny_paths[0].name)
    assert done.returncode == 0 and "stopped" in done.stderr
    assert not pairs()
    assert "no resident models" in localspec("ps").stdout


def test_a_replaced_model_file_is_loaded_anew(tmp_path: Path, services: None) -> None:
    """A file replaced in place with its old size and modification time restored (cp + touch -r)
    is another file: served from its new weights, never the old ones. Negative control: the
    old key (path, size, mtime) cannot tell the two apart."""
    import tiny_models as tiny

    path = tmp_path / "target.gguf"
    tiny.write_tiny_model(path, seed=0)
    other = tiny.write_tiny_model(tmp_path / "other.gguf", seed=7)
    assert other.stat().st_size == path.stat().st_size
    args = ["-m", str(path), "-d", "none", *EXACT, "--raw", "-t", "0", "-n", "16", PROMPT]
    before = localspec(*args)
    assert before.returncode == 0, before.stderr
    old = os.stat(path)
    identity = ModelFile.at(path)
    shutil.copyfile(other, path)  # in place: the same inode
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    new = os.stat(path)
    assert (new.st_size, new.st_mtime_ns, new.st_ino) == (old.st_size, old.st_mtime_ns, old.st_ino)  # the control
    assert ModelFile.at(path).identity != identity.identity
    after = localspec(*args)
    assert after.returncode == 0, after.stderr
    assert after.stdout == localspec(*args, keep_alive="0").stdout != before.stdout
    assert len(pairs()) == 1  # the old weights were unloaded: that file can never be asked for again


def test_other_load_options_are_another_pair_in_the_same_service(pair: list[str], services: None) -> None:
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    other = localspec(*pair[:-6], "--ctx-size", "512", "--prompt-cache", "off", "-n", "4", "hi")
    assert other.returncode == 0 and "stays loaded" in other.stderr
    assert len(live()) == 1 and len(pairs()) == 2


def test_a_stale_socket_is_replaced(pair: list[str], services: None) -> None:
    """A service killed leaves its socket and its log (0600, for the user to read); the next call
    starts a new service. Negative control: a clean end (test_idle_pair_...) leaves no log."""
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    ((path, state),) = live()
    os.kill(state.pid, signal.SIGKILL)
    wait_for(lambda: gone(state.pid))
    assert path.exists()  # left behind by the killed service
    (log,) = path.parent.glob(path.stem + "-*.log")
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    again = localspec(*pair, "-n", "4", "hi")
    assert again.returncode == 0 and "stays loaded" in again.stderr
    assert log.exists() and len(live()) == 1 and live()[0][1].pid != state.pid


@pytest.mark.parametrize("round_", range(3))
def test_concurrent_first_calls_start_one_service(pair: list[str], round_: int, services: None) -> None:
    """Eight calls at once, no service running: one service starts and loads the pair once (one
    call loaded it, seven found it). Negative control: calls of another environment (another
    GGML_ setting) are another service, and the count sees two."""
    args = [*pair, "--raw", "-t", "0", "-n", "8", "--json", PROMPT]
    procs = [start(*args) for _ in range(8)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    loads = [json.loads(out)["timings"]["target_load"] for out, _ in outs]
    assert len(live()) == 1 and len(pairs()) == 1
    assert sum(1 for seconds in loads if seconds > 0) == 1, loads
    assert pairs()[0].calls == 8
    assert localspec(*args, env={"GGML_LOCALSPEC_TEST": "1"}).returncode == 0
    assert len(live()) == 2


def test_calls_on_other_pairs_do_not_wait(pair: list[str], services: None) -> None:
    """While a long call generates on one pair, a call on another pair of the same service runs at
    once; negative control: a call on the busy pair, whose one slot (--parallel 1) the long call
    holds, waits its turn, and is told why."""
    other = [*pair[:-6], "--ctx-size", "512", "--prompt-cache", "off"]
    one = [*pair, "--parallel", "1"]
    assert localspec(*other, "-n", "4", "hi").returncode == 0  # both pairs loaded
    assert localspec(*one, "-n", "4", "hi").returncode == 0
    long = start(*one, *LONG, "hi")
    busy_pid()
    quick = localspec(*other, "-n", "4", "hi")
    assert quick.returncode == 0 and "waiting" not in quick.stderr
    assert long.poll() is None  # it ran beside the long call
    waits = localspec(*one, "-n", "4", "hi")
    assert waits.returncode == 0 and "waiting for 1 earlier call on tiny-target-s0" in waits.stderr
    long.communicate(timeout=60)
    assert len(live()) == 1


def test_calls_on_one_pair_generate_at_once(pair: list[str], services: None) -> None:
    """Two calls on one pair in the service: the second starts while the first generates (each a
    slot of the pair's step loop: ps shows 2 generating), and each prints what it prints alone."""
    args = [*pair, "--ctx-size", "8192", "--raw", "-t", "0", "-k", "0"]  # room for a call that outlasts the other
    alone = localspec(*args, "-n", "12", "ab")
    assert alone.returncode == 0
    long = start(*args, "-t", "1", "--seed", "3", "-n", "8000", "--regex", "[a-z ]{9000,}", "hi")
    busy_pid()
    beside = localspec(*args, "-n", "12", "ab")
    assert beside.returncode == 0 and "waiting" not in beside.stderr and beside.stdout == alone.stdout
    assert long.poll() is None and pairs()[0].generating >= 1
    long.send_signal(signal.SIGINT)
    long.communicate(timeout=30)


def test_least_recently_used_idle_pair_makes_room(pair: list[str], services: None) -> None:
    """LOCALSPEC_MAX_LOADED=1: a call on another pair unloads the idle one (said on stderr), in
    the same service; negative control: with 2 both stay."""
    other = [*pair[:-6], "--ctx-size", "512", "--prompt-cache", "off"]
    assert localspec(*pair, "-n", "4", "hi", env={"LOCALSPEC_MAX_LOADED": "2"}).returncode == 0
    both = localspec(*other, "-n", "4", "hi", env={"LOCALSPEC_MAX_LOADED": "2"})
    assert both.returncode == 0 and "to make room" not in both.stderr and len(pairs()) == 2
    one = localspec(*pair[:-6], "--ctx-size", "256", "--prompt-cache", "off", "-n", "4", "hi",
                    env={"LOCALSPEC_MAX_LOADED": "1"})
    assert one.returncode == 0 and one.stderr.count("to make room") == 2, one.stderr
    assert len(pairs()) == 1 and len(live()) == 1


# ---------------------------------------------------------------- stops and faults


@pytest.mark.parametrize("how, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_a_stopped_client_stops_the_generation(pair: list[str], how: int, code: int, services: None) -> None:
    """Ctrl-C, SIGTERM and SIGKILL of a client mid-generation: the service stops generating at
    once (it uses no CPU a moment later), the partial --json object comes out, and the service
    takes the next call. Negative control: the same measurement while a client is being
    answered sees a busy service."""
    assert localspec(*pair, "-n", "4", "hi").returncode == 0  # the service is up
    proc = start(*pair, *LONG, "--json", "hi")
    pid = busy_pid()
    assert busy_seconds(pid, 0.5) > 0.2  # negative control: generating
    proc.send_signal(how)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    if how != signal.SIGKILL:
        partial = json.loads(out)  # the partial --json object, as an in-process run prints it
        assert partial["resident"] and 0 < partial["usage"]["completion_tokens"] < 3000
    time.sleep(0.5)
    assert busy_seconds(pid, 1.0) < 0.1
    assert pairs()[0].state == "idle"
    assert localspec(*pair, "-n", "4", "hi").returncode == 0


def test_a_closed_pipe_stops_the_generation(pair: list[str], services: None) -> None:
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    proc = subprocess.Popen(f"{sys.executable} -m localspec {' '.join(map(repr, [*pair, *LONG, 'hi']))} | head -c 20",
                            shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **ENV})
    out, _ = proc.communicate(timeout=60)
    assert len(out) == 20
    pid = service_pid()
    wait_for(lambda: pairs()[0].state == "idle", timeout=10)
    assert busy_seconds(pid, 1.0) < 0.1


@pytest.mark.parametrize("how, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_while_queued_ends_the_call_at_once(pair: list[str], how: int, code: int, services: None) -> None:
    """A call waiting for the pair (its one slot taken: --parallel 1) ends at once on Ctrl-C or
    SIGTERM (the long call goes on); negative control: unstopped, it keeps waiting."""
    pair = [*pair, "--parallel", "1"]
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    long = start(*pair, *LONG, "hi")
    busy_pid()
    queued = start(*pair, "-n", "4", "--json", "hi")
    wait_for(lambda: pairs() and pairs()[0].queued == 1)
    time.sleep(0.5)
    assert queued.poll() is None  # negative control: it waits
    t0 = time.monotonic()
    queued.send_signal(how)
    out, err = queued.communicate(timeout=10)
    assert queued.returncode == code and time.monotonic() - t0 < 3, err
    assert ("terminated" if how == signal.SIGTERM else "interrupted") in err.decode() and b"Traceback" not in err
    assert json.loads(out)["usage"]["completion_tokens"] == 0
    wait_for(lambda: pairs()[0].queued == 0, timeout=5)  # the service saw it go
    assert long.poll() is None
    long.send_signal(signal.SIGINT)
    long.communicate(timeout=30)


@pytest.mark.parametrize("keep_alive", ["5m", "0"])
def test_a_stop_while_reading_stdin_ends_the_call(pair: list[str], keep_alive: str, services: None) -> None:
    """Ctrl-C while the client reads a pipe that never ends: exit 130 at once, no traceback;
    negative control: unstopped, it keeps reading."""
    proc = start(*pair, "-n", "4", keep_alive=keep_alive, stdin=subprocess.PIPE)
    time.sleep(1.0)
    assert proc.poll() is None  # negative control: reading
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 130 and b"interrupted" in err and b"Traceback" not in err, err


def test_a_stop_while_the_service_starts_and_loads(pair: list[str], services: None) -> None:
    """The first call's Ctrl-C as soon as the service it started listens (it is importing, then
    loading the pair): exit 130 at once, nothing on stdout. Negative control: unstopped, the same
    call runs to its end."""
    directory = runtime.directory()
    path = runtime.socket_path(directory, runtime.service_name())
    proc = start(*pair, "-n", "4", "hi")
    wait_for(path.exists, timeout=30)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 130 and time.monotonic() - t0 < 3 and out == b"", err
    assert b"interrupted" in err and b"Traceback" not in err
    for _, state in live():  # the service it started stops it, or ends
        wait_for(lambda: all(p.state == "idle" for p in state.pairs) or not live(), timeout=30)
    assert localspec(*pair, "-n", "4", "hi").returncode == 0


def test_a_service_killed_mid_answer_or_while_a_call_waits(pair: list[str], services: None) -> None:
    """Both clients print what they received, say what happened, and exit 3; the next call starts
    a new service."""
    pair = [*pair, "--parallel", "1"]  # the second call waits for the pair's one slot
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    long = start(*pair, *LONG, "hi")
    pid = busy_pid()
    queued = start(*pair, "-n", "4", "hi")
    wait_for(lambda: pairs() and pairs()[0].queued == 1)
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    for proc, printed in ((long, True), (queued, False)):
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 3 and (len(out) > 0) == printed, err
        assert b"the resident service ended before the call was done" in err and b"Traceback" not in err
    assert localspec(*pair, "-n", "4", "hi").returncode == 0


# ---------------------------------------------------------------- what a client may send


def _raw_call(path: Path, payload: bytes) -> list[Any]:
    """Send one CALL frame of raw bytes; the frames that come back (kind, JSON)."""
    import json as json_

    from localspec.resident.protocol import HEADER

    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(str(path))
    sock.sendall(HEADER.pack(CALL, len(payload)) + payload)
    channel, got = Channel(sock), []
    while (frame := channel.recv()) is not None:
        got.append((frame[0], json_.loads(frame[1])))
        if frame[0] == EVENT and got[-1][1]["event"] in ("done", "failed"):
            break
    channel.close()
    return got


def test_nothing_a_client_sends_ends_the_service(pair: list[str], tiny_paths: tuple[Path, Path],
                                                 services: None) -> None:
    """Malformed calls (not JSON, another version, wrong types, NUL and '=' in names, paths and
    values) get an error event; frames no client sends and broken frames close their connection
    only. The service answers a well-formed call afterwards (the negative control: Done)."""
    from localspec.resident.protocol import HEADER

    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    ((path, state),) = live()
    good = json.loads(json.dumps(_request(pair)))
    bad = [b"not json", b"\xff\xfe", json.dumps({"version": 999}).encode(),
           json.dumps({**good, "pair": "x"}).encode(), json.dumps({**good, "settings": {"a=b": 1, "x\0": "\0"}}).encode(),
           json.dumps({**good, "pair": {**good["pair"], "target": {**good["pair"]["target"], "path": "/x\0y"}}}).encode(),
           json.dumps({**good, "keep_alive": None}).encode(), json.dumps({**good, "kind": "format-disk"}).encode(),
           json.dumps({**good, "prompt": {"text": "\ud800"}}).encode("utf-8", "surrogatepass")]
    for payload in bad:
        frames = _raw_call(path, payload)
        assert frames[0][0] == ACCEPT and frames[-1][1]["event"] == "failed", (payload, frames)
    for junk in (HEADER.pack(b"?", 0), HEADER.pack(CALL, 1 << 31), HEADER.pack(CALL, 100) + b"short"):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(path))
        sock.sendall(junk)
        sock.close()
    frames = _raw_call(path, json.dumps(good).encode())
    assert frames[-1][1]["event"] == "done" and frames[-1][1]["stats"]["generated_tokens"] == 4
    assert live()[0][1].pid == state.pid  # the same service throughout


def test_a_number_that_is_not_finite_is_refused(pair: list[str], services: None) -> None:
    """A call whose keep_alive is NaN or infinite (a client of this user's that is not localspec's:
    the command line refuses such a duration) is refused with an error naming the field, and the
    service stays idle: a NaN keep_alive once was served, and then the service's idle loop spun a
    whole core (NaN is never <= 0, and Event.wait(NaN) returns at once). The control: the same call
    with a finite keep_alive is served; its pair idle, the service uses (almost) no CPU."""
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    ((path, state),) = live()
    good = json.loads(json.dumps(_request(pair)))
    try:
        for value in ("NaN", "Infinity", "1e999"):
            payload = json.dumps({**good, "keep_alive": 0.0}).replace('"keep_alive": 0.0', f'"keep_alive": {value}')
            frames = _raw_call(path, payload.encode())
            last = frames[-1][1]
            assert last["event"] == "failed" and last["error"] == "RequestError", (value, frames)
            assert "keep_alive" in last["message"] and "finite" in last["message"], last
        frames = _raw_call(path, json.dumps({**good, "keep_alive": 30.0}).encode())
        assert frames[-1][1]["event"] == "done"  # the control
        wait_for(lambda: pairs() and pairs()[0].state == "idle")
        assert busy_seconds(state.pid, over=1.5) < 0.3
        assert live()[0][1].pid == state.pid
    except AssertionError:
        os.kill(state.pid, signal.SIGKILL)  # a service that took the NaN spins and never ends by itself
        raise


def _request(pair: list[str]) -> dict:
    from test_core import request_for

    return request_for(pair, "hi", max_tokens=4).to_json()


def test_a_malformed_status_never_breaks_ps_stop_or_a_call(pair: list[str], tmp_path: Path, services: None) -> None:
    """A socket in the runtime directory that answers with wrong types (or not at all) is left out
    by ps and stop, and a call whose service answers so runs in its own process, saying why.
    Negative control: the same fake answering a well-formed status is listed."""
    directory = runtime.directory()
    fake_path = runtime.socket_path(directory, runtime.service_name())
    answers = {"status": {"pid": None, "started": "yesterday", "pairs": [{"name": 3}]}}
    listener = runtime.listen(fake_path)
    stop_fake = threading.Event()

    def fake() -> None:
        listener.settimeout(0.2)
        while not stop_fake.is_set():
            try:
                sock, _ = listener.accept()
            except OSError:
                continue
            channel = Channel(sock)
            frame = channel.recv()
            if frame is not None and frame[0] == STATUS:
                channel.send(STATUS, answers["status"])
            elif frame is not None:
                channel.send(b"Y", {"reason": "a fake"})  # RETRY: never takes a call
            channel.close()

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    try:
        ps = localspec("ps")
        assert ps.returncode == 0 and "no resident models" in ps.stdout and "Traceback" not in ps.stderr
        assert localspec("stop", "--all").returncode == 0
        call = localspec(*pair, "-n", "4", "--json", "hi")
        assert call.returncode == 0 and "not kept loaded" in call.stderr and not json.loads(call.stdout)["resident"]
        answers["status"] = {"pid": 1, "started": 0.0, "memory_bytes": 0, "memory_peak_bytes": 0, "pairs": []}
        assert [s.pid for _, s in control.services()] == [1]  # the control: a well-formed one is read
    finally:
        stop_fake.set()
        thread.join(5)
        listener.close()
        os.unlink(fake_path)


def test_another_user_is_refused(pair: list[str], services: None) -> None:
    """A connection from another uid is closed unanswered (SO_PEERCRED), even where the files'
    permissions would let it in; the same query from our own uid is answered (the control)."""
    assert localspec(*pair, "-n", "4", "hi").returncode == 0
    ((path, _),) = live()
    directory = path.parent
    for d in (directory, directory.parent):
        os.chmod(d, 0o711)
    os.chmod(path, 0o666)
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
                    sock.connect(str(path))
                    channel = Channel(sock)
                    channel.send(STATUS, {})
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
        os.chmod(path, 0o600)
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


# ---------------------------------------------------------------- the calling process, as it is


def test_text_that_is_not_utf8_is_treated_as_in_its_own_process(pair: list[str], tmp_path: Path,
                                                               services: None) -> None:
    """A prompt argument that is not UTF-8: the same usage error (exit 2); an environment value
    and a working directory whose names are not UTF-8, and a relative model path from there: the
    same output, served (the negative control of each: the call in its own process)."""
    args = [*pair, "--raw", "-t", "0", "-n", "8"]
    bad = [os.fsencode(a) for a in args] + [b"caf\xe9"]
    served = subprocess.run([sys.executable, "-m", "localspec", *bad], capture_output=True, timeout=60,
                            env={**os.environ, **ENV}, stdin=subprocess.DEVNULL)
    alone = subprocess.run([sys.executable, "-m", "localspec", *bad], capture_output=True, timeout=60,
                           env={**os.environ, "LOCALSPEC_KEEP_ALIVE": "0"}, stdin=subprocess.DEVNULL)
    assert served.returncode == alone.returncode == 2 and served.stderr == alone.stderr
    assert b"the prompt argument is not valid UTF-8 (byte 0xe9" in served.stderr
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/dir-\xff"))
    odd.mkdir()
    shutil.copyfile(pair[1], odd / "t.gguf")
    rel = ["-m", "t.gguf", "-d", "none", *EXACT, "--raw", "-t", "0", "-n", "8", PROMPT]
    environ = {**{os.fsencode(k): os.fsencode(v) for k, v in os.environ.items()}, b"ODD": b"\xff\xfe"}
    outs = [subprocess.run([sys.executable, "-m", "localspec", *rel], capture_output=True, timeout=60, cwd=odd,
                           env={**environ, b"LOCALSPEC_KEEP_ALIVE": keep}, stdin=subprocess.DEVNULL)
            for keep in (b"5m", b"5m", b"0")]
    assert [o.returncode for o in outs] == [0, 0, 0], [o.stderr for o in outs]
    assert outs[0].stdout == outs[1].stdout == outs[2].stdout and outs[0].stdout.strip()
    assert len(pairs()) == 1


def test_a_deleted_working_directory_is_treated_as_in_its_own_process(pair: list[str], tmp_path: Path,
                                                                    services: None) -> None:
    """From a working directory that no longer exists: absolute paths are served as ever; a
    relative one gets the same error as a call in its own process (and no traceback)."""
    gone_dir = tmp_path / "gone"

    def run(keep: str, *args: str) -> subprocess.CompletedProcess:
        gone_dir.mkdir(exist_ok=True)
        script = f'cd "{gone_dir}" && rmdir "{gone_dir}" && exec "$@"'
        return subprocess.run(["sh", "-c", script, "sh", sys.executable, "-m", "localspec", *args],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                              env={**os.environ, "LOCALSPEC_KEEP_ALIVE": keep})

    args = [*pair, "--raw", "-t", "0", "-n", "8", PROMPT]
    served, alone = run("5m", *args), run("0", *args)
    assert served.returncode == alone.returncode == 0 and served.stdout == alone.stdout, served.stderr
    relative = ["-m", "t.gguf", "-d", "none", *EXACT, "-n", "4", "hi"]
    served, alone = run("5m", *relative), run("0", *relative)
    assert served.returncode == alone.returncode == 1 and served.stderr == alone.stderr
    assert "'t.gguf' is neither an existing file nor a known model" in served.stderr
    assert "Traceback" not in served.stderr


# What a served call's client may import: its budget (benchmarks/resident.py measures its cost), kept
# without timing anything. localspec's modules that resolve a call, send it and print its events; of
# the third-party packages click only; of the standard library, nothing that only starting a service,
# fetching a model or running the call here needs.
CLIENT_MODULES = {
    "localspec", "localspec.errors", "localspec.loading",
    "localspec.cli", "localspec.cli.resolve", "localspec.cli.generate", "localspec.cli.options",
    "localspec.cli.render", "localspec.cli.report",
    "localspec.core", "localspec.core.calls", "localspec.core.pairs",
    "localspec.decoding", "localspec.decoding.stats",
    "localspec.llama", "localspec.llama.registry", "localspec.models",
    "localspec.resident", "localspec.resident.client", "localspec.resident.protocol", "localspec.resident.runtime",
    "localspec.settings", "localspec.settings.constraints", "localspec.settings.endpoints",
    "localspec.settings.environment", "localspec.settings.files", "localspec.settings.generation",
    "localspec.settings.locations", "localspec.settings.models", "localspec.settings.sampling",
    "localspec.settings.shape", "localspec.settings.validation",
}
CLIENT_PACKAGES = {"click", "localspec"}
NOT_IN_THE_CLIENT = {"subprocess", "tempfile", "zipfile", "shutil", "secrets", "asyncio", "concurrent", "ctypes",
                     "multiprocessing", "ssl", "http", "email", "importlib.resources"}
CLIENT = """import json, os, sys
before = set(sys.modules)
from localspec.cli import main
sys.argv = ["localspec", *json.loads(os.environ["ARGS"])]
try:
    main()
except SystemExit:
    pass
with open(os.environ["OUT"], "w") as f:
    json.dump(sorted(set(sys.modules) - before), f)
"""


def client_modules(args: list[str], out: Path, keep_alive: str = "5m") -> set[str]:
    """The modules a `localspec ARGS` process imports beyond Python's start-up (sys.modules; run
    from `out`'s directory: `python -c` puts its working directory first on sys.path)."""
    done = subprocess.run([sys.executable, "-c", CLIENT], capture_output=True, text=True, timeout=120,
                          cwd=out.parent, stdin=subprocess.DEVNULL, env={**os.environ, "LOCALSPEC_KEEP_ALIVE": keep_alive,
                                                         "ARGS": json.dumps(args), "OUT": str(out)})
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    return set(json.loads(out.read_text()))


def over_budget(modules: set[str]) -> set[str]:
    """The modules of `modules` a served call's client may not import."""
    own = {m for m in modules if m.split(".")[0] == "localspec"} - CLIENT_MODULES
    packages = {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - CLIENT_PACKAGES
    heavy = {m for m in modules if m in NOT_IN_THE_CLIENT or m.split(".")[0] in NOT_IN_THE_CLIENT}
    return own | packages | heavy


def test_the_client_imports_only_what_resolves_the_call(pair: list[str], tmp_path: Path, services: None) -> None:
    """A call the service serves imports the modules of CLIENT_MODULES, click and the standard
    library's light modules only: no pydantic, numpy, llama.cpp, llguidance or jinja2 (a schema
    too), no module that only starting the service or fetching a model needs. The negative control: the same check finds
    the modules of a call run in its own process (--keep-alive 0: numpy, llama_cpp, the engine)."""
    args = [*pair, "--raw", "-t", "0", "-n", "4", "hi"]
    assert localspec(*args).returncode == 0  # the service, started and loaded
    served = client_modules(args, tmp_path / "served.json")
    assert "localspec.resident.client" in served and "click" in served  # the list is read
    assert not over_budget(served), sorted(over_budget(served))
    schema = ["--json-schema", '{"type": "object"}', *args]  # compiled where the call runs, not here
    assert not over_budget(client_modules(schema, tmp_path / "schema.json")), "a constrained call"
    alone = client_modules(args, tmp_path / "alone.json", keep_alive="0")
    assert {"numpy", "llama_cpp", "localspec.api", "localspec.core.run"} <= over_budget(alone)


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
