"""The option groups and helpers that the ``localspec`` commands share.

Defaults and ranges come from :mod:`localspec.settings` (one place for each); localspec's errors
become messages and exit codes in one place, :data:`localspec.errors.EXIT_CODES`. Commands import
from here; this module imports no command.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import click
from click.core import ParameterSource

from localspec.errors import ConfigError, LocalspecError, exit_code
from localspec.settings.constraints import CONSTRAINT_FLAGS, constraint_from_flags
from localspec.settings.generation import DEFAULTS, DRAFTERS, PLANS, SETTING_KEYS, VERIFIERS, GenerationConfig
from localspec.settings.models import CACHE_TYPES, CPU_KERNELS, LOAD_FLAGS, LOAD_MODES, MODEL_DEFAULTS, PairOptions
from localspec.settings.sampling import DEFAULT_SAMPLING

# ---------------------------------------------------------------- errors


ENV_SOURCES = "localspec.env_sources"  # ctx.meta: option name -> its variable, as values are read


def env_source(ctx: click.Context | None, name: str | None) -> str | None:
    """The environment variable the value of option `name` came from (None: the command line or
    its default), from click's own record of each value's source (once the value is converted)
    or EnvOption's (while it is: click 8.5 records the source after the conversion)."""
    if ctx is None or not name:
        return None
    if name in ctx.meta.get(ENV_SOURCES, {}):
        return ctx.meta[ENV_SOURCES][name]
    if ctx.get_parameter_source(name) is not ParameterSource.ENVIRONMENT:
        return None
    option = next((p for p in ctx.command.params if p.name == name), None)
    envvar = getattr(option, "envvar", None)
    return envvar if isinstance(envvar, str) else None


def env_sources(ctx: click.Context) -> dict[str, str]:
    """Every option of the command whose value came from the environment, with its variable."""
    found = {p.name: env_source(ctx, p.name) for p in ctx.command.params if p.name}
    return {name: envvar for name, envvar in found.items() if envvar}


class EnvOption(click.Option):
    """An option whose default comes from an environment variable (localspec.settings.environment): a bad
    value from the variable is reported as the flag's, naming the variable too."""

    def consume_value(self, ctx: click.Context, opts: Any) -> tuple[Any, ParameterSource]:
        value, source = super().consume_value(ctx, opts)
        if source is ParameterSource.ENVIRONMENT and isinstance(self.envvar, str) and self.name:
            ctx.meta.setdefault(ENV_SOURCES, {})[self.name] = self.envvar
        return value, source

    def get_error_hint(self, ctx: Any) -> str:
        hint = super().get_error_hint(ctx)
        envvar = env_source(ctx, self.name)
        return f"{hint} (from ${envvar})" if envvar else hint


class LocalspecClickError(click.ClickException):
    """A localspec error as click shows it, with its exit code; the setting at fault is named as
    its flag, and as the environment variable it came from where it did."""

    def __init__(self, exc: LocalspecError) -> None:
        param = getattr(exc, "param", None)
        ctx = click.get_current_context(silent=True)
        if param:
            envvar = env_source(ctx, param)
            message = f"Invalid value for --{param.replace('_', '-')}{f' (from ${envvar})' if envvar else ''}: {exc}"
        else:
            message = str(exc) + _env_values_named(ctx, str(exc))
        super().__init__(message)
        # click types exit_code a ClassVar (one per subclass), yet reads it from the instance it catches
        self.exit_code = exit_code(exc)  # type: ignore[misc]


def _env_values_named(ctx: click.Context | None, message: str) -> str:
    """" (--model 'x' came from $LOCALSPEC_MODEL)" for each value from the environment that an
    error names without naming its setting (a model that is not found)."""
    if ctx is None:
        return ""
    notes = [f"--{name.replace('_', '-')} {ctx.params[name]!r} came from ${envvar}"
             for name, envvar in env_sources(ctx).items()
             if isinstance(ctx.params.get(name), str) and repr(ctx.params[name]) in message]
    return f" ({'; '.join(notes)})" if notes else ""


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


def prompt_cache_option(f: Callable) -> Callable:
    """--prompt-cache: where prompt prefixes' KV state is saved and restored (a setting of the
    process, not of a generation: localspec.cli.resolve.prompt_cache reads it)."""
    from localspec.settings.locations import PROMPT_CACHE_ENV

    return click.option("--prompt-cache", cls=EnvOption, envvar=PROMPT_CACHE_ENV, default=None, metavar="DIR|off",
                        help="Save each prompt's KV state and restore the longest saved prefix of later "
                             "prompts (default: on, under the user cache directory; 'off': never).")(f)


class Duration(click.ParamType):
    """A duration: 30s, 5m, 1h, 1h30m, or seconds (localspec.settings.environment.parse_duration)."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        from localspec.settings import environment

        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        try:
            return environment.parse_duration(str(value), f"--{param.name.replace('_', '-')}" if param else "value")
        except ConfigError as exc:
            self.fail(str(exc).split("=", 1)[-1], param, ctx)


KEEP_ALIVE_ENV = "LOCALSPEC_KEEP_ALIVE"


def keep_alive_option(f: Callable) -> Callable:
    """--keep-alive: how long the models stay loaded in a resident service after the call
    (default: localspec.settings.environment's for LOCALSPEC_KEEP_ALIVE)."""
    from localspec.settings import environment

    default = environment.format_duration(environment.VARIABLES[KEEP_ALIVE_ENV].default)
    return click.option("--keep-alive", "keep_alive", type=Duration(), cls=EnvOption, envvar=KEEP_ALIVE_ENV,
                        default=default,
                        show_default=True, metavar="DURATION",
                        help="Keep the models loaded in a background service for this long after the call "
                             "(30s, 5m, 1h; 0: never, run in this process), so that the next call with the "
                             "same models starts at once. `localspec ps` lists them, `localspec stop` ends "
                             "them (env LOCALSPEC_KEEP_ALIVE).")(f)


def model_options(f: Callable) -> Callable:
    """-m/-d and how to load them."""
    m = MODEL_DEFAULTS
    return _options(f, [
        click.option("-m", "--model", cls=EnvOption, envvar="LOCALSPEC_MODEL", default=None, metavar="GGUF|NAME",
                     help="Target model: a GGUF path or a registry name (default: the default pair's "
                          "target; env LOCALSPEC_MODEL)."),
        click.option("-d", "--draft", cls=EnvOption, envvar="LOCALSPEC_DRAFT", default=None, metavar="GGUF|NAME|none",
                     help="Draft model: a GGUF path, a registry name, or 'none' for no draft model (the "
                          "n-gram drafter still drafts from the context; -k 0 decodes with the target "
                          "alone). Default: the default pair's draft when -m is not given (env LOCALSPEC_DRAFT)."),
        click.option("--ctx-size", type=int, default=m.ctx_size, show_default=True,
                     help="Context length in tokens of one call."),
        click.option("--parallel", type=int, cls=EnvOption, envvar="LOCALSPEC_NUM_PARALLEL", default=None,
                     help="Calls generating at once on a loaded pair (slots; each has --ctx-size tokens of KV "
                          "cache), as llama-server's -np; more wait in a queue. Default: 4, fewer where "
                          "memory is short (env LOCALSPEC_NUM_PARALLEL)."),
        click.option("--n-gpu-layers", type=int, default=m.n_gpu_layers, show_default=True,
                     help="Target layers to offload to the GPU (-1: all)."),
        click.option("--draft-n-gpu-layers", type=int, default=None,
                     help="Draft layers to offload to the GPU (default: as --n-gpu-layers)."),
        click.option("--threads", type=int, default=m.threads, help="CPU threads (default: all cores)."),
        click.option("--cache-type", type=click.Choice(CACHE_TYPES), default=m.cache_type, show_default=True,
                     cls=EnvOption, envvar="LOCALSPEC_CACHE_TYPE",
                     help="KV cache type of both models; q8_0 halves its memory (env LOCALSPEC_CACHE_TYPE)."),
        click.option("--load-mode", type=click.Choice(LOAD_MODES), default=m.load_mode, show_default=True,
                     cls=EnvOption, envvar="LOCALSPEC_LOAD_MODE",
                     help="read: copy the weights into memory (no second resident copy where llama.cpp "
                          "repacks them for its CPU kernels); mmap: map the file; auto: llama.cpp decides "
                          "(env LOCALSPEC_LOAD_MODE)."),
        click.option("--cpu-kernels", type=click.Choice(CPU_KERNELS), default=m.cpu_kernels, show_default=True,
                     cls=EnvOption, envvar="LOCALSPEC_CPU_KERNELS",
                     help="Which of llama.cpp's CPU weight kernels to use. auto: the fastest that runs here, "
                          "never AMX (its kernels crash on some Xeons), each checked once per machine in a "
                          "child process; llama: llama.cpp's own choice, AMX included; repack: its repacked "
                          "kernels only; plain: none of these (env LOCALSPEC_CPU_KERNELS)."),
        click.option("--rpc", cls=EnvOption, envvar="LOCALSPEC_RPC", default=None, metavar="HOST:PORT[,...]",
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


def constraint_options(f: Callable) -> Callable:
    """Structured output: what the text must match (at most one)."""
    return _options(f, [
        click.option("--json-schema", "json_schema", default=None, metavar="FILE|JSON",
                     help="The output is JSON matching this schema (a file, or the schema itself as JSON "
                          "text). Laid out as Python's json.dumps: one line, \", \" and \": \"."),
        click.option("--json-object", "json_object", is_flag=True, default=False,
                     help="The output is a JSON object (any)."),
        click.option("--regex", "regex", default=None, metavar="PATTERN",
                     help="The whole output matches this regular expression (Rust syntax, no look-around)."),
        click.option("--grammar", "grammar", default=None, metavar="FILE|GRAMMAR",
                     help="The output follows this grammar (a file, or the grammar itself, as the API's and the "
                          "server's grammar): GBNF (llama.cpp's), or Lark (llguidance's) when the file ends in "
                          ".lark or the text starts with %llguidance."),
    ])


TOOLS_HINT = "a FILE.json of tools"  # what --tools needs (an empty value is refused)


def tool_options(f: Callable) -> Callable:
    """Tool calling: the functions the model may call, and whether it must."""
    return _options(f, [
        click.option("--tools", "tools", default=None, metavar="FILE.json",
                     help="Functions the model may call: a JSON array of tools in OpenAI's shape "
                          "([{\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}]). "
                          "Calls are printed as one JSON array of OpenAI tool calls."),
        click.option("--tool-choice", "tool_choice", default=None, metavar="auto|none|required|NAME",
                     help="auto (default): text or calls (in the model's <tool_call> syntax, or written as "
                          "plain JSON); required: at least one call; none: text only; NAME: a call of that "
                          "function."),
        click.option("--parallel-tool-calls/--no-parallel-tool-calls", "parallel_tool_calls", default=True,
                     show_default=True, help="Allow several calls in one answer."),
    ])


# ---------------------------------------------------------------- one call's flags


@dataclass(frozen=True)
class Flags:
    """One command call's parameters as click parsed them, read-only: built once when the command
    starts (:meth:`current`), then read by each part of the call for what it needs, in any order
    (the settings, the load options, the constraint, the tools, the prompt cache)."""

    values: Mapping[str, Any]

    @classmethod
    def current(cls) -> Flags:
        """The parameters of the command running now."""
        return cls(MappingProxyType(dict(click.get_current_context().params)))

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def settings(self) -> dict[str, Any]:
        """The generation settings given (GenerationConfig.from_options' keywords; the constraint
        flags apart: generation_config reads them)."""
        return {k: v for k, v in self.values.items() if k in SETTING_KEYS and k not in CONSTRAINT_FLAGS}

    def load(self) -> PairOptions:
        """How the pair loads, from the load flags: ConfigError naming a bad one."""
        return PairOptions.from_flags({k: v for k, v in self.values.items() if k in LOAD_FLAGS})


def generation_config(flags: Flags) -> GenerationConfig:
    """The GenerationConfig of a command's flags. Its constraint is read and checked as text
    here (one flag, JSON that nests no deeper than allowed, the file it names); compiled by
    compile_constraint_now where a model would be fetched or loaded for it, and where the call
    runs (localspec.core.run), not by every call's client."""
    return GenerationConfig.from_options(**flags.settings(), constraint=constraint_from_flags(flags.values))


def compile_constraint_now(config: GenerationConfig) -> None:
    """Compile the config's constraint now (llguidance), so that a bad schema or grammar is a
    usage error naming its flag before a model is fetched (a call's client, first) or loaded
    (serve): a download is never started for a call that cannot run."""
    if config.constraint is not None:
        from localspec.decoding.grammar.compiler import compile_constraint

        compile_constraint(config.constraint)
