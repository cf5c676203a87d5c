"""How a generating command makes its call: the command line's options resolved into the typed
request (:class:`localspec.core.calls.Request`), and the call started where it runs.

Everything that depends on the calling process is resolved here, in it: the prompt, stdin and
named files are read (bounded), registry models are fetched, paths are made absolute, the
prompt cache and the profile directory are found from this process's environment. A call then
runs in the resident service (:class:`localspec.resident.client.RemoteCall`) or, with
``--keep-alive 0``, RPC servers or no usable runtime directory, in this process
(:class:`localspec.core.run.LocalCall`): the same request, the same events.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

import click

from localspec.core.calls import CallKind, Failed, Prompt, Request, Tools
from localspec.core.pairs import ModelFile, PairSpec
from localspec.errors import ConfigError, LocalspecError, ModelError
from localspec.settings import environment, locations
from localspec.settings.files import SPEC_LIMIT, read_user_text
from localspec.settings.generation import GenerationConfig
from localspec.settings.models import PairOptions

TYPE_CHECKING = False
if TYPE_CHECKING:
    from localspec.cli.options import Flags

MAX_LOADED_ENV = "LOCALSPEC_MAX_LOADED"
LIMIT_ENV = "LOCALSPEC_PROMPT_CACHE_LIMIT"


def resolve_pair(model: str | None, draft: str | None, options: PairOptions, need_draft: bool,
                 before_fetch: Callable[[], None] | None = None) -> PairSpec:
    """The pair -m/-d name, resolved here: registry models fetched (with progress on stderr), files
    identified; `before_fetch` runs first where a model is not at hand (to be fetched, or not
    found: the call's own usage errors come before either). The draft is left out where the call
    needs none (the n-gram drafter)."""
    from localspec.llama import registry
    from localspec.loading import pair_names

    names = pair_names(model, draft)
    wanted = [names.target, *([names.draft] if names.draft and need_draft else [])]
    if before_fetch is not None and not all(registry.at_hand(name) for name in wanted):
        before_fetch()
    target = _model_file(names.target, "model")
    draft_file = _model_file(names.draft, "draft") if names.draft and need_draft else None
    return PairSpec(target, draft_file, names.target, names.paired, options)


def _model_file(name: str, param: str) -> ModelFile:
    from localspec.llama import registry

    path = registry.resolve(name)
    try:
        return ModelFile.at(path)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ModelError(f"cannot read the model file {path}: {reason}") from None


def prompt_cache(value: Any) -> tuple[str | None, int]:
    """The prompt cache a --prompt-cache setting names (None: off) and its size on disk; a
    directory the user named is checked now (refused: a usage error naming --prompt-cache)."""
    setting = locations.prompt_cache_setting(value)
    limit = environment.get(LIMIT_ENV)
    if setting is False:
        return None, limit
    if setting is None:
        return os.fspath(locations.default_prompt_cache().absolute()), limit
    from localspec.llama.prompt_cache import PromptCache

    PromptCache(setting, limit).check()
    return os.fspath(setting.absolute()), limit


def profile_dir() -> str:
    return os.fspath(locations.profile_dir().absolute())


def tools_from_flags(flags: Flags) -> tuple[Tools | None, str | None]:
    """The tools --tools names (read here) with --tool-choice and --parallel-tool-calls, checked
    now (a bad file or tool is a usage error naming its flag before any model is fetched), and
    the file they came from."""
    path, choice = flags.get("tools"), flags.get("tool_choice")
    parallel = flags.get("parallel_tool_calls", True)
    if path is None:
        if choice is not None:
            raise ConfigError("--tool-choice needs --tools FILE.json", "tool_choice")
        return None, None
    from localspec.cli.options import TOOLS_HINT
    from localspec.settings.constraints import MAX_JSON_DEPTH
    from localspec.settings.validation import empty_value
    from localspec.tools import CHOICES, ToolSet

    if not path.strip():
        raise ConfigError(empty_value(TOOLS_HINT), "tools")
    try:
        tools = json.loads(read_user_text(path, param="tools", limit=SPEC_LIMIT, what="the tools file"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not a JSON file: {exc}", "tools") from None
    except RecursionError:  # deeper than Python's recursion limit
        raise ConfigError(f"{path} nests deeper than {MAX_JSON_DEPTH} levels of JSON arrays and objects (the most "
                          "localspec accepts)", "tools") from None
    if isinstance(tools, dict) and "tools" in tools:  # a request body's tools
        tools = tools["tools"]
    if isinstance(tools, dict):  # one tool
        tools = [tools]
    if choice is not None and choice not in CHOICES:
        choice = {"type": "function", "function": {"name": choice}}
    try:
        ToolSet.parse(tools, choice, parallel)
    except ConfigError as exc:
        raise tools_error(exc.param, str(exc), path) from None
    return Tools(tools if isinstance(tools, list) else [tools], choice, parallel), path


def tools_error(param: str | None, message: str, path: str) -> ConfigError:
    """A tools error as the command line names it: --tool-choice, or --tools with the file."""
    if (param or "").startswith("tool_choice"):
        return ConfigError(message, "tool_choice")
    return ConfigError(f"{path}: {message}", "tools")


def request(kind: CallKind, pair: PairSpec, config: GenerationConfig, prompt: Prompt, cache: tuple[str | None, int],
            keep_alive: float, tools: Tools | None = None) -> Request:
    """The call, with what the process's environment and logging say."""
    return Request(kind, pair, config.options(), prompt, cache[0], cache[1], profile_dir(), keep_alive,
                   environment.get(MAX_LOADED_ENV), tools,
                   grammar=tools is not None and tools.tool_choice != "none",
                   log_level=logging.getLogger().getEffectiveLevel())


class Caller:
    """Where a command's calls run: the resident service when they may (a keep-alive, no RPC
    servers, a usable runtime directory), else this process: on a residency of each call's own
    (a generation: its models are freed when it ends), or `shared` by all of them (a chat: its
    pair stays loaded between replies)."""

    def __init__(self, keep_alive: float, shared: bool = False) -> None:
        self.in_service = keep_alive > 0
        self.shared = shared
        self.residency: Any = None

    def call(self, request: Request) -> Any:
        """The call, started (a RemoteCall or a LocalCall: the same events)."""
        if self.in_service and not request.pair.options.remote:
            from localspec.resident.client import RemoteCall, Unavailable

            try:
                return RemoteCall.start(request)
            except Unavailable as exc:
                click.echo(f"localspec: the models are not kept loaded: {exc}", err=True)
                self.in_service = False
        from localspec.core.run import LocalCall

        if self.shared and self.residency is None:
            from localspec.core.residency import Residency

            self.residency = Residency()
        return LocalCall(request, self.residency)

    def close(self) -> None:
        """A shared residency unloads its pair (a chat ends)."""
        if self.residency is not None:
            self.residency.close()


def error_of(event: Failed, tools_file: str | None = None, config: GenerationConfig | None = None) -> LocalspecError:
    """The error a Failed event carries, as the class it names, naming the flag the user gave: a
    constraint's (the settings' flat form names every schema response_format), the tools' file."""
    from localspec import errors
    from localspec.settings.constraints import CONSTRAINT_KEYS

    cls = getattr(errors, event.error, None)
    if not (isinstance(cls, type) and issubclass(cls, LocalspecError)):
        cls = LocalspecError
    param = event.param
    if param in CONSTRAINT_KEYS and config is not None and config.constraint is not None:
        param = config.constraint.param
    if tools_file is not None and param and param.startswith("tool"):
        return tools_error(param, event.message, tools_file)
    if cls in (errors.ConfigError, errors.PromptError, errors.BenchError):
        return cls(event.message, param)
    if cls is errors.RequestError:
        return errors.RequestError(event.message, param)
    try:
        return cls(event.message)
    except TypeError:
        return LocalspecError(event.message)
