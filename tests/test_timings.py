"""llama-server's `timings` object (GenerationStats.timings): its names and units, by hand-worked
values, and the same object in `localspec --json`. A unit slip (seconds for milliseconds, a rate
inverted) is the negative control each check must catch. The server's responses:
tests/test_server.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from localspec.cli import cli
from localspec.decoding.stats import GenerationStats

# the field names of llama-server's result_timings::to_json (tools/server/server-task.cpp); the
# draft fields only when draft_n > 0
LLAMA_SERVER_FIELDS = ("cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                       "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second")
DRAFT_FIELDS = ("draft_n", "draft_n_accepted")

# 100 prompt tokens of which 20 cached, prefilled in 0.25 s; 50 generated in 2 s; 30 drafted, 20 accepted
STATS = GenerationStats(prompt_tokens=100, generated_tokens=50, target_passes=25, drafted_tokens=30,
                        accepted_tokens=20, prompt_seconds=0.25, elapsed_seconds=2.0, draft_seconds=0.3,
                        target_seconds=1.5, verify_seconds=0.1, accept_histogram=(5, 5, 5), cached_tokens=20)
WORKED = {"cache_n": 20, "prompt_n": 80, "prompt_ms": 250.0, "prompt_per_token_ms": 3.125,
          "prompt_per_second": 320.0, "predicted_n": 50, "predicted_ms": 2000.0, "predicted_per_token_ms": 40.0,
          "predicted_per_second": 25.0, "draft_n": 30, "draft_n_accepted": 20}


def mismatches(got: dict, want: dict) -> list[str]:
    """The fields where `got` differs from `want` (missing, extra, or another value)."""
    out = [f"{k}: {got.get(k)!r} != {v!r}" for k, v in want.items() if got.get(k) != pytest.approx(v)]
    return out + [f"{k}: unexpected" for k in got if k not in want]


_TIMINGS = GenerationStats.timings


def seconds_slip(self: GenerationStats) -> dict:
    """A broken timings: seconds where llama-server has milliseconds (the negative control)."""
    out = _TIMINGS(self)
    out["prompt_ms"], out["predicted_ms"] = self.prompt_seconds, self.elapsed_seconds
    return out


def test_the_fields_have_llama_servers_names_and_units() -> None:
    """Worked by hand: counts, milliseconds, milliseconds per token, tokens per second. Negative
    control: seconds for milliseconds are caught."""
    assert mismatches(STATS.timings(), WORKED) == []
    assert set(STATS.timings()) == set(LLAMA_SERVER_FIELDS + DRAFT_FIELDS)
    assert mismatches(seconds_slip(STATS), WORKED)


def test_the_draft_fields_only_when_something_was_drafted_and_no_infinities() -> None:
    """As llama-server: no draft fields without drafts. A generation of nothing in no time (all of
    the prompt cached) has rates of 0, never inf or NaN (JSON cannot carry them)."""
    alone = GenerationStats(10, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, (), cached_tokens=10)
    timings = alone.timings()
    assert set(timings) == set(LLAMA_SERVER_FIELDS)
    assert timings["prompt_n"] == 0 and timings["cache_n"] == 10
    assert all(timings[k] == 0.0 for k in ("prompt_per_token_ms", "prompt_per_second", "predicted_per_token_ms",
                                           "predicted_per_second"))
    json.dumps(timings, allow_nan=False)


def check_llama_timings(timings: dict, data: dict[str, Any]) -> list[str]:
    """What is wrong with the llama-server fields of a --json object (or a server response whose
    `speculative` holds the statistics): each against the statistics and usage beside it, in
    llama-server's units."""
    stats = data.get("stats") or data["speculative"]
    usage = data["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    prompt_tokens = usage["prompt_tokens"]
    want = {"cache_n": cached, "prompt_n": prompt_tokens - cached,
            "predicted_n": usage["completion_tokens"], "predicted_ms": 1e3 * stats["elapsed_seconds"],
            "predicted_per_second": stats["tokens_per_second"]}
    if stats["drafted_tokens"]:
        want.update(draft_n=stats["drafted_tokens"], draft_n_accepted=stats["accepted_tokens"])
    problems = [f"{k}: {timings.get(k)!r} != {v!r}" for k, v in want.items() if timings.get(k) != pytest.approx(v)]
    if timings.get("prompt_n"):
        per_token = timings["prompt_ms"] / timings["prompt_n"]
        if timings["prompt_per_token_ms"] != pytest.approx(per_token):
            problems.append("prompt_per_token_ms is not prompt_ms / prompt_n")
        if timings["prompt_per_second"] != pytest.approx(1e3 / per_token):
            problems.append("prompt_per_second is not 1000 prompt_n / prompt_ms")
    if timings.get("predicted_n") and timings["predicted_per_token_ms"] != pytest.approx(
            timings["predicted_ms"] / timings["predicted_n"]):
        problems.append("predicted_per_token_ms is not predicted_ms / predicted_n")
    missing = set(LLAMA_SERVER_FIELDS) - set(timings)
    return problems + [f"missing {sorted(missing)}"] * bool(missing)


def test_localspec_json_carries_them(tiny_paths: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`localspec --json`'s `timings`: llama-server's fields beside localspec's own seconds, the
    same numbers as its `stats` and `usage`. Negative control: a seconds slip is caught."""
    args = ["--json", "-m", str(tiny_paths[0]), "-d", str(tiny_paths[1]), "--ctx-size", "256", "-t", "0",
            "-n", "8", "--plan", "fixed", "--drafter", "model", "--raw", "def add(a, b):"]

    def run() -> dict:
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    data = run()
    timings = data["timings"]
    assert check_llama_timings(timings, data) == []
    assert timings["draft_n"] > 0  # the draft model drafted
    assert timings["decode"] == pytest.approx(timings["predicted_ms"] / 1e3)  # localspec's own, in seconds
    assert timings["prefill"] == pytest.approx(timings["prompt_ms"] / 1e3)
    assert "target_load" in timings and "command_started" in timings

    monkeypatch.setattr(GenerationStats, "timings", seconds_slip)
    slipped = run()
    assert any(p.startswith("predicted_ms") for p in check_llama_timings(slipped["timings"], slipped))
