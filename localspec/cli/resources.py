"""What a generating command takes from the process it runs in: models, the prompt cache, the
cost profiles and a line of input from the user.

In a process of its own (``--keep-alive 0``, or click's test runner) a command loads its models
and closes them when it ends, reads and saves the cost profiles per generation, and reads input
from its terminal: :class:`Resources`. A resident service (:mod:`localspec.resident.service`)
passes its own subclass as the click context's object, which keeps models, prompt-cache states
and profiles between calls and reads input from the client's terminal. The commands find it with
:func:`current`.
"""

from __future__ import annotations

import time
from typing import Any

import click

from localspec.config import GenerationConfig
from localspec.loading import Loaded


class Resources:
    """A command in its own process: everything is made for the call and released after it."""

    resident = False  # reported as "resident" in --json

    def __init__(self) -> None:
        self.entered = time.time()  # when the call started (epoch seconds)

    def keep_alive(self, seconds: float | None) -> None:
        """--keep-alive: how long a service keeps the models after this call (here: nothing to keep)."""

    def prompt_cache(self, setting: Any, **cache_options: Any) -> Any:
        """The PromptCache a --prompt-cache setting names (None: off)."""
        from localspec.llama.prompt_cache import PromptCache

        return PromptCache.from_setting(setting, **cache_options)

    def load_for(self, config: GenerationConfig, model: str | None, draft: str | None, options: dict,
                 grammar: bool = False) -> Loaded:
        """The pair a generation needs (see localspec.cli.options.load_for)."""
        from localspec.cli.options import load_for

        return load_for(config, model, draft, options, grammar=grammar)

    def release(self, loaded: Loaded) -> None:
        """The call is over with these models."""
        loaded.close()

    @property
    def profiles(self) -> Any:
        """The cost profiles generations plan with: None here (each generation reads the user's
        and saves what it measured)."""
        return None

    def session_profiles(self) -> Any:
        """The profiles a chat session refines (saved after each reply)."""
        from localspec.decoding.profiles import Profiles

        return self.profiles if self.profiles is not None else Profiles()

    def input(self, prompt: str) -> str:
        """A line typed at a terminal (input() with line editing)."""
        return input(prompt)

    def timings(self) -> dict[str, Any]:
        """What --json's "timings" adds for this process (a service: its own time for the call)."""
        return {}


def current() -> Resources:
    """The resources of the running command (a plain process's when no service set them)."""
    ctx = click.get_current_context(silent=True)
    found = ctx.find_object(Resources) if ctx is not None else None
    return found if found is not None else Resources()
