"""Earlier contexts held in the KV cache (localspec.llama.sequence: KVSequence.held): a document
asked about again after other prompts came between is taken back with no prefill and no prompt
cache, the output unchanged; held contexts give way to a step's branches and to a batch the cache
has no room for."""

from __future__ import annotations

from pathlib import Path

import pytest

from localspec.api import stream_generate
from localspec.llama import sequence
from localspec.llama.model import Model

from conftest import load
from greedy import assert_greedy_text

DOC = " ".join(f"item {i} costs {i * 7 % 13} coins and weighs {i * 5 % 11} grams;" for i in range(20))
QUESTIONS = ("\nWhich item is the heaviest?", "\nWhich item is the cheapest?")


def ask(model: Model, prompt: str, **kw: object) -> tuple[str, int]:
    """The greedy answer and how many prompt tokens the cache held already."""
    runs = list(stream_generate(model, None, prompt, temperature=0, max_tokens=12, prompt_cache=False,
                                num_draft_tokens=0, **kw))
    return "".join(r.text for r in runs), runs[-1].stats.cached_tokens


@pytest.fixture()
def model(tiny_paths: tuple[Path, Path]) -> Model:
    with load(tiny_paths[0], n_ctx=1024) as m:
        yield m


def test_a_document_asked_again_after_other_prompts_is_taken_back(model: Model) -> None:
    """Negative control: with no context held (HELD = 0), the same follow-up prefills the document."""
    ask(model, DOC + QUESTIONS[0])
    ask(model, "Something else entirely: a short poem about the sea, please.")
    assert model.sequence.held  # the document's context is held
    text, cached = ask(model, DOC + QUESTIONS[1])
    doc_tokens = len(model.tokenize(DOC))
    assert cached >= doc_tokens - 2, (cached, doc_tokens)
    assert_greedy_text(model, DOC + QUESTIONS[1], text, 12)  # the output of a fresh run


def test_without_held_contexts_the_document_is_prefilled(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sequence, "HELD", 0)
    model.clear()
    ask(model, DOC + QUESTIONS[0])
    ask(model, "Something else entirely: a short poem about the sea, please.")
    assert not model.sequence.held
    _, cached = ask(model, DOC + QUESTIONS[1])
    assert cached < 10


def test_a_tree_takes_the_sequences_it_needs(tiny_paths: tuple[Path, Path], tiny_draft: Model) -> None:
    """A model with four sequences: a held context in sequence 3 gives way to a tree of four
    branches (sequences 0..3, distinct children: sampled); a chain leaves it (the control)."""
    with load(tiny_paths[0], n_ctx=1024, n_seq_max=4) as m:
        ask(m, DOC + QUESTIONS[0])
        ask(m, "Something else entirely: a short poem about the sea, please.")
        assert 3 in m.sequence.held
        chain = list(stream_generate(m, tiny_draft, "Something else again:", temperature=0, max_tokens=12,
                                     drafter="model", plan="fixed", num_draft_tokens=3, prompt_cache=False))
        assert chain[-1].stats.drafted_tokens > 0 and 3 in m.sequence.held
        runs = list(stream_generate(m, tiny_draft, "Something else again:", temperature=1, seed=1, max_tokens=24,
                                    verifier="traversal", tree=(2, 2), drafter="model", plan="fixed",
                                    prompt_cache=False))
        assert runs[-1].stats.drafted_tokens > 2 * runs[-1].stats.target_passes and 3 not in m.sequence.held


def test_held_contexts_give_way_to_a_batch_with_no_room(tiny_paths: tuple[Path, Path]) -> None:
    """A cache of 256 cells holding an earlier document: a prompt and answer that need its cells
    take them (the held context goes) instead of failing with "the context is full"."""
    with load(tiny_paths[0], n_ctx=256) as m:
        doc = DOC[:200]
        assert 100 < len(m.tokenize(doc)) < 200
        ask(m, doc + QUESTIONS[0])
        ask(m, "x")
        assert m.sequence.held
        long_prompt = "Another document: " + " ".join(f"line {i} says hi;" for i in range(12))
        assert 100 < len(m.tokenize(long_prompt)) < 180
        runs = list(stream_generate(m, None, long_prompt, temperature=0, max_tokens=60, prompt_cache=False,
                                    num_draft_tokens=0))
        assert runs[-1].stats.generated_tokens == 60 or runs[-1].finish_reason == "stop"
        assert not m.sequence.held


def test_negative_control_held_contexts_that_never_give_way_fill_the_cache(tiny_paths: tuple[Path, Path],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from localspec.errors import ContextFull

    monkeypatch.setattr(sequence.KVSequence, "_room", lambda self, decode: decode())
    with load(tiny_paths[0], n_ctx=256) as m:
        ask(m, DOC[:200] + QUESTIONS[0])
        ask(m, "x")
        long_prompt = "Another document: " + " ".join(f"line {i} says hi;" for i in range(12))
        with pytest.raises(ContextFull):
            list(stream_generate(m, None, long_prompt, temperature=0, max_tokens=60, prompt_cache=False,
                                 num_draft_tokens=0))
