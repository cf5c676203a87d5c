"""``localspec chat``: a multi-turn conversation in the terminal, with speculative decoding.

The chat runs here, in the command line, as ollama's does: it reads the user's lines (with line
editing in a terminal), keeps the conversation and its commands, and makes one call per reply,
to the resident service (which keeps the pair loaded between replies, so other calls on it run
between two of this chat's) or, with ``--keep-alive 0``, in this process. The conversation is
rendered with the model's own chat template every turn; the KV cache keeps the shared prefix, so
a new turn only decodes what is new.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any

import click

from localspec.cli import render, resolve
from localspec.cli.chat_commands import Session, note, run_command
from localspec.cli.chat_store import load_chat
from localspec.cli.options import (
    Flags,
    compile_constraint_now,
    constraint_options,
    generation_config,
    keep_alive_option,
    model_options,
    prompt_cache_option,
    sampling_options,
    spec_options,
    user_errors,
)
from localspec.core.calls import Done, Failed, Note, Prompt, Ready, Text
from localspec.errors import ConfigError, ModelError
from localspec.loading import draft_loading
from localspec.settings.files import TEXT_LIMIT, mib
from localspec.settings.generation import GenerationConfig

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
    error: ModelError | None = None  # the conversation no longer fits, or the context filled mid-reply
    done: Done | None = None


def follow_reply(call: Any, write: Any, config: GenerationConfig) -> ChatReply:
    """Stream a reply's text to `write(text, drafted)`. Ctrl-C stops it after the current step
    (the partial reply is kept); SIGTERM too, and then the chat ends (Terminated, raised after)."""
    from localspec.resident.client import ServiceLost

    parts: list[str] = []
    done: Done | None = None
    with render.stopping(call, lambda: True, leave=False):
        try:
            for event in call.events():
                if isinstance(event, Note):
                    note(event.text)
                elif isinstance(event, Text):
                    parts.append(event.text)
                    write(event.text, event.drafted)
                elif isinstance(event, Failed):
                    error = resolve.error_of(event, config=config)
                    if not isinstance(error, ModelError):
                        raise error
                    return ChatReply("", None, None, False, error=error)
                elif isinstance(event, Done):
                    done = event
        except ServiceLost:
            sys.exit(render.service_lost())
    assert done is not None
    if done.error is not None:
        error = resolve.error_of(done.error, config=config)
        if not isinstance(error, ModelError):
            raise error
        return ChatReply("".join(parts), None, None, False, error=error)
    if done.stopped == "terminated":
        raise render.Terminated()
    return ChatReply("".join(parts), done.finish_reason, done.stats, done.stopped is not None,
                     done.constraint_satisfied, done=done)


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
            return input(prompt)
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


def _context_note(session: Session) -> str:
    return (f"the context is full ({session.ready.n_ctx} tokens); /reset to start over, or use a larger "
            "--ctx-size")


def _turn(text: str, session: Session) -> None:
    """Send one user message and stream the reply."""
    session.history.append({"role": "user", "content": text})
    config = session.config
    seed = None if config.seed is None else (config.seed + len(session.replies)) % 2**64
    turn = config if seed is None else dataclasses.replace(config, seed=seed)
    written: list[str] = []

    def write(piece: str, drafted: bool) -> None:
        written.append(piece)
        render.write_text(piece, drafted, session.show_drafts)

    reply = follow_reply(session.call("generate", Prompt(messages=list(session.history)), turn), write, config)
    if reply.error is not None:  # the conversation no longer fits, or the context filled mid-step
        session.history.pop()
        if written:
            click.echo("")
        note(f"error: {reply.error}")
        note(_context_note(session) if "context" in str(reply.error) else "the message was not added to the history")
        return
    click.echo("")
    message: dict = {"role": "assistant", "content": reply.text}
    if reply.interrupted:
        message["interrupted"] = True
        note("[interrupted: the partial reply stays in the history; /reset to start over]")
    session.history.append(message)
    if reply.stats is not None:
        session.replies.append(reply.stats)
        session.last = reply.done
    if reply.finish_reason == "length" and not reply.interrupted:
        if reply.stats is not None and reply.stats.generated_tokens < config.max_tokens:
            note(_context_note(session))
        else:
            note(f"[reply cut at --max-tokens {config.max_tokens}]")
    if config.constraint is not None and reply.constraint_satisfied is False:
        note(f"[the reply is incomplete: it does not match {config.constraint.describe()}]")


def _banner(ready: Ready) -> str:
    return (f"localspec chat: {ready.model}, {ready.speculation}, context {ready.n_ctx} tokens\n"
            "/help for commands, /exit to leave")


def chat_loop(session: Session) -> None:
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
        except render.Terminated:
            raise
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
            if not run_command(text, session):
                return
            continue
        _turn(line[1:] if text.startswith("//") else line, session)


def _open(session: Session) -> Ready:
    """The chat's first call: the pair loaded (in the service or here) and the settings checked
    against it, before the first message; a stop before it is ready ends the chat."""
    with render.load_bars() as bars:  # a load in this process: its bar on a terminal
        call = session.call("open", Prompt(system=session.system))
        ready = _opened(call, session, bars)
    assert ready is not None
    return ready


def _opened(call: Any, session: Session, bars: render.LoadBars) -> Ready | None:
    """The events of the open call (`bars`: its load's, cleared before anything else is said)."""
    from localspec.resident.client import ServiceLost

    ready: Ready | None = None
    try:
        with render.stopping(call, lambda: False):
            for event in call.events():
                if isinstance(event, Note):
                    bars.note(event.text)
                elif isinstance(event, Ready):
                    ready = event
                elif isinstance(event, Failed):
                    raise resolve.error_of(event, config=session.config)
                elif isinstance(event, Done) and (event.stopped or ready is None):
                    raise render.Terminated() if event.stopped == "terminated" else KeyboardInterrupt()
                elif isinstance(event, Done) and call.resident and event.timings.get("target_load"):
                    render.stays_loaded(event.model, session.keep_alive)
    except ServiceLost:
        bars.stop()
        sys.exit(render.service_lost())
    except KeyboardInterrupt as stop:
        bars.stop()
        click.echo(render.stop_word(stop), err=True)
        call.abandon(render.exit_status(stop))
        sys.exit(render.exit_status(stop))
    return ready


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
@click.option("--show-drafts", is_flag=True,
              help="On a terminal, print the text of accepted drafts in another colour (/drafts toggles it).")
@user_errors
def chat(model: str | None, draft: str | None, system: str | None, resume: str | None, show_drafts: bool,
         **_: Any) -> None:
    """Chat with the model in the terminal, using its chat template.

    Replies stream to stdout as they are generated; the banner, notes and
    statistics go to stderr. Messages can also be piped, one per line.

    \b
    Commands at the >>> prompt:
      /help    the commands
      /stats   statistics of the last reply and of the session
      /reset   forget the conversation (the system message stays)
      /save N  keep the conversation as N (resume it with --resume N)
      /drafts  show the text of accepted drafts in another colour (again: off)
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
    flags = Flags.current()
    with render.stop_signals():
        keep_alive = flags["keep_alive"]
        cache = resolve.prompt_cache(flags["prompt_cache"])
        config = generation_config(flags)
        saved = load_chat(resume) if resume is not None else None
        if saved is not None and system is None:  # the system message is the saved one unless -s gives another
            system = saved["system"]
        pair = resolve.resolve_pair(model, draft, flags.load(), need_draft=draft_loading(config.drafter, False)[0],
                                  before_fetch=lambda: compile_constraint_now(config))
        caller = resolve.Caller(keep_alive, shared=True)
        session = Session(system, config=config, caller=caller, pair=pair, cache=cache, keep_alive=keep_alive,
                          show_drafts=render.colours(show_drafts))
        try:
            session.ready = _open(session)
            if saved is not None:
                session.history += [m for m in saved["history"] if m["role"] != "system"]
                note(f"resumed {resume}: {len(session.history)} messages")
            if _interactive():
                with contextlib.suppress(ImportError):
                    import readline  # noqa: F401  line editing and history for input()
            note(_banner(session.ready))
            chat_loop(session)
        except render.Terminated as stop:
            click.echo(render.stop_word(stop), err=True)
            sys.exit(render.exit_status(stop))
        finally:
            caller.close()
