"""An OpenAI-compatible HTTP server (Starlette, sse-starlette, uvicorn: the extra ``localspec[server]``).

    GET  /v1/models             the loaded model
    POST /v1/chat/completions   messages -> chat.completion (or chat.completion.chunk events)
    POST /v1/completions        prompt   -> text_completion (or text_completion events)

One target/draft pair is loaded once and kept on the core every front end shares
(:mod:`localspec.core.residency`). Requests wait in its queue, so only one generation touches the
models at a time while the event loop stays responsive; a client that disconnects stops its
generation between steps. Speculative settings are extension
parameters of the request body (``extra_body`` in the openai client): top_k, min_p, verifier,
num_draft_tokens, paths, tree, drafter, plan. Every response carries a ``speculative`` object
with the settings used and the acceptance statistics.

Modules: :mod:`.schemas` (request bodies), :mod:`.jobs` (a request's generation on the core),
:mod:`.responses` (OpenAI objects), :mod:`.app` (routes, limits, errors), :mod:`.run` (socket and
uvicorn). Importing this package needs neither Starlette nor uvicorn.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from localspec.errors import ConfigError, DependencyError


@dataclass(frozen=True)
class ServerLimits:
    """What one request may take (each a `localspec serve` option)."""

    max_body_bytes: int = 1 << 20
    max_messages: int = 256
    max_nesting: int = 32  # JSON nesting depth of a body
    max_queue: int = 16  # requests waiting for the model worker
    header_timeout: float = 10.0  # seconds from connecting (or the last response) to a complete request head
    body_timeout: float = 30.0  # seconds to receive the body
    api_key: str | None = None  # when set, requests need "Authorization: Bearer <key>"

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_messages", "max_nesting", "max_queue"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}", name)
        for name in ("header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}", name)
        key = self.api_key
        if key is not None and (not key or key != key.strip() or not key.isprintable()):
            raise ConfigError("the API key must be printable text without spaces at its ends (a trailing newline, "
                              "say): clients send it in an HTTP header, which could never carry this one", "api_key")


def require_server_deps() -> None:
    """Raise DependencyError naming the extra to install when Starlette, sse-starlette, uvicorn or
    pydantic is missing."""
    modules = {"starlette": "starlette", "sse-starlette": "sse_starlette", "uvicorn": "uvicorn",
               "pydantic": "pydantic"}
    missing = [name for name, module in modules.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise DependencyError(f"the server needs {' and '.join(missing)}: pip install 'localspec[server]'")
