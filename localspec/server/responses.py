"""The OpenAI response objects of one request (full responses, stream chunks, errors)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from localspec import __version__
from localspec.config import GenerationConfig
from localspec.engine import GenerationStats

FINGERPRINT = f"localspec-{__version__}"


def speculative_info(config: GenerationConfig, stats: GenerationStats) -> dict:
    """The settings used and the acceptance statistics (the `speculative` object)."""
    options = config.options()
    return {**{k: options[k] for k in ("verifier", "drafter", "plan", "num_draft_tokens", "paths", "tree")},
            **stats.as_dict()}


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


@dataclass
class Reply:
    """Builds the OpenAI objects of one request."""

    chat: bool
    include_usage: bool
    config: GenerationConfig  # as it applies to the loaded pair
    model_id: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id,
                "system_fingerprint": FINGERPRINT}

    def full(self, text: str, finish: str, stats: GenerationStats) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": [choice], "usage": usage(stats), "speculative": speculative_info(self.config, stats)}

    def chunk(self, text: str | None, finish: str | None = None, *, role: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def final_chunks(self, finish: str, stats: GenerationStats) -> list[dict]:
        spec = speculative_info(self.config, stats)
        last = {**self.chunk(None, finish), "speculative": spec}
        if not self.include_usage:
            return [last]
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return [last, {**head, "choices": [], "usage": usage(stats), "speculative": spec}]
