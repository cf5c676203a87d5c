"""Where localspec keeps its files: the cache root (models, profiles, prompts, chats), the cost
profiles' directory and the runtime directory of resident services. A leaf (the standard library, :mod:`localspec.settings.environment`),
so that the ``localspec`` client finds a running service without importing anything heavy."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from localspec.settings import environment

TYPE_CHECKING = False  # typing is not imported at run time (see localspec.settings.environment)
if TYPE_CHECKING:
    from typing import Literal

CACHE_ENV = "LOCALSPEC_CACHE_DIR"
RUNTIME_ENV = "XDG_RUNTIME_DIR"
PROMPT_CACHE_ENV = "LOCALSPEC_PROMPT_CACHE"  # a directory, or "off"
PROFILE_ENV = "LOCALSPEC_PROFILE_DIR"  # the cost profiles' directory (default: <cache root>/profiles)


def cache_root() -> Path:
    """localspec's cache: $LOCALSPEC_CACHE_DIR, else the user cache directory (which follows
    $XDG_CACHE_HOME), e.g. ~/.cache/localspec. Models and cost profiles live below it."""
    override = environment.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    if sys.platform.startswith("linux"):  # platformdirs' rule on Linux, without importing it
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "localspec"
    try:
        import platformdirs
    except ImportError:  # declared dependency; keep working if an install skipped it
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "localspec"
    return Path(platformdirs.user_cache_dir("localspec"))


def profile_dir() -> Path:
    """Where cost profiles and kernel verdicts live: $LOCALSPEC_PROFILE_DIR, else <cache root>/profiles."""
    override = environment.get(PROFILE_ENV)
    return override if override is not None else cache_root() / "profiles"


def runtime_dir() -> Path:
    """Where resident services put their sockets and records: $XDG_RUNTIME_DIR/localspec (a
    per-user directory the system clears at logout), else <cache root>/run."""
    runtime = os.environ.get(RUNTIME_ENV)
    if runtime and os.path.isabs(runtime):
        return Path(runtime) / "localspec"
    return cache_root() / "run"


def prompt_cache_setting(value: str | os.PathLike | None = None) -> Path | Literal[False] | None:
    """What a prompt-cache setting names: a directory, False ("off"), or None (the default:
    <cache root>/prompts); None as `value` reads LOCALSPEC_PROMPT_CACHE (ConfigError for a bad one)."""
    if value is None:  # the environment's (an empty variable is unset)
        return environment.get(PROMPT_CACHE_ENV)
    if str(value).strip() == "":
        return False
    return environment.parse_dir_or_off(os.fsdecode(value), "prompt_cache", "prompt_cache")


def default_prompt_cache() -> Path:
    return cache_root() / "prompts"
