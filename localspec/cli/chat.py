"""``localspec chat``: a multi-turn conversation in the terminal, with speculative decoding.

The conversation is rendered with the model's own chat template every turn; the target's and
draft's KV caches keep the shared prefix, so a new turn only decodes what is new.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
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
from localspec.files import TEXT_LIMIT, Foreign, StateDir, mib
from localspec.loading import Loaded
from localspec.decoding.profiles import Profiles
from localspec.cli.report import describe_speculation, format_stats
from localspec.cli import resources

log = logging.getLogger(__name__)

PROMPT = ">>> "
CONTINUATION = "... "
HELP = """\
/help    this list
/stats   statistics of the last reply and totals for the session
/reset   forget the conversation (the system message stays)
/save NAME  keep the conversation (and its KV state in the prompt cache): localspec chat --resume NAME
/exit    leave (also /quit, Ctrl-D)
Ctrl-C   stop the reply being written (it stays in the history, marked as interrupted);
         press it twice at the prompt to leave
End a line with \\ to continue the message on the next line; start it with // to send a leading /."""


# ---------------------------------------------------------------- session state


def describe_session(replies: list[Any], speculative: bool) -> str:
    """Totals over every reply of the session."""
    from localspec.decoding.engine import combine

    t = combine(replies)
    line = (f"session: {len(replies)} replies, {t.generated_tokens} tokens in {t.elapsed_seconds:.2f} s "
            f"({t.tokens_per_second:.1f} tok/s); prompts {t.prompt_tokens} tokens in {t.prompt_seconds:.2f} s")
    if speculative and t.target_passes:
        line += (f"\nsession block efficiency {t.block_efficiency:.2f} tokens/target pass, acceptance "
                 f"{t.acceptance_rate:.1%} ({t.accepted_tokens}/{t.drafted_tokens} drafted)")
    return line


@dataclass
class Session:
    """The conversation, what the commands report on, and the cost profiles the session's
    replies refine (saved after each reply)."""

    system: str | None
    history: list[dict] = field(default_factory=list)
    replies: list[Any] = field(default_factory=list)  # GenerationStats of every reply, in order
    profiles: Profiles = field(default_factory=Profiles)
    prompt_cache: Any = None  # the PromptCache replies restore prefixes from and save them to (None: off)

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
                 write: Callable[[str], None], profiles: Profiles, prompt_cache: Any = None) -> Reply:
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
    return Reply("".join(parts), last.finish_reason if last else None, last.stats if last else None, interrupted,
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


def _note(text: str) -> None:
    click.echo(text, err=True)


def _show_stats(session: Session, loaded: Loaded, config: GenerationConfig) -> None:
    if session.last_stats is None:
        _note("no reply yet")
        return
    drafts = not config.is_target_alone(loaded.draft is not None)
    one = session.profiles.one_token_seconds(loaded.target) if drafts else 0.0
    _note("last reply: " + format_stats(session.last_stats, drafts, one))
    _note(describe_session(session.replies, drafts))


def _command(line: str, session: Session, loaded: Loaded, config: GenerationConfig) -> bool:
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
        _show_stats(session, loaded, config)
    elif name == "/save":
        _save(line.split()[1:], session, loaded)
    else:
        _note(f"unknown command {name}; /help lists the commands (start a message with // to send a leading /)")
    return True


# ---------------------------------------------------------------- saved chats

CHAT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")


def chats_dir() -> Path:
    """Where /save keeps conversations: <cache root>/chats (private: they hold the user's messages)."""
    from localspec.llama import registry

    return registry.cache_root() / "chats"


def _store(create: bool) -> StateDir:
    """The chat store, opened: ConfigError when it is refused (a link, another user's, open to
    others), FileNotFoundError when absent and not `create`."""
    return StateDir.open(chats_dir(), what="the chat store", create=create, private=True)


def chat_path(name: str, param: str = "name") -> Path:
    if not CHAT_NAME.fullmatch(name):
        raise ConfigError(f"{name!r} is not a chat name: use up to 64 letters, digits, '_', '-' or '.'", param)
    return chats_dir() / f"{name}.json"


def _save(args: list[str], session: Session, loaded: Loaded) -> None:
    """/save NAME: the messages as JSON, and the KV state of the conversation in the prompt cache."""
    if len(args) != 1:
        _note("usage: /save NAME (then: localspec chat --resume NAME)")
        return
    try:
        path = chat_path(args[0])
    except ConfigError as exc:
        _note(str(exc))
        return
    data = json.dumps({"version": 1, "model": str(loaded.target.path), "system": session.system,
                       "history": session.history}, ensure_ascii=False, indent=1)
    try:
        with _store(create=True) as store:  # written whole, 0600, in a 0700 directory of localspec's own
            store.write(path.name, data.encode("utf-8"))
    except ConfigError as exc:
        _note(f"could not save the chat: {exc}")
        return
    except Foreign as exc:
        _note(f"could not save the chat: {path} is {exc}, not a chat localspec saved; it was left as it is")
        return
    except OSError as exc:
        _note(f"could not save the chat to {path}: {exc.strerror or exc}")
        return
    seq = loaded.target.sequence
    kept = session.prompt_cache.save(loaded.target, seq.tokens[: seq.n_cached]) if session.prompt_cache else None
    cached = session.prompt_cache is not None and seq.n_cached >= session.prompt_cache.min_tokens
    state = "its KV state is in the prompt cache" if kept or cached else \
        "no KV state saved (the prompt cache is off or the conversation is short)"
    _note(f"saved chat {args[0]} ({len(session.history)} messages) to {path}; {state}")


def load_chat(name: str) -> dict:
    """A conversation /save kept (ConfigError naming --resume when it is missing or unreadable)."""
    path = chat_path(name, "resume")
    try:
        with _store(create=False) as store:
            try:
                data = json.loads(store.read(path.name, TEXT_LIMIT).decode("utf-8"))
            except FileNotFoundError:
                saved = [n[:-5] for n in store.names() if n.endswith(".json") and not n.startswith(".")]
                raise ConfigError(f"no saved chat {name!r} (saved: {', '.join(saved) or 'none'}); /save NAME in a "
                                  "chat keeps one", "resume") from None
        history = data["history"]
        if not isinstance(history, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                    and isinstance(m.get("content"), str) for m in history):
            raise ValueError("its history is not a list of messages")
    except FileNotFoundError:
        raise ConfigError(f"no saved chat {name!r} (saved: none); /save NAME in a chat keeps one", "resume") from None
    except Foreign as exc:
        raise ConfigError(f"cannot read the saved chat {path}: it is {exc}, not a chat localspec saved",
                          "resume") from None
    except ConfigError as exc:
        raise ConfigError(str(exc), "resume") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ConfigError(f"cannot read the saved chat {path}: {exc}", "resume") from None
    return {"system": data.get("system") if isinstance(data.get("system"), str) else None, "history": history}


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
        if reply.stats is not None and reply.stats.generated_tokens < config.max_tokens:
            _note(_context_note(loaded))
        else:
            _note(f"[reply cut at --max-tokens {config.max_tokens}]")
    if config.constraint is not None and reply.constraint_satisfied is False:
        _note(f"[the reply is incomplete: it does not match {config.constraint.describe()}]")


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
            _note(str(exc))
            continue
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
            if not _command(text, session, loaded, config):
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
            _note(f"resumed {resume}: {len(session.history)} messages")
        config = _validate(loaded, config, system, session.profiles)
        if _interactive():
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  line editing and history for input()
        _note(_banner(loaded, config))
        with ctrl_c_raises():
            chat_loop(session, loaded, config)
    finally:
        res.release(loaded)

