"""Saved chats (``/save NAME``, ``localspec chat --resume NAME``): the messages of a conversation
as JSON in ``<cache root>/chats``, a private store (they hold the user's messages)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from localspec.errors import ConfigError
from localspec.settings.files import TEXT_LIMIT, Foreign, StateDir

CHAT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")


def chats_dir() -> Path:
    """Where /save keeps conversations: <cache root>/chats (private: they hold the user's messages)."""
    from localspec.llama import registry

    return registry.cache_root() / "chats"


def _store(create: bool) -> StateDir:
    """The chat store, opened: ConfigError when it is refused (a link, another user's, open to
    others), FileNotFoundError when absent and not `create`."""
    return StateDir.open(chats_dir(), what="the chat store", create=create, private=True)


def chat_path(name: str, param: str = "name") -> Path:
    if not CHAT_NAME.fullmatch(name):
        raise ConfigError(f"{name!r} is not a chat name: use up to 64 letters, digits, '_', '-' or '.'", param)
    return chats_dir() / f"{name}.json"


def write_chat(path: Path, model: str, system: str | None, history: list[dict]) -> None:
    """Keep a conversation at `path` (of :func:`chat_path`): written whole, 0600, in a 0700
    directory of localspec's own. ConfigError (the store refused), Foreign (something else holds
    the name) or OSError."""
    data = json.dumps({"version": 1, "model": model, "system": system, "history": history},
                      ensure_ascii=False, indent=1)
    with _store(create=True) as store:
        store.write(path.name, data.encode("utf-8"))


def load_chat(name: str) -> dict:
    """A conversation /save kept (ConfigError naming --resume when it is missing or unreadable)."""
    path = chat_path(name, "resume")
    try:
        with _store(create=False) as store:
            try:
                data = json.loads(store.read(path.name, TEXT_LIMIT).decode("utf-8"))
            except FileNotFoundError:
                saved = [n[:-5] for n in store.names() if n.endswith(".json") and not n.startswith(".")]
                raise ConfigError(f"no saved chat {name!r} (saved: {', '.join(saved) or 'none'}); /save NAME in a "
                                  "chat keeps one", "resume") from None
        history = data["history"]
        if not isinstance(history, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                    and isinstance(m.get("content"), str) for m in history):
            raise ValueError("its history is not a list of messages")
    except FileNotFoundError:
        raise ConfigError(f"no saved chat {name!r} (saved: none); /save NAME in a chat keeps one", "resume") from None
    except Foreign as exc:
        raise ConfigError(f"cannot read the saved chat {path}: it is {exc}, not a chat localspec saved",
                          "resume") from None
    except ConfigError as exc:
        raise ConfigError(str(exc), "resume") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ConfigError(f"cannot read the saved chat {path}: {exc}", "resume") from None
    return {"system": data.get("system") if isinstance(data.get("system"), str) else None, "history": history}
