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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import click

from localspec.cli import (Loaded, format_stats, load_pair, model_options, sampling_options, spec_kwargs,
                           spec_options, user_errors)

log = logging.getLogger(__name__)

PROMPT = ">>> "
CONTINUATION = "... "
HELP = """\
/help    this list
/stats   statistics of the last reply and totals for the session
/reset   forget the conversation (the system message stays)
/exit    leave (also /quit, Ctrl-D)
Ctrl-C   stop the reply being written (it stays in the history, marked as interrupted);
         press it twice at the prompt to leave
End a line with \\ to continue the message on the next line; start it with // to send a leading /."""


# ---------------------------------------------------------------- session state


def describe_session(replies: list[Any], speculative: bool) -> str:
    """Totals over every reply of the session."""
    from localspec.engine import combine

    t = combine(replies)
    line = (f"session: {len(replies)} replies, {t.generated_tokens} tokens in {t.elapsed_seconds:.2f} s "
            f"({t.tokens_per_second:.1f} tok/s); prompts {t.prompt_tokens} tokens in {t.prompt_seconds:.2f} s")
    if speculative and t.target_passes:
        line += (f"\nsession block efficiency {t.block_efficiency:.2f} tokens/target pass, acceptance "
                 f"{t.acceptance_rate:.1%} ({t.accepted_tokens}/{t.drafted_tokens} drafted)")
    return line


@dataclass
class Session:
    """The conversation and what the commands report on."""

    system: str | None
    history: list[dict] = field(default_factory=list)
    replies: list[Any] = field(default_factory=list)  # GenerationStats of every reply, in order

    @property
    def last_stats(self) -> Any:
        return self.replies[-1] if self.replies else None

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []


@dataclass
class Reply:
    """One streamed reply."""

    text: str
    finish_reason: str | None
    stats: Any
    interrupted: bool


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


def stream_reply(loaded: Loaded, history: list[dict], settings: dict, write: Callable[[str], None]) -> Reply:
    """Stream the assistant's next message to `write`; Ctrl-C stops it early."""
    from localspec.api import stream_generate

    parts: list[str] = []
    last = None
    interrupted = False
    stream = stream_generate(loaded.target, loaded.draft, history, **settings)
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
    return Reply("".join(parts), last.finish_reason if last else None, last.stats if last else None, interrupted)


# ---------------------------------------------------------------- input


def _interactive() -> bool:
    try:
        return sys.stdin.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def read_line(prompt: str) -> str:
    """One line from the user. In a terminal, input() with line editing; piped, the prompt goes
    to stderr so stdout holds only the replies."""
    if _interactive():
        return input(prompt)
    click.echo(prompt, nl=False, err=True)
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def read_message() -> str:
    """A message, joining lines that end with a backslash."""
    lines = [read_line(PROMPT)]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(read_line(CONTINUATION))
    return "\n".join(lines)


# ---------------------------------------------------------------- the loop


def _note(text: str) -> None:
    click.echo(text, err=True)


def _speculative(settings: dict) -> bool:
    return settings["num_draft_tokens"] > 0 or bool(settings["tree"])


def _show_stats(session: Session, loaded: Loaded, settings: dict) -> None:
    if session.last_stats is None:
        _note("no reply yet")
        return
    _note("last reply: " + format_stats(session.last_stats, _speculative(settings), loaded.target))
    _note(describe_session(session.replies, _speculative(settings)))


def _command(line: str, session: Session, loaded: Loaded, settings: dict) -> bool:
    """Run a /command; False when the user wants to leave."""
    name = line.split()[0].lower()
    if name in ("/exit", "/quit"):
        return False
    if name == "/help":
        _note(HELP)
    elif name == "/reset":
        session.reset()
        _note("conversation cleared" + (" (system message kept)" if session.system else ""))
    elif name == "/stats":
        _show_stats(session, loaded, settings)
    else:
        _note(f"unknown command {name}; /help lists the commands (start a message with // to send a leading /)")
    return True


def _context_note(loaded: Loaded) -> str:
    return f"the context is full ({loaded.target.n_ctx} tokens); /reset to start over, or use a larger --ctx-size"


def _turn(text: str, session: Session, loaded: Loaded, settings: dict, seed: int | None) -> None:
    """Send one user message and stream the reply."""
    from localspec.model import ModelError

    session.history.append({"role": "user", "content": text})
    turn_settings = dict(settings, seed=None if seed is None else seed + len(session.replies))

    written: list[str] = []

    def write(piece: str) -> None:
        written.append(piece)
        click.echo(piece, nl=False)
        sys.stdout.flush()

    try:
        reply = stream_reply(loaded, session.history, turn_settings, write)
    except ModelError as exc:  # the conversation no longer fits, or the context filled mid-step
        session.history.pop()
        if written:
            click.echo("")
        _note(f"error: {exc}")
        _note(_context_note(loaded) if "context" in str(exc) else "the message was not added to the history")
        return
    click.echo("")
    message: dict = {"role": "assistant", "content": reply.text}
    if reply.interrupted:
        message["interrupted"] = True
        _note("[interrupted: the partial reply stays in the history; /reset to start over]")
    session.history.append(message)
    if reply.stats is not None:
        session.replies.append(reply.stats)
    if reply.finish_reason == "length" and not reply.interrupted:
        if reply.stats is not None and reply.stats.generated_tokens < settings["max_tokens"]:
            _note(_context_note(loaded))
        else:
            _note(f"[reply cut at --max-tokens {settings['max_tokens']}]")


def _banner(loaded: Loaded, settings: dict, drafter: str) -> str:
    target = loaded.target.name
    if drafter == "ngram":
        draft = "n-gram drafter"
    elif loaded.draft is None:
        draft = "no draft (target alone)"
    else:
        draft = f"draft {loaded.draft.name}"
    if not _speculative(settings):
        how = "no speculation"
    elif settings["tree"]:
        how = f"verifier {settings['verifier']}, tree {'x'.join(map(str, settings['tree']))}"
    else:
        paths = f", {settings['paths']} paths" if settings["paths"] > 1 else ""
        how = f"verifier {settings['verifier']}, k={settings['num_draft_tokens']}{paths}"
    return (f"localspec chat: {target} + {draft}, {how}, plan {settings['plan']}, "
            f"context {loaded.target.n_ctx} tokens\n/help for commands, /exit to leave")


def chat_loop(session: Session, loaded: Loaded, settings: dict, seed: int | None) -> None:
    """Read messages and commands until /exit, EOF, or Ctrl-C twice at the prompt."""
    pending_interrupt = False
    while True:
        try:
            line = read_message()
        except EOFError:
            click.echo("", err=True)
            return
        except KeyboardInterrupt:
            click.echo("", err=True)
            if pending_interrupt:
                return
            _note("(press Ctrl-C again or type /exit to leave)")
            pending_interrupt = True
            continue
        pending_interrupt = False
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            if not _command(text, session, loaded, settings):
                return
            continue
        _turn(line[1:] if text.startswith("//") else line, session, loaded, settings, seed)


def _validate(loaded: Loaded, spec: dict, drafter: str, sampling: dict) -> None:
    """Refuse impossible settings before the first message (raises localspec errors)."""
    from localspec import verifier
    from localspec.engine import SpecConfig
    from localspec.model import check_pair

    target = loaded.target
    if not target.chat_template:
        raise click.ClickException(f"{target.path.name} has no chat template, so it cannot chat; for plain "
                                   f"text completion use: localspec generate --raw -m {target.path}")
    SpecConfig(verifier=spec["verifier"], num_draft_tokens=spec["num_draft_tokens"], paths=spec["paths"],
               tree=spec["tree"], plan=spec["plan"]).validate(drafter, target.n_batch)
    verifier.check_sampling(sampling["temperature"], sampling["top_k"], sampling["top_p"], sampling["min_p"])
    if loaded.draft is not None and drafter != "ngram":
        check_pair(target, loaded.draft)


def _close(loaded: Loaded) -> None:
    loaded.target.close()
    if loaded.draft is not None:
        loaded.draft.close()


@click.command()
@model_options
@spec_options
@sampling_options
@click.option("-s", "--system", default=None, help="System message, kept across /reset.")
@user_errors
def chat(model: str | None, draft: str | None, ctx_size: int, n_gpu_layers: int, draft_n_gpu_layers: int | None,
         threads: int | None, cache_type: str, load_mode: str, verifier: str, num_draft_tokens: int,
         paths: int, tree: str | None, drafter: str,
         plan: str, temperature: float, top_k: int, top_p: float, min_p: float, seed: int | None,
         max_tokens: int, system: str | None) -> None:
    """Chat with the model in the terminal, using its chat template.

    Replies stream to stdout as they are generated; the banner, notes and
    statistics go to stderr. Messages can also be piped, one per line.

    \b
    Commands at the >>> prompt:
      /help    the commands
      /stats   statistics of the last reply and of the session
      /reset   forget the conversation (the system message stays)
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
    from localspec.api import target_alone_without_draft

    spec = spec_kwargs(verifier, num_draft_tokens, paths, tree, drafter, plan)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=max_tokens)
    loaded = load_pair(model, draft, ctx_size=ctx_size, n_gpu_layers=n_gpu_layers,
                       draft_n_gpu_layers=draft_n_gpu_layers, threads=threads, cache_type=cache_type,
                       load_mode=load_mode, need_draft=drafter != "ngram")
    try:
        spec = target_alone_without_draft(spec, loaded.draft is not None)
        _validate(loaded, spec, drafter, sampling)
        if _interactive():
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  line editing and history for input()
        settings = dict(sampling, **spec)
        _note(_banner(loaded, settings, drafter))
        chat_loop(Session(system), loaded, settings, seed)
    finally:
        _close(loaded)


COMMANDS = (chat,)
