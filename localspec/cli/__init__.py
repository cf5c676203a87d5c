"""The ``localspec`` command line.

The root command generates: ``localspec "prompt"`` equals ``localspec generate "prompt"``.
Subcommands live in the other modules of ``localspec/cli/`` and share the option groups defined here. Defaults
and ranges come from :mod:`localspec.config` (one place for each); localspec's errors become
messages and exit codes in one place, :data:`localspec.errors.EXIT_CODES`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

import click

from localspec import __version__, rpc
from localspec.config import (
    CACHE_TYPES,
    CPU_KERNELS,
    DEFAULT_SAMPLING,
    DEFAULTS,
    DRAFTERS,
    LOAD_MODES,
    MODEL_DEFAULTS,
    PLANS,
    SETTING_KEYS,
    VERIFIERS,
    GenerationConfig,
)
from localspec.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, LocalspecError, exit_code
from localspec.loading import Loaded, draft_loading, load_pair
from localspec.report import format_stats, response_json, timings_json

log = logging.getLogger(__name__)

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


# ---------------------------------------------------------------- errors


class LocalspecClickError(click.ClickException):
    """A localspec error as click shows it, with its exit code."""

    def __init__(self, exc: LocalspecError) -> None:
        param = getattr(exc, "param", None)
        message = f"Invalid value for --{param.replace('_', '-')}: {exc}" if param else str(exc)
        super().__init__(message)
        self.exit_code = exit_code(exc)


def user_errors(f: Callable) -> Callable:
    """Turn localspec's own exceptions into messages and exit codes (no traceback)."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except LocalspecError as exc:
            raise LocalspecClickError(exc) from None

    return wrapper


# ---------------------------------------------------------------- shared options


def _options(f: Callable, options: list[Callable]) -> Callable:
    for option in reversed(options):
        f = option(f)
    return f


def model_options(f: Callable) -> Callable:
    """-m/-d and how to load them."""
    m = MODEL_DEFAULTS
    return _options(f, [
        click.option("-m", "--model", envvar="LOCALSPEC_MODEL", default=None, metavar="GGUF|NAME",
                     help="Target model: a GGUF path or a registry name (default: the default pair's "
                          "target; env LOCALSPEC_MODEL)."),
        click.option("-d", "--draft", envvar="LOCALSPEC_DRAFT", default=None, metavar="GGUF|NAME|none",
                     help="Draft model: a GGUF path, a registry name, or 'none' for no draft model (the "
                          "n-gram drafter still drafts from the context; -k 0 decodes with the target "
                          "alone). Default: the default pair's draft when -m is not given (env LOCALSPEC_DRAFT)."),
        click.option("--ctx-size", type=int, default=m.ctx_size, show_default=True, help="Context length in tokens."),
        click.option("--n-gpu-layers", type=int, default=m.n_gpu_layers, show_default=True,
                     help="Target layers to offload to the GPU (-1: all)."),
        click.option("--draft-n-gpu-layers", type=int, default=None,
                     help="Draft layers to offload to the GPU (default: as --n-gpu-layers)."),
        click.option("--threads", type=int, default=m.threads, help="CPU threads (default: all cores)."),
        click.option("--cache-type", type=click.Choice(CACHE_TYPES), default=m.cache_type, show_default=True,
                     envvar="LOCALSPEC_CACHE_TYPE",
                     help="KV cache type of both models; q8_0 halves its memory (env LOCALSPEC_CACHE_TYPE)."),
        click.option("--load-mode", type=click.Choice(LOAD_MODES), default=m.load_mode, show_default=True,
                     envvar="LOCALSPEC_LOAD_MODE",
                     help="read: copy the weights into memory (no second resident copy where llama.cpp "
                          "repacks them for its CPU kernels); mmap: map the file; auto: llama.cpp decides "
                          "(env LOCALSPEC_LOAD_MODE)."),
        click.option("--cpu-kernels", type=click.Choice(CPU_KERNELS), default=m.cpu_kernels, show_default=True,
                     envvar="LOCALSPEC_CPU_KERNELS",
                     help="Which of llama.cpp's CPU weight kernels to use. auto: the fastest that runs here, "
                          "never AMX (its kernels crash on some Xeons), each checked once per machine in a "
                          "child process; llama: llama.cpp's own choice, AMX included; repack: its repacked "
                          "kernels only; plain: none of these (env LOCALSPEC_CPU_KERNELS)."),
        click.option("--rpc", envvar="LOCALSPEC_RPC", default=None, metavar="HOST:PORT[,...]",
                     help="Put the target's layers on these llama.cpp RPC servers (`localspec rpc-server`; "
                          "all layers unless --n-gpu-layers says how many; several servers share them). "
                          "Needs llama-cpp-python built with -DGGML_RPC=on (env LOCALSPEC_RPC)."),
        click.option("--draft-rpc", default=None, metavar="HOST:PORT[,...]",
                     help="RPC servers for the draft model (default: the draft stays on this machine)."),
    ])


def spec_options(f: Callable) -> Callable:
    """How to draft and verify."""
    d = DEFAULTS
    return _options(f, [
        click.option("--verifier", type=click.Choice(VERIFIERS), default=d.verifier, show_default=True,
                     help="Verification rule: greedy, match (llama.cpp's), token, block, gbv (K paths), "
                          "batch (K paths), rrs/rrsw/traversal (trees)."),
        click.option("-k", "--num-draft-tokens", type=int, default=d.shape.depth, show_default=True,
                     help="Most tokens drafted per path and step (0: the target alone); --plan auto "
                          "chooses how many each step."),
        click.option("--paths", type=int, default=d.shape.paths, show_default=True,
                     help="Independent draft paths (for --verifier gbv or batch)."),
        click.option("--tree", "tree", default=None, metavar="BxBx..",
                     help="Draft tree: children per node at each depth, e.g. 3x2x1 "
                          "(for --verifier rrs, rrsw or traversal)."),
        click.option("--drafter", type=click.Choice(DRAFTERS), default=d.drafter, show_default=True,
                     help="auto: n-gram lookups of the context where they pay, the draft model only where "
                          "measured costs say it pays (loaded then); model: always the draft model; "
                          "ngram: lookups only (no draft model); hybrid: n-gram when the context repeats, "
                          "else the model."),
        click.option("--plan", type=click.Choice(PLANS), default=d.plan, show_default=True,
                     help="auto: choose each step's draft depth, or no speculation, from measured "
                          "step costs and acceptance; fixed: always draft the full shape."),
    ])


def sampling_options(f: Callable) -> Callable:
    s = DEFAULT_SAMPLING
    return _options(f, [
        click.option("-t", "--temperature", type=float, default=s.temperature, show_default=True,
                     help="Sampling temperature (0: greedy)."),
        click.option("--top-k", type=int, default=s.top_k, show_default=True, help="Top-k (0: off)."),
        click.option("--top-p", type=float, default=s.top_p, show_default=True, help="Top-p (1: off)."),
        click.option("--min-p", type=float, default=s.min_p, show_default=True, help="Min-p (0: off)."),
        click.option("--seed", type=int, default=None,
                     help="Random seed, 0 to 2**64-1 (default: random). Runs repeat exactly with --plan fixed; "
                          "--plan auto adapts the draft depth to measured timings, which changes the sample "
                          "drawn (not its distribution)."),
        click.option("-n", "--max-tokens", type=int, default=DEFAULTS.max_tokens, show_default=True,
                     help="Most tokens to generate."),
    ])


GENERATION_KEYS = SETTING_KEYS  # a command's options that are generation settings


def generation_config(options: dict) -> GenerationConfig:
    """The GenerationConfig of the command's options (the keys of GENERATION_KEYS it has)."""
    return GenerationConfig.from_options(**{k: v for k, v in options.items() if k in GENERATION_KEYS})


def load_for(config: GenerationConfig, model: str | None, draft: str | None, options: dict) -> Loaded:
    """The pair a generation config needs (localspec.api.draft_loading decides about the draft)."""
    need, lazy = draft_loading(config.drafter, draft_named=False)
    return load_pair(model, draft, need_draft=need, lazy_draft=lazy, **model_kwargs(options))


def model_kwargs(options: dict) -> dict:
    """The load_pair keywords among a command's options."""
    keys = ("ctx_size", "n_gpu_layers", "draft_n_gpu_layers", "threads", "cache_type", "load_mode", "cpu_kernels",
            "rpc", "draft_rpc")
    return {k: options[k] for k in keys if k in options}


# ---------------------------------------------------------------- root


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="localspec")
@click.option("-v", "--verbose", count=True, help="Log diagnostics to stderr (-vv: debug).")
def cli(verbose: int) -> None:
    """Fast, lossless speculative decoding on llama.cpp.

    \b
    localspec "Write a quicksort in Python"        # generate (default pair, fetched on first use)
    localspec chat                                 # talk to the model
    localspec serve                                # OpenAI-compatible server
    localspec bench                                # verifiers x draft shapes, side by side
    localspec check                                # see the losslessness checks pass
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")


# ---------------------------------------------------------------- generate


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
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _utf8_problem(data, "the prompt on stdin") from None


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


@cli.command()
@click.argument("prompt", nargs=-1)
@model_options
@spec_options
@sampling_options
@click.option("--chat/--raw", "chat_template", default=True, show_default=True,
              help="Wrap the prompt in the model's chat template (when it has one).")
@click.option("-s", "--system", default=None, help="System message (with --chat).")
@click.option("--stop", multiple=True, help="Stop at this string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and stats.")
@click.option("-u", "--usage", is_flag=True, help="Print statistics to stderr when done.")
@user_errors
def generate(prompt: tuple[str, ...], model: str | None, draft: str | None, chat_template: bool,
             system: str | None, as_json: bool, usage: bool, **options: Any) -> None:
    """Generate text from PROMPT (or stdin), streaming it to stdout.

    \b
    localspec "def quicksort(xs):"
    echo "Explain speculative decoding" | localspec -u
    localspec -m target.gguf -d draft.gguf --verifier traversal --tree 3x2x1 "..."
    localspec --drafter ngram -d none --raw -n 100 "$(cat file.py) # refactor:"
    """
    from localspec.api import Generation

    entered = time.time()
    config = generation_config(options)
    text = read_prompt(prompt)
    loaded = load_for(config, model, draft, options)
    try:
        message: Any = text
        if chat_template and loaded.target.chat_template:
            message = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        generation = Generation(loaded.target, loaded.draft, message, config)
        parts: list[str] = []
        unregister = rpc.on_fatal(lambda error: _remote_failed(parts, as_json, loaded, config, error))
        try:
            with sigterm_stops_generation():
                last, interrupted = _stream(generation, as_json, parts)
        finally:
            unregister()
        _report(parts, last, as_json, usage, loaded, generation.config, entered)  # also after Ctrl-C: nothing lost
    finally:
        loaded.close()
    if interrupted is not None:
        sys.exit(EXIT_TERMINATED if isinstance(interrupted, Terminated) else EXIT_INTERRUPTED)


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
            parts.append(r.text)
            if not as_json and r.text:
                click.echo(r.text, nl=False)
                sys.stdout.flush()
    except KeyboardInterrupt as stop:
        click.echo("\nterminated" if isinstance(stop, Terminated) else "\ninterrupted", err=True)
        return last, stop
    finally:
        stream.close()
    return last, None


def _report(parts: list[str], last: Any, as_json: bool, usage: bool, loaded: Loaded, config: GenerationConfig,
            entered: float) -> None:
    """After generation: the final newline or the JSON object on stdout, the statistics on stderr."""
    from localspec.planner import one_token_seconds

    if not as_json and parts:
        click.echo("")
    if last is None:
        return
    if as_json:
        click.echo(json.dumps(response_json("".join(parts), last.finish_reason, last.stats,
                                            loaded.target_name, config, timings_json(entered, loaded, last.stats))))
    if usage:
        drafts = not config.is_target_alone(loaded.draft is not None)
        one = one_token_seconds(loaded.target) if drafts else 0.0
        click.echo(format_stats(last.stats, drafts, one), err=True)


def iter_commands() -> Iterator[click.Command]:
    """Subcommands from the other modules of localspec/cli/ (each defines COMMANDS)."""
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        yield from getattr(module, "COMMANDS", ())


for _command in iter_commands():
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="localspec")
