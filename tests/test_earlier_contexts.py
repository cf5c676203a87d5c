"""Earlier contexts (localspec.llama.sequence, localspec.llama.prompt_cache): the KV cache holds the
current context only, with no other sequence left after a call (a held one would widen every later
call's attention); a document asked about again after other prompts came between comes back from
the prompt cache's memory, or from the slot's own memory of parked contexts, with no prefill of it
and the output unchanged. The model has one slot here: with several, an idle slot keeps its
context in its cells (tests/test_scheduler.py)."""

from __future__ import annotations

from pathlib import Path

import llama_cpp as lc
import pytest

from localspec.api import stream_generate
from localspec.llama.model import Model
from localspec.llama.prompt_cache import PromptCache

from conftest import load
from greedy import assert_greedy_text

DOC = " ".join(f"item {i} costs {i * 7 % 13} coins and weighs {i * 5 % 11} grams;" for i in range(20))
QUESTIONS = ("\nWhich item is the heaviest?", "\nWhich item is the cheapest?")
OTHER = "Something else entirely: a short poem about the sea, please."


def ask(model: Model, prompt: str, draft: Model | None = None, **kw: object) -> tuple[str, int]:
    """The greedy answer and how many prompt tokens the cache held already."""
    kw.setdefault("prompt_cache", False)
    kw.setdefault("num_draft_tokens", 0)
    runs = list(stream_generate(model, draft, prompt, temperature=0, max_tokens=12, **kw))
    return "".join(r.text for r in runs), runs[-1].stats.cached_tokens


def sequences_in_use(model: Model) -> list[int]:
    """The KV sequences that hold cells (llama_memory_seq_pos_max is -1 for an empty one)."""
    mem = lc.llama_get_memory(model._ctx)
    return [s for s in range(model.options.n_seq_max) if lc.llama_memory_seq_pos_max(mem, s) >= 0]


@pytest.fixture()
def model(tiny_paths: tuple[Path, Path]) -> Model:
    with load(tiny_paths[0], n_ctx=1024, n_seq_max=4, parallel=1) as m:
        yield m


def test_only_the_current_context_stays_in_the_cache(model: Model, tiny_draft: Model) -> None:
    """After a document, another prompt and a tree step (sequences 0..3 in use during the step),
    the cache holds sequence 0 alone."""
    ask(model, DOC + QUESTIONS[0])
    ask(model, OTHER)
    assert sequences_in_use(model) == [0]
    runs = list(stream_generate(model, tiny_draft, OTHER, temperature=1, seed=1, max_tokens=24,
                                verifier="traversal", tree=(2, 2), drafter="model", plan="fixed",
                                prompt_cache=False))
    assert runs[-1].stats.drafted_tokens > 2 * runs[-1].stats.target_passes
    assert sequences_in_use(model) == [0]


def test_negative_control_a_forked_cache_shows_its_sequences(model: Model) -> None:
    ask(model, OTHER)
    model.seq_cp(0, 2)
    assert sequences_in_use(model) == [0, 2]


def test_a_document_asked_again_comes_back_from_memory(model: Model, tmp_path: Path) -> None:
    """Negative control: with the prompt cache off, the same follow-up prefills the document."""
    cache = PromptCache(tmp_path, memory=64 << 20)
    ask(model, DOC + QUESTIONS[0], prompt_cache=cache)
    ask(model, OTHER, prompt_cache=cache)
    cache.clear()  # the disk entries are gone: what follows comes from memory
    text, cached = ask(model, DOC + QUESTIONS[1], prompt_cache=cache)
    doc_tokens = len(model.tokenize(DOC))
    assert cached >= doc_tokens - 2, (cached, doc_tokens)
    assert_greedy_text(model, DOC + QUESTIONS[1], text, 12)  # the output of a fresh run


def test_without_the_prompt_cache_the_document_comes_back_from_the_slots_memory(model: Model) -> None:
    """The slot's context, about to be overwritten by an unrelated prompt, is parked in memory
    (as llama-server keeps such a slot's prompt) and comes back for the follow-up."""
    ask(model, DOC + QUESTIONS[0])
    ask(model, OTHER)
    text, cached = ask(model, DOC + QUESTIONS[1])
    assert cached >= len(model.tokenize(DOC)) - 2
    assert_greedy_text(model, DOC + QUESTIONS[1], text, 12)


def test_negative_control_with_no_memory_for_parked_contexts_the_document_is_prefilled(model: Model) -> None:
    ask(model, DOC + QUESTIONS[0])
    model.scheduler.parked.limit = 0
    ask(model, OTHER)
    _, cached = ask(model, DOC + QUESTIONS[1])
    assert cached < 10
