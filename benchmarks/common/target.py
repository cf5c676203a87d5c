"""The default pair's target, measured in this process: the prompt as it decodes it (chat
template), its greedy answer, what one pass of n tokens costs (the cost curve) and what a token
of a long prefill costs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

CURVE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 32)  # tokens per target decode


def default_target() -> Path:
    """The default pair's target file (fetched on first use)."""
    from localspec.llama import registry

    reg = registry.load_registry()
    return Path(registry.resolve(reg.pairs[reg.default_pair].target))


def chat_text(prompt: str, system: str | None = None) -> str:
    """The text localspec decodes from for a prompt (and a system message, else the template's
    default one): the target's chat template, rendered."""
    from localspec.llama.model import Model
    from localspec.prompt import check_messages, render_messages, template_of

    vocab = Model.vocabulary(default_target())
    try:
        messages = [*([{"role": "system", "content": system}] if system is not None else []),
                    {"role": "user", "content": prompt}]
        return render_messages(vocab, template_of(vocab), check_messages(messages), True, None)
    finally:
        vocab.close()


def chat_tokens(target: Any, prompt: str) -> list[int]:
    """The prompt as one chat-templated user message, tokenized as stream_generate would."""
    from localspec.prompt import prompt_tokens

    return prompt_tokens(target, [{"role": "user", "content": prompt}])


def greedy_answer(target: Any, prompt: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt tokens, the target alone's greedy answer) for `prompt` as one chat message: the
    output any lossless speculation at T = 0 reproduces."""
    from localspec.api import stream_generate

    tokens = chat_tokens(target, prompt)
    output = [r.token for r in stream_generate(target, None, tokens, temperature=0, max_tokens=max_tokens,
                                               num_draft_tokens=0) if r.token is not None]  # None: the context was full
    return list(tokens), output


def time_decode(model: Any, n: int, seq: int) -> float:
    """Seconds for one decode of n dummy tokens (all logits) in scratch KV sequence `seq`."""
    tokens = [model.bos if model.bos >= 0 else 0] * n
    t0 = time.perf_counter()
    model.decode(tokens, range(n), [(seq,)] * n, outputs="all")
    secs = time.perf_counter() - t0
    model.seq_rm(seq, -1, -1)
    return secs


def cost_curve(target: Any, sizes: Sequence[int] = CURVE_SIZES, rounds: int = 5) -> dict[int, float]:
    """Seconds per target decode of n tokens with every row's logits (a verification pass): the
    median of `rounds` interleaved rounds in a scratch KV sequence, after one warm-up decode (a
    median, not the best: the runs pay typical costs, and a best-of for the 30 ms single-token decode
    is luckier than for the 300 ms batches)."""
    seq = target.options.n_seq_max - 1
    time_decode(target, 1, seq)
    times: dict[int, list[float]] = {n: [] for n in sizes if n <= target.n_batch}
    for _ in range(rounds):
        for n in times:
            times[n].append(time_decode(target, n, seq))
    return {n: float(np.median(ts)) for n, ts in times.items()}


def prefill_rate(target: Any, tokens: int = 256) -> float:
    """Seconds per token of a long prompt prefill."""
    ids = (target.tokenize("The quick brown fox jumps over the lazy dog. " * 64) * 2)[:tokens]
    target.prefill(ids[:8], 0)  # warm-up
    target.seq_rm(0, 0, -1)
    t0 = time.perf_counter()
    target.prefill(ids, 0)
    rate = (time.perf_counter() - t0) / len(ids)
    target.seq_rm(0, 0, -1)
    return rate
