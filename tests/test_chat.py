"""`localspec chat`: driven through a pseudo-terminal as a person would, and with piped input.

Every wait has a timeout, so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from click.testing import CliRunner

from localspec.api import generate
from localspec.cli import chat as chat_module, cli
from localspec.cli.chat_commands import Session
from localspec.settings.generation import GenerationConfig
from localspec.core.calls import Done, Text
from localspec.decoding.stats import GenerationStats
from localspec.llama.model import Model

import tiny_models as tiny



PROMPT = b">>> "
TIMEOUT = 30.0


# ---------------------------------------------------------------- a pseudo-terminal


class Terminal:
    """A child process on a pseudo-terminal: type into it, read its screen."""

    def __init__(self, argv: list[str], sigint: object = signal.SIG_DFL) -> None:
        env = dict(os.environ, TERM="dumb", PYTHONUNBUFFERED="1")
        pid, fd = pty.fork()
        if pid == 0:  # the child
            try:
                signal.signal(signal.SIGINT, sigint)  # the disposition the program inherits
                os.execvpe(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self.screen = b""  # everything read so far
        self.mark = 0  # where the last read_until match ended
        self.status: int | None = None

    def send(self, data: bytes) -> None:
        try:
            os.write(self.fd, data)
        except OSError:  # the program has ended; read_until/wait report it
            pass

    def type(self, line: str) -> None:
        self.send(line.encode() + b"\r")

    def _read_some(self, deadline: float) -> bool:
        """Read what is available before the deadline; False at EOF."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, min(0.2, deadline - time.monotonic())))
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.screen += data
        return bool(data)

    def read_until(self, pattern: bytes, timeout: float = TIMEOUT) -> bytes:
        """The screen from the previous match up to and including the next `pattern` (a regex)."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            found = regex.search(self.screen, self.mark)
            if found:
                text = self.screen[self.mark: found.end()]
                self.mark = found.end()
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {pattern!r}; screen since the last match:\n"
                                     f"{self.screen[self.mark:]!r}")
            if not self._read_some(deadline):
                raise AssertionError(f"the program ended before {pattern!r}; screen since the last match:\n"
                                     f"{self.screen[self.mark:]!r}")

    def interrupt_at_prompt(self, pattern: bytes | None, timeout: float = TIMEOUT) -> bytes | int:
        """Press Ctrl-C at the prompt until `pattern` shows (None: until the program exits).

        A SIGINT that lands after the prompt is drawn but before CPython's readline waits for
        input stays pending until the next key (a race a person never hits), so press again."""
        deadline = time.monotonic() + timeout
        while True:
            self.send(b"\x03")
            try:
                return self.read_until(pattern, timeout=1.0) if pattern else self.wait(timeout=1.0)
            except AssertionError:
                if time.monotonic() > deadline:
                    raise

    def wait(self, timeout: float = TIMEOUT) -> int:
        """The exit status (the screen is drained meanwhile)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
            self._read_some(deadline)
        raise AssertionError(f"the program did not exit; screen:\n{self.screen[self.mark:]!r}")

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.fd)


@pytest.fixture
def terminal() -> Iterator[Callable[..., "Terminal"]]:
    opened: list[Terminal] = []

    def start(*args: str, sigint: object = signal.SIG_DFL) -> Terminal:
        t = Terminal([sys.executable, "-m", "localspec", "chat", *args], sigint)
        opened.append(t)
        return t

    yield start
    for t in opened:
        t.close()


@pytest.fixture(scope="module")
def pair_args(tiny_paths: tuple[Path, Path]) -> list[str]:
    # the F32 KV cache of the tiny_target fixture, and fixed draft shapes: the replies equal the
    # fixture's own speculative output bit for bit (same batches; tests/greedy.py says why that matters)
    return ["-m", str(tiny_paths[0]), "-d", str(tiny_paths[1]), "--threads", "1", "--plan", "fixed", "-t", "0",
            "--cache-type", "f32"]


def on_screen(text: str) -> bytes:
    """How text appears on a terminal (newlines become CR LF)."""
    return text.replace("\n", "\r\n").encode("utf-8", "replace")


def fresh_reply(target: Model, draft: Model, messages: list[dict], max_tokens: int) -> str:
    """The greedy speculative reply from empty caches (as a new chat process computes it)."""
    target.clear()
    draft.clear()
    return generate(target, draft, messages, temperature=0, max_tokens=max_tokens, plan="fixed")


@pytest.fixture(scope="module")
def hello_reply(tiny_target: Model, tiny_draft: Model) -> str:
    """Greedy reply to "hello" in a fresh conversation (what the chat must show)."""
    return fresh_reply(tiny_target, tiny_draft, [{"role": "user", "content": "hello"}], 24)


# ---------------------------------------------------------------- in a terminal


def test_terminal_conversation(terminal, pair_args: list[str], hello_reply: str) -> None:
    t = terminal(*pair_args, "--ctx-size", "512", "-n", "24")
    banner = t.read_until(PROMPT)
    assert b"/help for commands" in banner and b"verifier block" in banner

    t.type("hello")
    first = t.read_until(PROMPT)
    assert on_screen(hello_reply) in first  # the reply, streamed to the screen
    assert b"[reply cut at --max-tokens 24]" in first

    t.type("/stats")
    stats = t.read_until(PROMPT)
    assert re.search(rb"block efficiency \d+\.\d\d tokens/target pass", stats), stats
    assert b"24 tokens in" in stats and b"session: 1 replies" in stats
    prompt_1 = int(re.search(rb"\(prompt (\d+) tokens", stats).group(1))

    t.type("again")  # the second turn sees the first: a longer prompt
    t.read_until(PROMPT)
    t.type("/stats")
    stats = t.read_until(PROMPT)
    assert int(re.search(rb"\(prompt (\d+) tokens", stats).group(1)) > prompt_1 + 24
    assert b"session: 2 replies, 48 tokens" in stats

    t.type("/reset")
    assert b"conversation cleared" in t.read_until(PROMPT)
    t.type("hello")  # after /reset the same message gets the same (greedy) reply
    assert on_screen(hello_reply) in t.read_until(PROMPT)

    t.type("/nonsense")
    assert b"unknown command /nonsense" in t.read_until(PROMPT)
    t.type("/exit")
    assert t.wait() == 0


@pytest.mark.parametrize("sigint", [signal.SIG_DFL, signal.SIG_IGN], ids=["sigint-default", "sigint-ignored"])
def test_terminal_ctrl_c_stops_the_reply_and_the_chat_goes_on(terminal, pair_args: list[str], sigint) -> None:
    """Also when the chat inherits SIGINT ignored (a background job, some CI runners): the person
    at the terminal still stops replies and leaves with Ctrl-C."""
    # a long greedy reply (about 1200 tokens before EOS on the tiny model): time to interrupt it
    t = terminal(*pair_args, "--ctx-size", "4096", "-n", "4000", sigint=sigint)
    t.read_until(PROMPT)
    t.type("hello there")
    t.read_until(rb"hello there\r\n")  # the echo of the line typed
    t.read_until(rb"[^\r\n]{8}")  # the reply is streaming
    t.send(b"\x03")
    stopped = t.read_until(PROMPT)
    assert b"[interrupted" in stopped

    t.type("/stats")
    stats = t.read_until(PROMPT)
    assert b"session: 1 replies" in stats
    assert int(re.search(rb"last reply: (\d+) tokens", stats).group(1)) < 4000

    t.type("and now?")  # another message works (and is interrupted in turn)
    t.read_until(rb"and now\?\r\n")
    t.read_until(rb"[^\r\n]{8}")
    t.send(b"\x03")
    assert b"[interrupted" in t.read_until(PROMPT)

    # Ctrl-C at the prompt asks first, and leaves on the second
    assert b"press Ctrl-C again or type /exit" in t.interrupt_at_prompt(rb"press Ctrl-C again[^>]*>>> ")
    assert t.interrupt_at_prompt(None) == 0


def test_invalid_utf8_line_is_refused_and_the_chat_goes_on(pair_args: list[str], hello_reply: str) -> None:
    result = CliRunner().invoke(cli, ["chat", *pair_args, "--ctx-size", "512", "-n", "24"],
                                input=b"caf\xe9\nhello\n", catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "that line is not valid UTF-8 (byte 0xe9); it was not sent" in result.stderr
    assert result.stdout == hello_reply + "\n"


def test_terminal_ctrl_d_leaves(terminal, pair_args: list[str]) -> None:
    t = terminal(*pair_args, "--ctx-size", "256")
    t.read_until(PROMPT)
    t.send(b"\x04")
    assert t.wait() == 0


# ---------------------------------------------------------------- piped input


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(cli, ["chat", *args], input=input, catch_exceptions=False)


def test_piped_messages_and_stats(pair_args: list[str], hello_reply: str) -> None:
    result = run(*pair_args, "--ctx-size", "512", "-n", "24", input="hello\n/stats\n/exit\nnever sent\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == hello_reply + "\n"  # stdout: the replies only
    assert "block efficiency" in result.stderr and "session: 1 replies, 24 tokens" in result.stderr
    assert "/help for commands" in result.stderr


def test_piped_commands(pair_args: list[str], hello_reply: str) -> None:
    result = run(*pair_args, "--ctx-size", "512", "-n", "24",
                 input="/stats\n/help\n/what\n\n//literal slash\nhello\\\nworld\n/quit\n")
    assert result.exit_code == 0, result.output
    err = result.stderr
    assert "no reply yet" in err
    for command in ("/help", "/stats", "/reset", "/exit"):
        assert command in err
    assert "unknown command /what" in err
    assert err.count("[reply cut at --max-tokens 24]") == 2  # "/literal slash" and "hello\nworld" were sent
    assert result.stdout.count("\n") >= 2


def test_system_message_is_sent_and_kept_after_reset(pair_args: list[str], tiny_target: Model,
                                                     tiny_draft: Model) -> None:
    system = [{"role": "system", "content": "You are terse."}]
    expected = fresh_reply(tiny_target, tiny_draft, system + [{"role": "user", "content": "hello"}], 16)
    result = run(*pair_args, "--ctx-size", "512", "-n", "16", "-s", "You are terse.",
                 input="hello\n/reset\nhello\n")  # EOF leaves
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{expected}\n{expected}\n"
    assert "system message kept" in result.stderr


def test_full_context_says_so_and_reset_recovers(pair_args: list[str]) -> None:
    result = run(*pair_args, "--ctx-size", "64", "-n", "500", input="hello\nmore\n/reset\nhello\n/stats\n")
    assert result.exit_code == 0, result.output
    err = result.stderr
    # (llama.cpp rounds the context up to 256 cells)
    assert re.search(r"the context is full \(\d+ tokens\); /reset to start over", err), err
    assert re.search(r"the prompt has \d+ tokens but the context holds \d+", err), err  # "more" no longer fits
    assert "session: 2 replies" in err  # after /reset the chat works again


def test_model_without_chat_template(tmp_path: Path) -> None:
    bare = tiny.write_tiny_model(tmp_path / "bare.gguf", chat_template=False)
    result = CliRunner().invoke(cli, ["chat", "-m", str(bare), "-d", "none"], input="hello\n")
    assert result.exit_code == 1
    assert "bare.gguf has no chat template" in result.output and "localspec generate --raw" in result.output
    assert "Traceback" not in result.output


def test_bad_settings_fail_before_the_first_message(pair_args: list[str]) -> None:
    result = CliRunner().invoke(cli, ["chat", *pair_args, "--verifier", "block", "--tree", "2x2"], input="hi\n")
    assert result.exit_code == 2 and "verifies one chain" in result.output


# ---------------------------------------------------------------- the interrupt, unit level


def _stats(n: int) -> GenerationStats:
    return GenerationStats(3, n, n, 0, 0, 0.0, 0.01 * n, 0.0, 0.0, 0.0, ())


class FakeCall:
    """A call whose events are a reply of up to 100 words; Ctrl-C (its cancel) ends it at the next word."""

    resident = False

    def __init__(self) -> None:
        self.reason: str | None = None

    def cancel(self, reason: str) -> None:
        self.reason = reason

    def events(self) -> Iterator[object]:
        for i in range(100):
            if i == 3:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: only stops the call
            if self.reason is not None:
                yield Done(model="t", finish_reason=None, stats=_stats(i), stopped=self.reason)
                return
            yield Text(f"w{i} ", drafted=i % 2 == 1)
        yield Done(model="t", finish_reason="length", stats=_stats(100))


def test_interrupted_reply_is_kept_and_marked(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """SIGINT mid-reply: the call stops between tokens; the partial reply stays, marked."""
    session = Session("sys", config=GenerationConfig(max_tokens=100))
    call = FakeCall()
    monkeypatch.setattr(Session, "call", lambda self, kind, prompt, config=None: call)
    before = signal.getsignal(signal.SIGINT)
    chat_module._turn("hi", session)
    assert call.reason == "interrupted"
    assert session.history[0] == {"role": "system", "content": "sys"}
    assert session.history[1] == {"role": "user", "content": "hi"}
    assert session.history[2] == {"role": "assistant", "content": "w0 w1 w2 ", "interrupted": True}
    assert session.last_stats.generated_tokens == 3
    assert "[interrupted" in capsys.readouterr().err
    session.reset()
    assert session.history == [{"role": "system", "content": "sys"}]
    assert signal.getsignal(signal.SIGINT) is before  # the handler is restored


def test_constrained_reply_cut_short_is_said_to_be_incomplete(pair_args: list[str]) -> None:
    schema = '{"type": "object", "properties": {"word": {"type": "string", "maxLength": 400}}, "required": ["word"]}'
    cut = run(*pair_args, "-t", "0", "-n", "3", "--json-schema", schema, input="hello\n")
    assert cut.exit_code == 0, cut.output
    assert "the reply is incomplete: it does not match" in cut.stderr
    done = run(*pair_args, "-t", "0", "-n", "200", "--regex", "(yes|no)", input="hello\n")
    assert done.exit_code == 0, done.output
    assert "incomplete" not in done.stderr and ("yes" in done.stdout or "no" in done.stdout)
