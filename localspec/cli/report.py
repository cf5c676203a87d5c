"""What a generation did, for people (stderr) and programs (JSON): the CLI's and chat's reports."""

from __future__ import annotations

from typing import Any

from localspec.settings.generation import GenerationConfig


def format_stats(stats: Any, speculative: bool, one_token_seconds: float = 0.0) -> str:
    """Human-readable generation statistics (for stderr). With the target's measured one-token
    step cost, a speedup estimate."""
    lines = [f"{stats.generated_tokens} tokens in {stats.elapsed_seconds:.2f} s: "
             f"{stats.tokens_per_second:.1f} tok/s (prompt {stats.prompt_tokens} tokens"
             + (f", {stats.cached_tokens} of them cached" if stats.cached_tokens else "")
             + f", {stats.prompt_seconds:.2f} s)"]
    if not speculative:
        lines.append("the target alone: nothing drafted")
    elif stats.target_passes and not stats.drafted_tokens:
        lines.append("no tokens drafted: the planner (--plan auto) found that speculation does not pay with "
                     "these step costs; --plan fixed forces it")
    elif stats.target_passes:
        lines.append(f"block efficiency {stats.block_efficiency:.2f} tokens/target pass, "
                     f"acceptance {stats.acceptance_rate:.1%} ({stats.accepted_tokens}/{stats.drafted_tokens} "
                     f"drafted), verifier {stats.verifier_share:.1%} of step time")
        hist = stats.accept_histogram
        if hist:
            total = sum(hist)
            lines.append("accepted per step:")
            for n, count in enumerate(hist):
                bar = "#" * round(30 * count / total) if total else ""
                lines.append(f"  {n:2d} | {bar} {count}")
        if stats.depth_limits:
            lines.append(depth_limits_line(stats.depth_limits))
        busy = stats.draft_seconds + stats.target_seconds + stats.verify_seconds
        if busy > 0 and one_token_seconds > 0:
            est = stats.generated_tokens * one_token_seconds / busy
            lines.append(f"speedup estimate vs target alone: {est:.2f}x (from the measured one-token step "
                         "cost; `localspec bench` measures it side by side)")
    return "\n".join(lines)


DEPTH_LIMIT_WORDS = {"context": "the context was nearly full", "max_tokens": "few tokens were left (max_tokens)",
                     "batch": "the target's batch size"}


def depth_limits_line(limits: Any) -> str:
    """Steps drafted less deep than --num-draft-tokens, and why (GenerationStats.depth_limits)."""
    parts = [f"{count} because {DEPTH_LIMIT_WORDS.get(reason, reason)}" for reason, count in limits]
    return f"draft depth below --num-draft-tokens on {sum(c for _, c in limits)} steps: " + ", ".join(parts)


def response_json(text: str, finish: str | None, stats: Any, model: str, config: GenerationConfig,
                  timings: dict | None = None, constraint_satisfied: bool | None = None,
                  tool_calls: list[dict] | None = None) -> dict:
    """The --json object; with a constraint, "constraint_satisfied" says whether the text is a
    complete answer of it (false: truncated); with tools, "tool_calls" (OpenAI's shape).
    "timings": where the call's time went (seconds: loads, prefill, decode, ...) and llama-server's
    timings of the generation (their own names and units: GenerationStats.timings)."""
    out = {"model": model, "text": text, "finish_reason": finish, "settings": config.options(),
           "usage": {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
                     "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}},
           "stats": stats.as_dict(), "timings": {**(timings or {}), **stats.timings()}}
    if config.constraint is not None:
        out["constraint_satisfied"] = bool(constraint_satisfied)
    if tool_calls is not None:
        out["tool_calls"] = tool_calls
    return out


def empty_json(model: str, config: GenerationConfig, prompt_tokens: int, resident: bool) -> dict:
    """The --json object of a call stopped before it generated anything."""
    return {"model": model, "text": "", "finish_reason": None, "settings": config.options(),
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0}, "stats": {}, "timings": {},
            "resident": resident}
