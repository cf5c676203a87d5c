"""The root command's behaviour: it generates.

``localspec "prompt"`` equals ``localspec generate "prompt"``: :class:`DefaultGroup` sends a
first argument that is not a subcommand to ``generate``.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Iterator

import click

from localspec.llama import rpc
from localspec.cli.options import (
    constraint_options,
    keep_alive_option,
    prompt_cache_option,
    generation_config,
    model_options,
    sampling_options,
    spec_options,
    tool_options,
    toolset_from_flags,
    user_errors,
)
from localspec.config import GenerationConfig
from localspec.errors import EXIT_INTERRUPTED, EXIT_TERMINATED
from localspec.loading import Loaded
from localspec.cli.report import format_stats, response_json, timings_json
from localspec.cli import resources

if TYPE_CHECKING:
    from localspec.api import Generation


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, service managers) while generating: handled as Ctrl-C is, so the text
    generated so far (with --json, the JSON object) still comes out."""


@contextlib.contextmanager
def sigterm_stops_generation() -> Iterator[None]:
    """Within the block, SIGTERM raises Terminated in the main thread (elsewhere: unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class DefaultGroup(click.Group):
    """A group whose first argument, when it is not a subcommand, goes to ``generate``."""

    default_command = "generate"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        n_root = 0  # leading root options (-v, -vv, --verbose) stay with the group
        while n_root < len(args) and (args[n_root] == "--verbose" or
                                      (args[n_root].startswith("-v") and set(args[n_root][1:]) == {"v"})):
            n_root += 1
        root, rest = args[:n_root], args[n_root:]
        if rest and rest[0] not in self.commands and rest[0] not in ("--help", "-h", "--version"):
            args = [*root, self.default_command, *rest]
        elif not rest and not sys.stdin.isatty():
            args = [*root, self.default_command]  # `echo prompt | localspec`
        return super().parse_args(ctx, args)


def _utf8_problem(data: bytes, where: str) -> click.UsageError:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return click.UsageError(f"{where} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                                "localspec reads prompts as UTF-8 text")
    raise AssertionError("valid UTF-8")  # pragma: no cover


def _argument_text(prompt: tuple[str, ...]) -> str:
    text = " ".join(prompt)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes in argv arrive as surrogate escapes
        raise _utf8_problem(text.encode("utf-8", "surrogateescape"), "the prompt argument") from None
    return text


def _stdin_text() -> str:
    """The prompt piped on stdin, at most TEXT_LIMIT bytes (`localspec < /dev/zero` ends there)."""
    from localspec.files import TEXT_LIMIT, read_stream

    stream = getattr(sys.stdin, "buffer", None) or io.BytesIO(sys.stdin.read(TEXT_LIMIT + 1).encode())
    data = read_stream(stream, limit=TEXT_LIMIT, what="the prompt on stdin")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _utf8_problem(data, "the prompt on stdin") from None


def read_context(path: str | None) -> str:
    """The text of --context FILE (UTF-8), or "" without one."""
    from localspec.files import TEXT_LIMIT, read_user_text  # bounded while reading: a device or FIFO too

    return "" if path is None else read_user_text(path, param="context", limit=TEXT_LIMIT, what="the context file")


def with_context(context: str, text: str) -> str:
    """The prompt with a --context document first: prompts about one document share it as a
    prefix, which the prompt cache restores instead of prefilling it again."""
    return f"{context.rstrip()}\n\n{text}" if context.strip() else text


def read_prompt(prompt: tuple[str, ...]) -> str:
    """The prompt argument, followed by piped stdin when there is any (`cat notes | localspec "Summarise:"`)."""
    text = _argument_text(prompt)
    piped = "" if sys.stdin.isatty() else _stdin_text()
    if text and piped.strip():
        return f"{text}\n\n{piped}"
    if text:
        return text
    if sys.stdin.isatty():
        raise click.UsageError("give a prompt as an argument or on stdin, e.g. localspec \"def fib(n):\"")
    if not piped.strip():
        raise click.UsageError("the prompt on stdin is empty")
    return piped


@click.command()
@click.argument("prompt", nargs=-1)
@model_options
@spec_options
@sampling_options
@click.option("--chat/--raw", "chat_template", default=True, show_default=True,
              help="Wrap the prompt in the model's chat template (when it has one).")
@click.option("-s", "--system", default=None, help="System message (with --chat).")
@click.option("--stop", multiple=True, help="Stop at this string (repeatable).")
@click.option("--context", "context_file", default=None, metavar="FILE",
              help="A document to put before the prompt (UTF-8, at most 32 MiB): questions about one file "
                   "then share it as a prefix, which the prompt cache restores instead of reading it again.")
@constraint_options
@tool_options
@prompt_cache_option
@keep_alive_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and stats.")
@click.option("-u", "--usage", is_flag=True, help="Print statistics to stderr when done.")
@user_errors
def generate(prompt: tuple[str, ...], model: str | None, draft: str | None, chat_template: bool,
             system: str | None, context_file: str | None, as_json: bool, usage: bool, **options: Any) -> None:
    """Generate text from PROMPT (or stdin), streaming it to stdout.

    \b
    localspec "def quicksort(xs):"
    echo "Explain speculative decoding" | localspec -u
    localspec -m target.gguf -d draft.gguf --verifier traversal --tree 3x2x1 "..."
    localspec --drafter ngram -d none --raw -n 100 "$(cat file.py) # refactor:"
    localspec --context report.md "What are the three main risks?"
    localspec --tools tools.json "What is the weather in Paris?"
    """
    from localspec.api import Generation

    res = resources.current()
    res.keep_alive(options.pop("keep_alive", None))
    cache = res.prompt_cache(options.pop("prompt_cache", None))
    tools = toolset_from_flags(options)
    config = generation_config(options)
    if system is not None and not chat_template:
        raise click.BadParameter("a system message needs the chat template: drop --raw, or put the text "
                                 "in the prompt", param_hint="--system")
    if tools is not None and not chat_template:
        raise click.BadParameter("tools are rendered by the chat template: drop --raw", param_hint="--tools")
    context = read_context(context_file)
    text = with_context(context, read_prompt(prompt))
    try:
        with sigterm_stops_generation():
            loaded = res.load_for(config, model, draft, options, grammar=tools is not None and tools.calls_allowed)
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM while loading: nothing generated, said so
        _stopped_before_output(stop, as_json, model or "", config, prompt_tokens=0, resident=res.resident)
    try:
        if system is not None and not loaded.target.chat_template:
            raise click.BadParameter(f"{loaded.target_name} has no chat template, so a system message cannot "
                                     "be given; put the text in the prompt", param_hint="--system")
        message: Any = text
        if chat_template and (loaded.target.chat_template or tools is not None):
            message = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        generation = Generation(loaded.target, loaded.draft, message, config, res.profiles,
                                prompt_cache=cache or False, tools=tools)
        parts: list[str] = []
        unregister = rpc.on_fatal(lambda error: _remote_failed(parts, as_json, loaded, config, error))
        try:
            with sigterm_stops_generation():
                last, interrupted = _stream(generation, as_json, parts)
        finally:
            unregister()
        _report(parts, last, as_json, usage, loaded, generation, res)  # also after Ctrl-C: nothing lost
    finally:
        res.release(loaded)
    if interrupted is not None:
        sys.exit(EXIT_TERMINATED if isinstance(interrupted, Terminated) else EXIT_INTERRUPTED)


def _empty_json(model: str, config: GenerationConfig, prompt_tokens: int, resident: bool) -> dict:
    """The --json object of a run stopped before it generated anything."""
    return {"model": model, "text": "", "finish_reason": None, "settings": config.options(),
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0}, "stats": {}, "timings": {},
            "resident": resident}


def _stopped_before_output(stop: KeyboardInterrupt, as_json: bool, model: str, config: GenerationConfig,
                           prompt_tokens: int, resident: bool) -> None:
    """Ctrl-C or SIGTERM before any output: say so (with --json, the empty JSON object) and exit
    with the signal's status, as a stop while generating does."""
    terminated = isinstance(stop, Terminated)
    click.echo("terminated" if terminated else "interrupted", err=True)
    if as_json:
        click.echo(json.dumps(_empty_json(model, config, prompt_tokens, resident)))
    sys.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)


def _remote_failed(parts: list[str], as_json: bool, loaded: Loaded, config: GenerationConfig, error: str) -> None:
    """A remote device failed mid-generation: what was generated is kept (printed) before the exit."""
    if as_json:
        click.echo(json.dumps({"model": loaded.target_name, "text": "".join(parts), "finish_reason": "error",
                               "error": error, "settings": config.options()}))
    elif parts:
        click.echo("")


def _stream(generation: Any, as_json: bool, parts: list[str]) -> tuple[Any, KeyboardInterrupt | None]:
    """Run the generation into `parts`, echoing text unless JSON is wanted; Ctrl-C (or SIGTERM:
    Terminated) stops it with what it has, and is returned."""
    last = None
    stream = iter(generation)
    try:
        for r in stream:
            last = r
            parts.append(r.content)
            if not as_json and r.content:
                click.echo(r.content, nl=False)
                sys.stdout.flush()
    except KeyboardInterrupt as stop:
        click.echo("\nterminated" if isinstance(stop, Terminated) else "\ninterrupted", err=True)
        return last, stop
    finally:
        stream.close()
    return last, None


def _report(parts: list[str], last: Any, as_json: bool, usage: bool, loaded: Loaded, generation: Generation,
            res: resources.Resources) -> None:
    """After generation: the final newline or the JSON object on stdout, the statistics on stderr."""
    config, profiles = generation.config, generation.profiles
    calls = [c.as_dict() for c in last.tool_calls] if last is not None else []
    if not as_json and "".join(parts):
        click.echo("")
    if not as_json and calls:
        click.echo(json.dumps(calls, ensure_ascii=False, indent=2))
    if last is None:  # stopped before the first token (in the prefill): the JSON object all the same
        if as_json:
            click.echo(json.dumps(_empty_json(loaded.target_name, config, len(generation.prompt), res.resident)))
        return
    if as_json:
        timings = timings_json(res.entered, loaded, last.stats, profiles.io_seconds,
                               (generation.restore_seconds, generation.save_seconds)) | res.timings()
        click.echo(json.dumps(response_json("".join(parts), last.finish_reason, last.stats, loaded.target_name,
                                            config, timings, last.constraint_satisfied,
                                            calls if generation.tools else None) | {"resident": res.resident}))
    if last.finish_reason == "length" and generation.call_cut_off:
        done = "" if not calls else " (the one it completed is)" if len(calls) == 1 else \
            f" (the {len(calls)} it completed are)"
        click.echo("warning: the answer was cut off by the length limit; a tool call it was writing is not "
                   f"reported{done}; raise --max-tokens", err=True)
    elif config.constraint is not None and last.finish_reason not in ("stop", "tool_calls") \
            and not last.constraint_satisfied:
        click.echo(f"warning: the output is truncated ({last.finish_reason}): it does not match "
                   f"{config.constraint.describe()} yet; raise --max-tokens", err=True)
    if usage:
        drafts = not config.is_target_alone(loaded.draft is not None)
        one = profiles.one_token_seconds(loaded.target) if drafts else 0.0
        click.echo(format_stats(last.stats, drafts, one), err=True)
