"""One meaning of "the target alone": nothing is drafted (num_draft_tokens 0, or the model drafter
without a draft model). `-d none` / `draft=None` only means no draft *model*: the n-gram drafter
still drafts. The same predicate decides the engine's drafters, the banners and the statistics."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from localspec.api import stream_generate
from localspec.cli import cli
from localspec.settings.generation import GenerationConfig
from localspec.decoding.drafters import NGramDrafter, make_drafters
from localspec.llama.model import Model
from localspec.cli.report import format_stats
from localspec.settings.generation import describe_speculation

REPEATS = "def add(a, b): return a + b. def add(a, b): return a + b. def add(a, b): return"


@pytest.mark.parametrize("options,has_draft,alone", [
    (dict(num_draft_tokens=0), True, True),
    (dict(num_draft_tokens=0), False, True),
    (dict(drafter="model"), False, True),
    (dict(drafter="model"), True, False),
    (dict(drafter="auto"), False, False),  # -d none with the default drafter: n-gram drafts
    (dict(drafter="ngram"), False, False),
])
def test_the_one_predicate(options: dict, has_draft: bool, alone: bool) -> None:
    assert GenerationConfig.from_options(**options).is_target_alone(has_draft) is alone


def test_engine_drafters_follow_it(tiny_target: Model, tiny_draft: Model) -> None:
    assert make_drafters(tiny_target, tiny_draft, GenerationConfig.from_options(num_draft_tokens=0)) == []
    assert make_drafters(tiny_target, None, GenerationConfig.from_options(drafter="model")) == []
    ngram_only = make_drafters(tiny_target, None, GenerationConfig.from_options(drafter="auto"))
    assert [type(d) for d in ngram_only] == [NGramDrafter]


def test_draft_none_still_drafts_from_the_context(tiny_target: Model) -> None:
    last = list(stream_generate(tiny_target, None, REPEATS, temperature=0, max_tokens=30, plan="fixed"))[-1]
    assert last.stats.drafted_tokens > 0
    alone = list(stream_generate(tiny_target, None, REPEATS, temperature=0, max_tokens=30, num_draft_tokens=0))[-1]
    assert alone.stats.drafted_tokens == 0


def test_words_say_what_drafts() -> None:
    assert describe_speculation(GenerationConfig.from_options(num_draft_tokens=0), "d") == \
        "the target alone (nothing drafted)"
    assert describe_speculation(GenerationConfig.from_options(drafter="model"), None) == \
        "the target alone (nothing drafted)"
    auto = describe_speculation(GenerationConfig.from_options(), None)
    assert auto.startswith("n-gram drafts from the context (no draft model)") and "verifier block" in auto
    assert "the draft model tiny where it pays" in describe_speculation(GenerationConfig.from_options(), "tiny")


def test_statistics_say_when_nothing_was_drafted(tiny_target: Model) -> None:
    last = list(stream_generate(tiny_target, None, "ab", temperature=0, max_tokens=5, num_draft_tokens=0))[-1]
    assert "the target alone: nothing drafted" in format_stats(last.stats, False)
    assert "nothing drafted" not in format_stats(last.stats, True).splitlines()[0]


def test_cli_stats_follow_the_predicate(tiny_paths: tuple[Path, Path]) -> None:
    target = str(tiny_paths[0])
    alone = CliRunner().invoke(cli, ["-m", target, "-d", "none", "--drafter", "model", "-u", "-n", "4", "-t", "0",
                                     "ab"])
    assert alone.exit_code == 0, alone.output
    assert "the target alone: nothing drafted" in alone.stderr
    ngram = CliRunner().invoke(cli, ["-m", target, "-d", "none", "-u", "-n", "4", "-t", "0", "ab"])
    assert ngram.exit_code == 0 and "the target alone" not in ngram.stderr


@pytest.mark.parametrize("drafter,named,expected", [
    ("ngram", False, (False, True)), ("ngram", True, (True, True)),  # a named draft kept for later requests
    ("auto", False, (True, True)), ("model", False, (True, False)), ("hybrid", True, (True, False)),
])
def test_one_rule_for_loading_the_draft(drafter: str, named: bool, expected: tuple[bool, bool]) -> None:
    from localspec.loading import draft_loading

    assert draft_loading(drafter, named) == expected
