"""The pair's state (localspec.decoding.state.PairState): one place commits a verified step to
the target, the draft model and the grammar, so the draft model's sequence always holds the
committed context, whoever drafted the step, and what it decodes is what a fresh run would."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from localspec.settings.generation import GenerationConfig
from localspec.decoding.drafters import ModelDrafter, make_drafters
from localspec.decoding.engine import Engine
from localspec.decoding.state import PairState
from localspec.llama.model import Model

from conftest import load

PROMPT = "def add(a, b): return a + b\n\ndef add(a, b): return a"


def _engine(target: Model, draft: Model, drafter: str) -> Engine:
    config = GenerationConfig.from_options(max_tokens=40, temperature=0, drafter=drafter, plan="fixed",
                                           num_draft_tokens=3, seed=0)
    return Engine(target, make_drafters(target, draft, config), config)


def _check_draft_in_step(engine: Engine, draft: Model, tiny_paths: tuple[Path, Path]) -> int:
    """Run the engine to its end, checking after every step that the draft model's sequence holds
    the committed context and its cache a prefix of it; returns the steps a model drafted."""
    model_steps = 0
    while engine.step():
        seq = draft.sequence
        assert seq.tokens == engine.tokens, "the draft model's context is not the committed one"
        assert seq.n_cached <= len(seq.tokens)
        model_steps += engine.stats().drafted_tokens > 0
    # what it has not decoded yet, it decodes now: the logits of the context as a fresh run's
    seq = draft.sequence
    seq.redecode_last()
    seq.fill()
    with load(tiny_paths[1]) as fresh:
        fresh.prefill(list(engine.tokens), 0)
        np.testing.assert_allclose(seq.model.logits_array(1)[0], fresh.logits_array(1)[0], rtol=0, atol=1e-4)
    return model_steps


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_the_draft_model_holds_the_committed_context_after_every_step(tiny_target: Model, tiny_draft: Model,
                                                                      tiny_paths: tuple[Path, Path],
                                                                      drafter: str) -> None:
    """Model drafts, n-gram drafts (hybrid: the prompt repeats itself) and steps without a draft:
    the draft model is told every committed token."""
    engine = _engine(tiny_target, tiny_draft, drafter)
    engine.start(tiny_target.tokenize(PROMPT))
    assert _check_draft_in_step(engine, tiny_draft, tiny_paths) > 0
    engine.finish()


def test_negative_control_a_state_that_skips_the_draft_is_caught(tiny_target: Model, tiny_draft: Model,
                                                                 tiny_paths: tuple[Path, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check fails for a state that commits to the target only."""
    def target_only(self: PairState, draft, path, new) -> None:  # type: ignore[no-untyped-def]
        before = len(self.tokens)
        self.target.commit(new)
        self.target.keep_branch(draft.tree.branch_of(path), before + len(path))

    monkeypatch.setattr(PairState, "accept", target_only)
    engine = _engine(tiny_target, tiny_draft, "model")
    engine.start(tiny_target.tokenize(PROMPT))
    with pytest.raises(AssertionError, match="not the committed one"):
        _check_draft_in_step(engine, tiny_draft, tiny_paths)
    engine.close()


def test_the_forced_drafter_is_given_its_grammar(tiny_target: Model, tiny_draft: Model) -> None:
    """A constrained generation's engine puts the grammar's forced tokens first, bound to the
    grammar when made (nothing bound later by call order)."""
    config = GenerationConfig.from_options(max_tokens=8, temperature=0, regex="[a-z]{3}", num_draft_tokens=4)
    engine = Engine(tiny_target, make_drafters(tiny_target, tiny_draft, config), config)
    first = engine.drafters[0]
    assert first.kind == "forced" and first.grammar is engine.structured.follower  # type: ignore[attr-defined]
    assert isinstance(engine.state.draft_drafter, ModelDrafter)
    engine.close()
