"""The ``localspec`` command line.

The root command generates: ``localspec "prompt"`` equals ``localspec generate "prompt"``.
Subcommands live in ``localspec/commands/`` and share the option groups defined here.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import click

from localspec import __version__

log = logging.getLogger(__name__)

# copies of verifier.METHODS, api.DRAFTERS and engine.PLANS, so that `localspec --help` need not load
# numpy and llama.cpp (tests/test_cli.py checks they stay equal)
VERIFIERS = ("greedy", "match", "token", "block", "gbv", "rrs", "rrsw", "traversal", "batch")
DRAFTERS = ("model", "ngram", "hybrid")
PLANS = ("auto", "fixed")
CACHE_TYPES = ("f16", "f32", "q8_0")
LOAD_MODES = ("read", "mmap", "auto")


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


# ---------------------------------------------------------------- shared options


def _tree(value: str | None) -> tuple[int, ...] | None:
    if not value:
        return None
    try:
        tree = tuple(int(x) for x in value.lower().replace(",", "x").split("x"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a branching list such as 3x2x1 "
                                 "(children per node at each depth)", param_hint="--tree") from None
    if not tree or any(b < 1 for b in tree):
        raise click.BadParameter(f"{value!r}: every branching factor must be >= 1", param_hint="--tree")
    return tree


def model_options(f: Callable) -> Callable:
    """-m/-d and how to load them."""
    options = [
        click.option("-m", "--model", envvar="LOCALSPEC_MODEL", default=None, metavar="GGUF|NAME",
                     help="Target model: a GGUF path or a registry name (default: the default pair's "
                          "target; env LOCALSPEC_MODEL)."),
        click.option("-d", "--draft", envvar="LOCALSPEC_DRAFT", default=None, metavar="GGUF|NAME|none",
                     help="Draft model: a GGUF path, a registry name, or 'none' for target-only decoding "
                          "(default: the default pair's draft when -m is not given; env LOCALSPEC_DRAFT)."),
        click.option("--ctx-size", type=click.IntRange(16), default=4096, show_default=True,
                     help="Context length in tokens."),
        click.option("--n-gpu-layers", type=int, default=0, show_default=True,
                     help="Target layers to offload to the GPU (-1: all)."),
        click.option("--draft-n-gpu-layers", type=int, default=None,
                     help="Draft layers to offload to the GPU (default: as --n-gpu-layers)."),
        click.option("--threads", type=click.IntRange(1), default=None, help="CPU threads (default: all cores)."),
        click.option("--cache-type", type=click.Choice(CACHE_TYPES), default="f16", show_default=True,
                     envvar="LOCALSPEC_CACHE_TYPE",
                     help="KV cache type of both models; q8_0 halves its memory (env LOCALSPEC_CACHE_TYPE)."),
        click.option("--load-mode", type=click.Choice(LOAD_MODES), default="read", show_default=True,
                     envvar="LOCALSPEC_LOAD_MODE",
                     help="read: copy the weights into memory (no second resident copy where llama.cpp "
                          "repacks them for its CPU kernels); mmap: map the file; auto: llama.cpp decides "
                          "(env LOCALSPEC_LOAD_MODE)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def spec_options(f: Callable) -> Callable:
    """How to draft and verify."""
    options = [
        click.option("--verifier", type=click.Choice(VERIFIERS), default="block", show_default=True,
                     help="Verification rule: greedy, match (llama.cpp's), token, block, gbv (K paths), "
                          "batch (K paths), rrs/rrsw/traversal (trees)."),
        click.option("-k", "--num-draft-tokens", type=click.IntRange(0, 64), default=4, show_default=True,
                     help="Draft length per path (0: no speculation)."),
        click.option("--paths", type=click.IntRange(1, 16), default=1, show_default=True,
                     help="Independent draft paths (for --verifier gbv or batch)."),
        click.option("--tree", "tree", default=None, metavar="BxBx..",
                     help="Draft tree: children per node at each depth, e.g. 3x2x1 "
                          "(for --verifier rrs, rrsw or traversal)."),
        click.option("--drafter", type=click.Choice(DRAFTERS), default="model", show_default=True,
                     help="model: the draft model; ngram: prompt lookup (no draft model); "
                          "hybrid: n-gram when the context repeats, else the model."),
        click.option("--plan", type=click.Choice(PLANS), default="auto", show_default=True,
                     help="auto: choose each step's draft depth, or no speculation, from measured "
                          "step costs and acceptance; fixed: always draft the full shape."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def sampling_options(f: Callable) -> Callable:
    options = [
        click.option("-t", "--temperature", type=click.FloatRange(0), default=0.8, show_default=True,
                     help="Sampling temperature (0: greedy)."),
        click.option("--top-k", type=click.IntRange(0), default=40, show_default=True, help="Top-k (0: off)."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.95, show_default=True,
                     help="Top-p (1: off)."),
        click.option("--min-p", type=click.FloatRange(0, 1), default=0.05, show_default=True,
                     help="Min-p (0: off)."),
        click.option("--seed", type=int, default=None,
                     help="Random seed (default: random). Runs repeat exactly with --plan fixed; --plan auto "
                          "adapts the draft depth to measured timings, which changes the sample drawn "
                          "(not its distribution)."),
        click.option("-n", "--max-tokens", type=click.IntRange(1), default=256, show_default=True,
                     help="Most tokens to generate."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@dataclass
class Loaded:
    target: Any
    draft: Any  # Model | None
    target_name: str


def _is_none(value: str | None) -> bool:
    return value is not None and value.lower() in ("none", "")


def load_pair(model: str | None, draft: str | None, *, ctx_size: int, n_gpu_layers: int,
              draft_n_gpu_layers: int | None, threads: int | None, cache_type: str = "f16",
              load_mode: str = "read", need_draft: bool = True,
              **extra: Any) -> Loaded:
    """Load the target and draft the options name; errors become click errors."""
    from localspec import registry
    from localspec.api import load_model
    from localspec.model import ModelError

    try:
        reg = registry.load_registry()
        pair = reg.pairs[reg.default_pair]
        target_name = model or pair.target
        draft_name = None if (_is_none(draft) or not need_draft) else (draft or (None if model else pair.draft))
        common = dict(ctx_size=ctx_size, threads=threads, cache_type=cache_type, load_mode=load_mode, **extra)
        target = load_model(target_name, n_gpu_layers=n_gpu_layers, **common)
        try:
            dm = None
            if draft_name:
                dm = load_model(draft_name, n_gpu_layers=n_gpu_layers if draft_n_gpu_layers is None
                                else draft_n_gpu_layers, **common)
        except BaseException:
            target.close()
            raise
    except (ModelError, registry.FetchError, registry.ModelNotFound, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    return Loaded(target, dm, target_name)


def spec_kwargs(verifier: str, num_draft_tokens: int, paths: int, tree: str | None, drafter: str,
                plan: str) -> dict:
    """Keyword arguments of stream_generate for the speculative options (before the models load:
    api.target_alone_without_draft adapts them to the loaded pair)."""
    return dict(verifier=verifier, num_draft_tokens=num_draft_tokens, paths=paths, tree=_tree(tree),
                drafter=drafter, plan=plan)


def user_errors(f: Callable) -> Callable:
    """Turn localspec's own exceptions into click errors (a message, no traceback)."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from localspec.engine import ConfigError
        from localspec.model import ModelError
        from localspec.verifier import VerifierError

        try:
            return f(*args, **kwargs)
        except (ConfigError, ModelError, VerifierError) as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper


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


def _read_prompt(prompt: tuple[str, ...]) -> str:
    """The prompt argument, followed by piped stdin when there is any (`cat notes | localspec "Summarise:"`)."""
    text = " ".join(prompt)
    piped = "" if sys.stdin.isatty() else sys.stdin.read()
    if text and piped.strip():
        return f"{text}\n\n{piped}"
    if text:
        return text
    if sys.stdin.isatty():
        raise click.UsageError("give a prompt as an argument or on stdin, e.g. localspec \"def fib(n):\"")
    if not piped.strip():
        raise click.UsageError("the prompt on stdin is empty")
    return piped


def format_stats(stats: Any, speculative: bool, target: Any = None) -> str:
    """Human-readable generation statistics (for stderr). With the target model, the speedup
    estimate uses its measured single-token step cost (from --plan auto's calibration)."""
    lines = [f"{stats.generated_tokens} tokens in {stats.elapsed_seconds:.2f} s: "
             f"{stats.tokens_per_second:.1f} tok/s (prompt {stats.prompt_tokens} tokens, "
             f"{stats.prompt_seconds:.2f} s)"]
    if speculative and stats.target_passes and not stats.drafted_tokens:
        lines.append("no tokens drafted: the planner (--plan auto) found that speculation does not pay with "
                     "these step costs; --plan fixed forces it")
    elif speculative and stats.target_passes:
        lines.append(f"block efficiency {stats.block_efficiency:.2f} tokens/target pass, "
                     f"acceptance {stats.acceptance_rate:.1%} ({stats.accepted_tokens}/{stats.drafted_tokens} "
                     f"drafted), verifier {stats.verifier_share:.1%} of step time")
        hist = stats.accept_histogram
        if hist:
            total = sum(hist)
            width = 30
            lines.append("accepted per step:")
            for n, count in enumerate(hist):
                bar = "#" * round(width * count / total) if total else ""
                lines.append(f"  {n:2d} | {bar} {count}")
        busy = stats.draft_seconds + stats.target_seconds + stats.verify_seconds
        costs = getattr(target, "step_costs", None)
        if busy > 0 and costs is not None and costs(1) > 0:
            est = stats.generated_tokens * costs(1) / busy
            lines.append(f"speedup estimate vs target alone: {est:.2f}x (from the measured one-token step "
                         "cost; `localspec bench` measures it side by side)")
    return "\n".join(lines)


def response_json(text: str, finish: str | None, stats: Any, model: str, settings: dict) -> dict:
    return {
        "model": model, "text": text, "finish_reason": finish, "settings": settings,
        "usage": {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens},
        "stats": {"tokens_per_second": stats.tokens_per_second, "elapsed_seconds": stats.elapsed_seconds,
                  "block_efficiency": stats.block_efficiency, "acceptance_rate": stats.acceptance_rate,
                  "target_passes": stats.target_passes, "drafted_tokens": stats.drafted_tokens,
                  "accepted_tokens": stats.accepted_tokens, "accept_histogram": list(stats.accept_histogram),
                  "verifier_share": stats.verifier_share},
    }


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
def generate(prompt: tuple[str, ...], model: str | None, draft: str | None, ctx_size: int,
             n_gpu_layers: int, draft_n_gpu_layers: int | None, threads: int | None, cache_type: str,
             load_mode: str, verifier: str,
             num_draft_tokens: int, paths: int, tree: str | None, drafter: str, plan: str, temperature: float,
             top_k: int, top_p: float, min_p: float, seed: int | None, max_tokens: int,
             chat_template: bool, system: str | None, stop: tuple[str, ...], as_json: bool,
             usage: bool) -> None:
    """Generate text from PROMPT (or stdin), streaming it to stdout.

    \b
    localspec "def quicksort(xs):"
    echo "Explain speculative decoding" | localspec -u
    localspec -m target.gguf -d draft.gguf --verifier traversal --tree 3x2x1 "..."
    localspec --drafter ngram -d none --raw -n 100 "$(cat file.py) # refactor:"
    """
    from localspec.api import stream_generate, target_alone_without_draft

    text = _read_prompt(prompt)
    spec = spec_kwargs(verifier, num_draft_tokens, paths, tree, drafter, plan)
    loaded = load_pair(model, draft, ctx_size=ctx_size, n_gpu_layers=n_gpu_layers,
                       draft_n_gpu_layers=draft_n_gpu_layers, threads=threads, cache_type=cache_type,
                       load_mode=load_mode,
                       need_draft=drafter != "ngram")
    spec = target_alone_without_draft(spec, loaded.draft is not None)
    target = loaded.target
    message: Any = text
    if chat_template and target.chat_template:
        message = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                    max_tokens=max_tokens, **spec)
    parts: list[str] = []
    last = None
    interrupted = False
    try:
        stream = stream_generate(target, loaded.draft, message, stop=list(stop), **settings)
        try:
            for r in stream:
                last = r
                parts.append(r.text)
                if not as_json and r.text:
                    click.echo(r.text, nl=False)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            interrupted = True
            click.echo("\ninterrupted", err=True)
        finally:
            stream.close()
        _report(parts, last, as_json, usage, loaded, settings)  # also after Ctrl-C: nothing generated is lost
    finally:
        target.close()
        if loaded.draft is not None:
            loaded.draft.close()
    if interrupted:
        sys.exit(130)  # the shell's convention for SIGINT


def _report(parts: list[str], last: Any, as_json: bool, usage: bool, loaded: Loaded, settings: dict) -> None:
    """After generation: the final newline or the JSON object on stdout, the statistics on stderr."""
    from localspec.planner import calibrate

    if not as_json and parts:
        click.echo("")
    if last is None:
        return
    if as_json:
        click.echo(json.dumps(response_json("".join(parts), last.finish_reason, last.stats,
                                            loaded.target_name, settings), default=list))
    if usage:
        speculative = settings["num_draft_tokens"] > 0 or bool(settings["tree"])
        if speculative:
            calibrate(loaded.target, (1,))  # the one-token step cost behind the speedup estimate
        click.echo(format_stats(last.stats, speculative=speculative, target=loaded.target), err=True)


def iter_commands() -> Iterator[click.Command]:
    """Subcommands from localspec/commands/ (each module defines COMMANDS)."""
    import importlib
    import pkgutil

    from localspec import commands

    for info in pkgutil.iter_modules(commands.__path__):
        module = importlib.import_module(f"localspec.commands.{info.name}")
        yield from getattr(module, "COMMANDS", ())


for _command in iter_commands():
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="localspec")
