"""A conversation as the text of the model's chat template: what tests tokenize with
parse_special on (markers in messages become tokens) to compare with localspec.prompt.chat_tokens."""

from __future__ import annotations

from typing import Sequence

from localspec.llama.model import Model
from localspec.prompt import check_messages, render_messages, template_of


def render_chat(model: Model, messages: Sequence[dict], add_generation_prompt: bool = True,
                tools: Sequence[dict] | None = None) -> str:
    """The conversation (and the tools the model may call) as text, through the model's own chat
    template, as localspec.prompt renders it."""
    return render_messages(model, template_of(model), check_messages(messages), add_generation_prompt, tools)
