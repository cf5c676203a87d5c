"""The root command's behaviour: it generates.

``localspec "prompt"`` equals ``localspec generate "prompt"``: :class:`DefaultGroup` sends a
first argument that is not a subcommand to ``generate``. The command resolves the call here
(settings, pair, prompt: :mod:`localspec.cli.resolve`), runs it in the resident service or in
this process, and prints its events (:mod:`localspec.cli.render`).
"""

from __future__ import annotations

import io
import json
import sys
import time
from typing import Any

import click

from localspec.cli import render, resolve
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
    tool_options,
    user_errors,
)
from localspec.cli.report import empty_json, format_stats, response_json
from localspec.core.calls import Done, Failed, Note, Prompt, Text
from localspec.errors import ConfigError
from localspec.loading import draft_loading
from localspec.settings.generation import DEFAULTS, GenerationConfig


class DefaultGroup(click.Group):
    """A group whose first argument, when it is not a subcommand, goes to ``generate``; its other
    commands are imported when they run (:attr:`lazy`), so that a generating call imports only
    what it uses."""

    default_command = "generate"
    lazy: dict[str, str] = {}  # command name -> "module:attribute"

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in self.lazy:
            import importlib

            module, attribute = self.lazy[name].split(":")
            command = getattr(importlib.import_module(module), attribute)
            self.add_command(command, name)
            self.on_load(command)
        return self.commands.get(name)

    def on_load(self, command: click.Command) -> None:
        """What every command gets when it is added (set by the package: its error handling)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        n_root = 0  # leading root options (-v, -vv, --verbose) stay with the group
        while n_root < len(args) and (args[n_root] == "--verbose" or
                                      (args[n_root].startswith("-v") and set(args[n_root][1:]) == {"v"})):
            n_root += 1
        root, rest = args[:n_root], args[n_root:]
        if rest and rest[0] not in self.list_commands(ctx) and rest[0] not in ("--help", "-h", "--version"):
            args = [*root, self.default_command, *rest]
        elif not rest and not sys.stdin.isatty():
            args = [*root, self.default_command]  # `echo prompt | localspec`
        return super().parse_args(ctx, args)


# ---------------------------------------------------------------- the prompt


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
    from localspec.settings.files import TEXT_LIMIT, read_stream

    stream = getattr(sys.stdin, "buffer", None) or io.BytesIO(sys.stdin.read(TEXT_LIMIT + 1).encode())
    data = read_stream(stream, limit=TEXT_LIMIT, what="the prompt on stdin")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _utf8_problem(data, "the prompt on stdin") from None


def read_context(path: str | None) -> str:
    """The text of --context FILE (UTF-8), or "" without one."""
    from localspec.settings.files import TEXT_LIMIT, read_user_text  # bounded while reading: a device or FIFO too

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


# ---------------------------------------------------------------- the command


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
@click.option("--show-drafts", is_flag=True,
              help="On a terminal, print the text that came from accepted drafts in another colour: where "
                   "speculation paid.")
@user_errors
def generate(prompt: tuple[str, ...], model: str | None, draft: str | None, chat_template: bool,
             system: str | None, context_file: str | None, as_json: bool, usage: bool, show_drafts: bool,
             **_: Any) -> None:
    """Generate text from PROMPT (or stdin), streaming it to stdout.

    \b
    localspec "def quicksort(xs):"
    echo "Explain speculative decoding" | localspec -u
    localspec -m target.gguf -d draft.gguf --verifier traversal --tree 3x2x1 "..."
    localspec --drafter ngram -d none --raw -n 100 "$(cat file.py) # refactor:"
    localspec --context report.md "What are the three main risks?"
    localspec --tools tools.json "What is the weather in Paris?"
    localspec --show-drafts --drafter ngram "$(cat app.py) Add type hints:"
    """
    started = time.time()
    config = DEFAULTS
    flags = Flags.current()
    with render.stop_signals(), render.load_bars() as bars:  # a load in this process: its bar on a terminal
        try:
            keep_alive = flags["keep_alive"]
            cache = resolve.prompt_cache(flags["prompt_cache"])
            tools, tools_file = resolve.tools_from_flags(flags)
            config = generation_config(flags)
            if system is not None and not chat_template:
                raise ConfigError("a system message needs the chat template: drop --raw, or put the text in the "
                                  "prompt", "system")
            if tools is not None and not chat_template:
                raise ConfigError("tools are rendered by the chat template: drop --raw", "tools")
            loading = flags.load()
            text = with_context(read_context(context_file), read_prompt(prompt))
            pair = resolve.resolve_pair(model, draft, loading, need_draft=draft_loading(config.drafter, False)[0],
                                      before_fetch=lambda: compile_constraint_now(config))
            request = resolve.request("generate", pair, config, Prompt(text=text, chat=chat_template, system=system),
                                    cache, keep_alive, tools)
            call = resolve.Caller(keep_alive).call(request)
        except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM while reading stdin, fetching, starting: said so
            _stopped_before_output(stop, as_json, model or "", config, prompt_tokens=0, resident=False)
        code = _print_events(call, config, pair.target_name, as_json=as_json, usage=usage,
                       colour=render.colours(show_drafts) and not as_json, started=started, tools_file=tools_file,
                       keep_alive=keep_alive, bars=bars)
    if code:
        sys.exit(code)


def _stopped_before_output(stop: BaseException | str | None, as_json: bool, model: str, config: GenerationConfig,
                           prompt_tokens: int, resident: bool) -> None:
    """Ctrl-C or SIGTERM before any output: say so (with --json, the empty JSON object) and exit
    with the signal's status, as a stop while generating does."""
    click.echo(render.stop_word(stop), err=True)
    if as_json:
        click.echo(json.dumps(empty_json(model, config, prompt_tokens, resident)))
    sys.exit(render.exit_status(stop))


def _print_events(call: Any, config: GenerationConfig, model: str, *, as_json: bool, usage: bool, colour: bool,
            started: float, tools_file: str | None, keep_alive: float, bars: render.LoadBars) -> int:
    """Print the call's events as they come, then its report; the exit status (`bars`: the load's
    progress, cleared when the text begins)."""
    from localspec.resident.client import ServiceLost

    parts: list[str] = []
    done: Done | None = None
    unregister = _on_remote_failure(call, parts, as_json, config, model)
    try:
        with render.stopping(call, lambda: bool(parts)):
            for event in call.events():
                if isinstance(event, Note):
                    bars.note(event.text)
                elif isinstance(event, Text):
                    bars.stop()
                    parts.append(event.text)
                    if not as_json:
                        render.write_text(event.text, event.drafted, colour)
                elif isinstance(event, Failed):
                    raise resolve.error_of(event, tools_file, config)
                elif isinstance(event, Done):
                    done = event
    except ServiceLost:
        bars.stop()
        return render.service_lost()
    except KeyboardInterrupt as stop:  # before any output, or a second Ctrl-C: leave now
        bars.stop()
        code = render.exit_status(stop)
        click.echo(("\n" if parts else "") + render.stop_word(stop), err=True)
        if as_json:
            click.echo(json.dumps(empty_json(model, config, 0, call.resident) | {"text": "".join(parts)}))
        call.abandon(code)
        return code
    finally:
        unregister()
        bars.stop()
    if done is None:
        return render.service_lost()
    if done.error is not None:
        if parts and not as_json:
            click.echo("")
        raise resolve.error_of(done.error, tools_file, config)
    if done.stopped is not None:
        click.echo("\n" + render.stop_word(done.stopped), err=True)
    _report("".join(parts), done, as_json, usage, started, call.resident)
    if call.resident and done.timings.get("target_load"):
        render.stays_loaded(done.model, keep_alive)
    return render.exit_status(done.stopped) if done.stopped is not None else 0


def _on_remote_failure(call: Any, parts: list[str], as_json: bool, config: GenerationConfig, model: str) -> Any:
    """In this process with RPC servers: a remote device that fails mid-generation ends the
    process (llama.cpp aborts); what was generated is printed first."""
    if call.resident:
        return lambda: None
    from localspec.llama import rpc

    def failed(error: str) -> None:
        if as_json:
            click.echo(json.dumps({"model": model, "text": "".join(parts), "finish_reason": "error", "error": error,
                                   "settings": config.options()}))
        elif parts:
            click.echo("")

    return rpc.on_fatal(failed)


def _report(text: str, done: Done, as_json: bool, usage: bool, started: float, resident: bool) -> None:
    """After generation: the final newline or the JSON object on stdout, the statistics on stderr."""
    config = GenerationConfig.from_options(**done.settings)
    calls_made = done.tool_calls or []
    if not as_json and text:
        click.echo("")
    if not as_json and calls_made:
        click.echo(json.dumps(calls_made, ensure_ascii=False, indent=2))
    if done.stats is None:  # stopped before the first token (waiting, loading, in the prefill)
        if as_json:
            click.echo(json.dumps(empty_json(done.model, config, done.prompt_tokens, resident)))
        return
    if as_json:
        timings = {"command_started": started, **done.timings}
        click.echo(json.dumps(response_json(text, done.finish_reason, done.stats, done.model, config, timings,
                                            done.constraint_satisfied, done.tool_calls) | {"resident": resident}))
    if done.finish_reason == "length" and done.call_cut_off:
        n = len(calls_made)
        completed = "" if not n else " (the one it completed is)" if n == 1 else f" (the {n} it completed are)"
        click.echo("warning: the answer was cut off by the length limit; a tool call it was writing is not "
                   f"reported{completed}; raise --max-tokens", err=True)
    elif config.constraint is not None and done.finish_reason not in ("stop", "tool_calls") \
            and not done.constraint_satisfied:
        click.echo(f"warning: the output is truncated ({done.finish_reason}): it does not match "
                   f"{config.constraint.describe()} yet; raise --max-tokens", err=True)
    if usage:
        click.echo(format_stats(done.stats, done.speculative, done.one_token_seconds), err=True)
