"""``localspec chat``'s slash commands (/help, /stats, /reset, /save, /drafts) and the session
they act on."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import click

from localspec.cli.chat_store import chat_path, write_chat
from localspec.cli.report import format_stats
from localspec.core.calls import CallKind, Done, Failed, Note, Prompt
from localspec.errors import ConfigError
from localspec.settings.files import Foreign
from localspec.settings.generation import GenerationConfig

HELP = """\
/help    this list
/stats   statistics of the last reply and totals for the session
/reset   forget the conversation (the system message stays)
/save NAME  keep the conversation (and its KV state in the prompt cache): localspec chat --resume NAME
/drafts  show the text of accepted drafts in another colour, where speculation paid (again: off)
/exit    leave (also /quit, Ctrl-D)
Ctrl-C   stop the reply being written (it stays in the history, marked as interrupted);
         press it twice at the prompt to leave
End a line with \\ to continue the message on the next line; start it with // to send a leading /."""


def describe_session(replies: list[Any], speculative: bool) -> str:
    """Totals over every reply of the session."""
    from localspec.decoding.stats import combine

    t = combine(replies)
    line = (f"session: {len(replies)} replies, {t.generated_tokens} tokens in {t.elapsed_seconds:.2f} s "
            f"({t.tokens_per_second:.1f} tok/s); prompts {t.prompt_tokens} tokens in {t.prompt_seconds:.2f} s")
    if speculative and t.target_passes:
        line += (f"\nsession block efficiency {t.block_efficiency:.2f} tokens/target pass, acceptance "
                 f"{t.acceptance_rate:.1%} ({t.accepted_tokens}/{t.drafted_tokens} drafted)")
    return line


@dataclass
class Session:
    """The conversation, what the commands report on, and how its calls are made (the pair, the
    settings, the prompt cache, where they run: ``caller``)."""

    system: str | None
    config: GenerationConfig = field(default_factory=GenerationConfig)
    caller: Any = None  # localspec.cli.resolve.Caller
    pair: Any = None  # localspec.core.pairs.PairSpec
    cache: tuple[str | None, int] = (None, 0)  # the prompt cache (None: off) and its size on disk
    keep_alive: float = 0.0
    show_drafts: bool = False  # accepted drafts' text in another colour (/drafts)
    history: list[dict] = field(default_factory=list)
    replies: list[Any] = field(default_factory=list)  # GenerationStats of every reply, in order
    ready: Any = None  # the pair as the first call described it (localspec.core.calls.Ready)
    last: Done | None = None  # the last reply's end

    @property
    def last_stats(self) -> Any:
        return self.replies[-1] if self.replies else None

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def call(self, kind: CallKind, prompt: Prompt, config: GenerationConfig | None = None) -> Any:
        """One call of the chat (the first: "open"; a reply: "generate"; /save: "keep")."""
        from localspec.cli import resolve

        request = resolve.request(kind, self.pair, config or self.config, prompt, self.cache, self.keep_alive)
        return self.caller.call(request)


def note(text: str) -> None:
    click.echo(text, err=True)


def _show_stats(session: Session) -> None:
    if session.last_stats is None or session.last is None:
        note("no reply yet")
        return
    speculative = session.last.speculative
    note("last reply: " + format_stats(session.last_stats, speculative, session.last.one_token_seconds))
    note(describe_session(session.replies, speculative))


def run_command(line: str, session: Session) -> bool:
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
        _show_stats(session)
    elif name == "/save":
        _save(line.split()[1:], session)
    elif name == "/drafts":
        _toggle_drafts(session)
    else:
        note(f"unknown command {name}; /help lists the commands (start a message with // to send a leading /)")
    return True


def _toggle_drafts(session: Session) -> None:
    from localspec.cli.render import DRAFTED_COLOUR, colours

    if session.show_drafts:
        session.show_drafts = False
        note("accepted drafts are no longer coloured")
    elif colours(True):
        session.show_drafts = True
        note(f"the text of accepted drafts is now {DRAFTED_COLOUR}: where speculation paid")
    else:
        note("the replies are not on a terminal: no colours (/drafts works in a terminal)")


def _save(args: list[str], session: Session) -> None:
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
        write_chat(path, session.pair.target.path, session.system, session.history)
    except ConfigError as exc:
        note(f"could not save the chat: {exc}")
        return
    except Foreign as exc:
        note(f"could not save the chat: {path} is {exc}, not a chat localspec saved; it was left as it is")
        return
    except OSError as exc:
        note(f"could not save the chat to {path}: {exc.strerror or exc}")
        return
    kept = _keep_state(session) if session.history else False
    state = "its KV state is in the prompt cache" if kept else \
        "no KV state saved (the prompt cache is off or the conversation is short)"
    note(f"saved chat {args[0]} ({len(session.history)} messages) to {path}; {state}")


def _keep_state(session: Session) -> bool:
    """The conversation's KV state into the prompt cache (a call of its own); whether it is there."""
    if session.cache[0] is None:
        return False
    call = session.call("keep", Prompt(messages=list(session.history)), replace(session.config, max_tokens=1))
    kept = False
    for event in call.events():
        if isinstance(event, Note):
            note(event.text)
        elif isinstance(event, Failed):
            note(f"could not keep the KV state: {event.message}")
        elif isinstance(event, Done):
            kept = event.kept
    return kept
