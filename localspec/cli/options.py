"""The option groups and helpers that the ``localspec`` commands share.

Defaults and ranges come from :mod:`localspec.config` (one place for each); localspec's errors
become messages and exit codes in one place, :data:`localspec.errors.EXIT_CODES`. Commands import
from here; this module imports no command.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

import click

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
    Constraint,
    GenerationConfig,
    grammar_from_file,
)
from localspec.errors import ConfigError, LocalspecError, exit_code
from localspec.loading import Loaded, draft_loading, load_pair


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


def prompt_cache_option(f: Callable) -> Callable:
    """--prompt-cache: where prompt prefixes' KV state is saved and restored (the cache is a
    setting of the process, not of a generation: popped from the options by pop_prompt_cache)."""
    from localspec.llama.prompt_cache import ENV

    return click.option("--prompt-cache", envvar=ENV, default=None, metavar="DIR|off",
                        help="Save each prompt's KV state and restore the longest saved prefix of later "
                             "prompts (default: on, under the user cache directory; 'off': never).")(f)


def pop_prompt_cache(options: dict, **cache_options: Any) -> Any:
    """The PromptCache the --prompt-cache option names (removed from `options`), or None (off);
    `cache_options`: PromptCache's keywords (a server's memory and namespace)."""
    from localspec.llama.prompt_cache import PromptCache

    return PromptCache.from_setting(options.pop("prompt_cache", None), **cache_options)


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
        click.option("--grammar", "grammar", default=None, metavar="FILE",
                     help="The output follows this grammar file: GBNF (llama.cpp's), or Lark (llguidance's) "
                          "when the file ends in .lark or starts with %llguidance."),
    ])


CONSTRAINT_FLAGS = ("json_schema", "json_object", "regex", "grammar")  # constraint_options' parameter names


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


def toolset_from_flags(options: dict) -> Any:
    """The ToolSet --tools, --tool-choice and --parallel-tool-calls ask for (removed from
    `options`), checked now: a bad file or tool is a usage error naming its flag."""
    from localspec.tools import CHOICES, ToolSet

    path, choice = options.pop("tools", None), options.pop("tool_choice", None)
    parallel = options.pop("parallel_tool_calls", True)
    if path is None:
        if choice is not None:
            raise ConfigError("--tool-choice needs --tools FILE.json", "tool_choice")
        return None
    try:
        tools = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}", "tools") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not a JSON file: {exc}", "tools") from None
    if isinstance(tools, dict) and "tools" in tools:  # a request body's tools
        tools = tools["tools"]
    if isinstance(tools, dict):  # one tool
        tools = [tools]
    if choice is not None and choice not in CHOICES:
        choice = {"type": "function", "function": {"name": choice}}
    try:
        return ToolSet.parse(tools, choice, parallel)
    except ConfigError as exc:
        where = exc.param or ""
        param = "tool_choice" if where.startswith("tool_choice") else "tools"
        raise ConfigError(f"{path}: {exc}" if param == "tools" else str(exc), param) from None


def constraint_from_flags(options: dict) -> Constraint | None:
    """The constraint the flags ask for (removed from `options`), compiled and validated now, so a
    bad schema or grammar is a usage error naming its flag before any model loads."""
    given = [k for k in CONSTRAINT_FLAGS if options.get(k)]
    values = {k: options.pop(k, None) for k in CONSTRAINT_FLAGS}
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError("give one of --json-schema, --json-object, --regex and --grammar", given[1])
    flag = given[0]
    if flag == "json_object":
        constraint = Constraint.json_object(param="json_object")
    elif flag == "regex":
        constraint = Constraint.regex(values["regex"], param="regex")
    elif flag == "grammar":
        constraint = grammar_from_file(values["grammar"], param="grammar")
    else:
        constraint = Constraint.json_schema(_schema_text(values["json_schema"]), param="json_schema")
    from localspec.decoding.constraint import compile_constraint  # llguidance: only for a constrained run

    compile_constraint(constraint)
    return constraint


def _schema_text(value: str) -> str:
    """--json-schema's value: the schema as JSON text, or the file that holds it."""
    text = value.strip()
    if text.startswith("{") or text in ("true", "false"):
        return text
    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{value!r} is neither a JSON schema (JSON text starting with '{{') nor a file",
                          "json_schema") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the JSON schema file {path}: {exc}", "json_schema") from None


GENERATION_KEYS = SETTING_KEYS  # a command's options that are generation settings


def generation_config(options: dict) -> GenerationConfig:
    """The GenerationConfig of the command's options (the keys of GENERATION_KEYS it has, and
    the constraint flags of constraint_options, which this removes from `options`)."""
    constraint = constraint_from_flags(options)
    settings = {k: v for k, v in options.items() if k in GENERATION_KEYS and k not in CONSTRAINT_FLAGS}
    return GenerationConfig.from_options(**settings, constraint=constraint)


def load_for(config: GenerationConfig, model: str | None, draft: str | None, options: dict,
             grammar: bool = False) -> Loaded:
    """The pair a generation config needs (localspec.loading.draft_loading decides about the draft);
    `grammar`: the generation will be constrained (tool calls) even if the config is not yet."""
    need, lazy = draft_loading(config.drafter, draft_named=False)
    return load_pair(model, draft, need_draft=need, lazy_draft=lazy,
                     grammar=grammar or config.constraint is not None, **model_kwargs(options))


def model_kwargs(options: dict) -> dict:
    """The load_pair keywords among a command's options."""
    keys = ("ctx_size", "n_gpu_layers", "draft_n_gpu_layers", "threads", "cache_type", "load_mode", "cpu_kernels",
            "rpc", "draft_rpc")
    return {k: options[k] for k in keys if k in options}

