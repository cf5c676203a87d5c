"""``localspec chat``: a multi-turn conversation in the terminal, with speculative decoding.

The conversation is rendered with the model's own chat template every turn; the target's and
draft's KV caches keep the shared prefix, so a new turn only decodes what is new.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import click

from localspec.cli.options import (
    constraint_options,
    keep_alive_option,
    prompt_cache_option,
    generation_config,
    model_options,
    sampling_options,
    spec_options,
    user_errors,
)
from localspec.config import GenerationConfig
from localspec.errors import ConfigError
from localspec.files import TEXT_LIMIT, mib
from localspec.loading import Loaded
from localspec.decoding.profiles import Profiles
from localspec.cli.chat_commands import Session, note, run_command
from localspec.cli.chat_store import load_chat
from localspec.cli.report import describe_speculation
from localspec.cli import resources

log = logging.getLogger(__name__)

PROMPT = ">>> "
CONTINUATION = "... "


# ---------------------------------------------------------------- a reply


@dataclass
class ChatReply:
    """One streamed reply."""

    text: str
    finish_reason: str | None
    stats: Any
    interrupted: bool
    constraint_satisfied: bool | None = None  # with a constraint: whether the reply is a complete answer


# ---------------------------------------------------------------- Ctrl-C while streaming


@dataclass
class _Interrupt:
    requested: bool = False  # Ctrl-C was pressed while streaming


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[_Interrupt]:
    """While streaming, the first Ctrl-C only sets a flag (the reply stops cleanly after the
    current step, keeping the KV caches reusable); a second one interrupts at once."""
    flag = _Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, frame: Any) -> None:
        if flag.requested:
            raise KeyboardInterrupt
        flag.requested = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_reply(loaded: Loaded, history: list[dict], config: GenerationConfig,
                 write: Callable[[str], None], profiles: Profiles, prompt_cache: Any = None) -> ChatReply:
    """Stream the assistant's next message to `write`; Ctrl-C stops it early."""
    from localspec.api import stream_generate

    parts: list[str] = []
    last = None
    interrupted = False
    stream = stream_generate(loaded.target, loaded.draft, history, config, profiles=profiles,
                             prompt_cache=prompt_cache or False)
    with deferred_interrupt() as flag:
        try:
            for r in stream:
                last = r
                if r.text:
                    parts.append(r.text)
                    write(r.text)
                if flag.requested and r.finish_reason is None:
                    interrupted = True
                    break
        except KeyboardInterrupt:  # the second Ctrl-C, or one before the first token
            interrupted = True
        finally:
            stream.close()  # between steps: the engine records its KV caches for reuse
            profiles.save()
    return ChatReply("".join(parts), last.finish_reason if last else None, last.stats if last else None, interrupted,
                 last.constraint_satisfied if last else None)


# ---------------------------------------------------------------- input


def _interactive() -> bool:
    try:
        return sys.stdin.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


class NotText(ValueError):
    """A line the user sent is not valid UTF-8."""


def read_line(prompt: str) -> str:
    """One line from the user. In a terminal, input() with line editing; piped, the prompt goes
    to stderr so stdout holds only the replies, and lines are read as bytes and decoded here (a
    line that is not UTF-8 is refused alone, the next one is read normally)."""
    try:
        if _interactive():
            return resources.current().input(prompt)
        click.echo(prompt, nl=False, err=True)
        stream = getattr(sys.stdin, "buffer", None)
        raw = stream.readline(TEXT_LIMIT + 1) if stream is not None else sys.stdin.readline(TEXT_LIMIT + 1).encode()
        if not raw:
            raise EOFError
        if len(raw) > TEXT_LIMIT:  # /dev/zero, or a file without line breaks: never read into memory whole
            raise ConfigError(f"a line on stdin is longer than {mib(TEXT_LIMIT)}, the most localspec reads "
                              "for one message")
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise NotText(f"that line is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x}); it was not sent") from None


def read_message() -> str:
    """A message, joining lines that end with a backslash."""
    lines = [read_line(PROMPT)]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(read_line(CONTINUATION))
    return "\n".join(lines)


# ---------------------------------------------------------------- the loop


def _context_note(loaded: Loaded) -> str:
    return f"the context is full ({loaded.target.n_ctx} tokens); /reset to start over, or use a larger --ctx-size"


def _turn(text: str, session: Session, loaded: Loaded, config: GenerationConfig) -> None:
    """Send one user message and stream the reply."""
    from localspec.errors import ModelError

    session.history.append({"role": "user", "content": text})
    turn = config if config.seed is None else replace(config, seed=(config.seed + len(session.replies)) % 2**64)

    written: list[str] = []

    def write(piece: str) -> None:
        written.append(piece)
        click.echo(piece, nl=False)
        sys.stdout.flush()

    try:
        reply = stream_reply(loaded, session.history, turn, write, session.profiles, session.prompt_cache)
    except ModelError as exc:  # the conversation no longer fits, or the context filled mid-step
        session.history.pop()
        if written:
            click.echo("")
        note(f"error: {exc}")
        note(_context_note(loaded) if "context" in str(exc) else "the message was not added to the history")
        return
    click.echo("")
    message: dict = {"role": "assistant", "content": reply.text}
    if reply.interrupted:
        message["interrupted"] = True
        note("[interrupted: the partial reply stays in the history; /reset to start over]")
    session.history.append(message)
    if reply.stats is not None:
        session.replies.append(reply.stats)
    if reply.finish_reason == "length" and not reply.interrupted:
        if reply.stats is not None and reply.stats.generated_tokens < config.max_tokens:
            note(_context_note(loaded))
        else:
            note(f"[reply cut at --max-tokens {config.max_tokens}]")
    if config.constraint is not None and reply.constraint_satisfied is False:
        note(f"[the reply is incomplete: it does not match {config.constraint.describe()}]")


def _banner(loaded: Loaded, config: GenerationConfig) -> str:
    target = loaded.target.name
    how = describe_speculation(config, loaded.draft.name if loaded.draft is not None else None)
    return (f"localspec chat: {target}, {how}, context {loaded.target.n_ctx} tokens\n"
            "/help for commands, /exit to leave")


def chat_loop(session: Session, loaded: Loaded, config: GenerationConfig) -> None:
    """Read messages and commands until /exit, EOF, or Ctrl-C twice at the prompt."""
    pending_interrupt = False
    while True:
        try:
            line = read_message()
        except EOFError:
            click.echo("", err=True)
            return
        except NotText as exc:
            note(str(exc))
            continue
        except KeyboardInterrupt:
            click.echo("", err=True)
            if pending_interrupt:
                return
            note("(press Ctrl-C again or type /exit to leave)")
            pending_interrupt = True
            continue
        pending_interrupt = False
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            if not run_command(text, session, loaded, config):
                return
            continue
        _turn(line[1:] if text.startswith("//") else line, session, loaded, config)


def _validate(loaded: Loaded, config: GenerationConfig, system: str | None, profiles: Profiles) -> GenerationConfig:
    """Refuse impossible settings before the first message (raises localspec errors); the
    settings as they apply to the loaded pair."""
    from localspec.api import Generation

    target = loaded.target
    if not target.chat_template:
        raise click.ClickException(f"{target.path.name} has no chat template, so it cannot chat; for plain "
                                   f"text completion use: localspec generate --raw -m {target.path}")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": ""}]
    return Generation(target, loaded.draft, messages, config, profiles).config  # validates; nothing is decoded


@contextlib.contextmanager
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt while chatting, whatever SIGINT disposition the process
    inherited (a shell or CI runner may start it with SIGINT ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@click.command()
@model_options
@spec_options
@sampling_options
@click.option("-s", "--system", default=None, help="System message, kept across /reset.")
@constraint_options
@prompt_cache_option
@keep_alive_option
@click.option("--resume", default=None, metavar="NAME",
              help="Continue a conversation kept with /save NAME (its KV state comes from the prompt cache).")
@user_errors
def chat(model: str | None, draft: str | None, system: str | None, resume: str | None, **options: Any) -> None:
    """Chat with the model in the terminal, using its chat template.

    Replies stream to stdout as they are generated; the banner, notes and
    statistics go to stderr. Messages can also be piped, one per line.

    \b
    Commands at the >>> prompt:
      /help    the commands
      /stats   statistics of the last reply and of the session
      /reset   forget the conversation (the system message stays)
      /save N  keep the conversation as N (resume it with --resume N)
      /exit    leave (also /quit and Ctrl-D)
    Ctrl-C stops a reply being written (the partial reply stays in the
    history, marked as interrupted); at the prompt, press Ctrl-C twice
    (or type /exit) to leave.

    \b
    localspec chat
    localspec chat -s "You are a terse Python expert." -t 0.3
    localspec chat -m target.gguf -d draft.gguf --verifier traversal --tree 3x2x1
    printf 'Write fizzbuzz\\n/stats\\n' | localspec chat -t 0
    """
    res = resources.current()
    res.keep_alive(options.pop("keep_alive", None))
    cache = res.prompt_cache(options.pop("prompt_cache", None))
    config = generation_config(options)
    saved = load_chat(resume) if resume is not None else None
    if saved is not None and system is None:
        system = saved["system"]
    loaded = res.load_for(config, model, draft, options)
    try:
        session = Session(system, profiles=res.session_profiles(), prompt_cache=cache)
        if saved is not None:  # the system message is the saved one unless -s gives another
            session.history += [m for m in saved["history"] if m["role"] != "system"]
            note(f"resumed {resume}: {len(session.history)} messages")
        config = _validate(loaded, config, system, session.profiles)
        if _interactive():
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  line editing and history for input()
        note(_banner(loaded, config))
        with ctrl_c_raises():
            chat_loop(session, loaded, config)
    finally:
        res.release(loaded)

