"""``localspec chat``'s slash commands (/help, /stats, /reset, /save) and the session they act on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import click

from localspec.cli.chat_store import chat_path, write_chat
from localspec.cli.report import format_stats
from localspec.config import GenerationConfig
from localspec.decoding.profiles import Profiles
from localspec.errors import ConfigError
from localspec.files import Foreign
from localspec.loading import Loaded

HELP = """\
/help    this list
/stats   statistics of the last reply and totals for the session
/reset   forget the conversation (the system message stays)
/save NAME  keep the conversation (and its KV state in the prompt cache): localspec chat --resume NAME
/exit    leave (also /quit, Ctrl-D)
Ctrl-C   stop the reply being written (it stays in the history, marked as interrupted);
         press it twice at the prompt to leave
End a line with \\ to continue the message on the next line; start it with // to send a leading /."""


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


def note(text: str) -> None:
    click.echo(text, err=True)


def _show_stats(session: Session, loaded: Loaded, config: GenerationConfig) -> None:
    if session.last_stats is None:
        note("no reply yet")
        return
    drafts = not config.is_target_alone(loaded.draft is not None)
    one = session.profiles.one_token_seconds(loaded.target) if drafts else 0.0
    note("last reply: " + format_stats(session.last_stats, drafts, one))
    note(describe_session(session.replies, drafts))


def run_command(line: str, session: Session, loaded: Loaded, config: GenerationConfig) -> bool:
    """Run a /command; False when the user wants to leave."""
    name = line.split()[0].lower()
    if name in ("/exit", "/quit"):
        return False
    if name == "/help":
        note(HELP)
    elif name == "/reset":
        session.reset()
        note("conversation cleared" + (" (system message kept)" if session.system else ""))
    elif name == "/stats":
        _show_stats(session, loaded, config)
    elif name == "/save":
        _save(line.split()[1:], session, loaded)
    else:
        note(f"unknown command {name}; /help lists the commands (start a message with // to send a leading /)")
    return True


def _save(args: list[str], session: Session, loaded: Loaded) -> None:
    """/save NAME: the messages as JSON, and the KV state of the conversation in the prompt cache."""
    if len(args) != 1:
        note("usage: /save NAME (then: localspec chat --resume NAME)")
        return
    try:
        path = chat_path(args[0])
    except ConfigError as exc:
        note(str(exc))
        return
    try:
        write_chat(path, str(loaded.target.path), session.system, session.history)
    except ConfigError as exc:
        note(f"could not save the chat: {exc}")
        return
    except Foreign as exc:
        note(f"could not save the chat: {path} is {exc}, not a chat localspec saved; it was left as it is")
        return
    except OSError as exc:
        note(f"could not save the chat to {path}: {exc.strerror or exc}")
        return
    seq = loaded.target.sequence
    kept = session.prompt_cache.save(loaded.target, seq.tokens[: seq.n_cached]) if session.prompt_cache else None
    cached = session.prompt_cache is not None and seq.n_cached >= session.prompt_cache.min_tokens
    state = "its KV state is in the prompt cache" if kept or cached else \
        "no KV state saved (the prompt cache is off or the conversation is short)"
    note(f"saved chat {args[0]} ({len(session.history)} messages) to {path}; {state}")
