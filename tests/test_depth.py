"""A step's draft depth is cut in one place (localspec.decoding.depth.step_depth), and every cut
below num_draft_tokens is said in the statistics (GenerationStats.depth_limits), by reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from localspec.api import stream_generate
from localspec.settings.models import ModelOptions
from localspec.settings.shape import Shape
from localspec.decoding.depth import LIMITS, batch_depth, step_depth
from localspec.decoding.stats import GenerationStats, combine
from localspec.llama.model import Model

from conftest import EXACT, load
from greedy import assert_greedy_equal

PROMPT = "def add(a, b): return a"
SHAPES = [Shape(0), Shape(1), Shape(6), Shape(32), Shape(4, paths=3), Shape.tree((3, 2, 1)), Shape.tree((2, 2, 1, 1))]


def old_depth(shape: Shape, remaining: int, room: int, n_batch: int) -> int:
    """The engine's depth before step_depth: the shape fitted to the batch (GenerationConfig.fitted),
    cut by max_tokens and the context's room, then node by node."""
    if shape.n_nodes + 1 > n_batch:
        shape = shape.truncated((n_batch - 1) // shape.paths)
    depth = min(shape.depth, remaining - 1, room)
    while depth > 0 and shape.truncated(depth).n_nodes > room:
        depth -= 1
    return depth


@pytest.mark.parametrize("shape", SHAPES, ids=[s.label for s in SHAPES])
def test_step_depth_is_the_depth_the_engine_drafted_before(shape: Shape) -> None:
    """Behaviour is unchanged: the same depth as the clamps it replaced, for every budget; a
    reason exactly when the depth is below the shape's (the user's num_draft_tokens)."""
    for remaining in (1, 2, 3, 5, 7, 40):
        for room in (0, 1, 2, 3, 5, 8, 9, 10, 15, 100):
            for n_batch in (16, 32, 512) if shape.branching is None else (512,):  # a tree must fit
                depth, reason = step_depth(shape, remaining, room, n_batch)
                assert depth == old_depth(shape, remaining, room, n_batch), (remaining, room, n_batch)
                assert (reason is None) == (depth == shape.depth)
                assert reason is None or reason in LIMITS


def test_step_depth_names_the_tightest_limit() -> None:
    k6 = Shape(6)
    assert step_depth(k6, 100, 100, 512) == (6, None)  # room everywhere: no limit (negative control)
    assert step_depth(k6, 3, 100, 512) == (2, "max_tokens")
    assert step_depth(k6, 100, 4, 512) == (4, "context")
    assert step_depth(k6, 100, 100, 5) == (4, "batch")
    assert step_depth(k6, 3, 4, 5) == (2, "max_tokens")
    assert step_depth(Shape(4, paths=3), 100, 7, 512) == (2, "context")  # 3 nodes a level
    assert step_depth(Shape.tree((3, 2, 1)), 100, 10, 512) == (2, "context")  # 3 + 6 nodes fit, 15 do not
    assert step_depth(Shape(0), 1, 0, 1) == (0, None)  # the target alone asked for nothing
    assert batch_depth(Shape(40), 32) == 31 and batch_depth(Shape(4, paths=3), 8) == 2


def test_combine_adds_the_limits() -> None:
    a = GenerationStats(5, 10, 4, 12, 6, 0.1, 1.0, 0.2, 0.6, 0.05, (1, 0, 3), depth_limits=(("max_tokens", 2),))
    b = GenerationStats(7, 6, 6, 0, 0, 0.2, 0.5, 0.0, 0.4, 0.01, (), depth_limits=(("context", 1), ("max_tokens", 1)))
    assert combine([a, b]).depth_limits == (("context", 1), ("max_tokens", 3))
    assert combine([]).depth_limits == ()


def _run(target: Model, draft: Model | None, **kw) -> tuple[list[int], list[GenerationStats]]:
    out = list(stream_generate(target, draft, PROMPT, temperature=0, plan="fixed", drafter="model", **kw))
    return [r.token for r in out if r.token is not None], [r.stats for r in out]


def test_near_max_tokens_drafts_less_and_says_so(tiny_target: Model, tiny_draft: Model) -> None:
    tokens, stats = _run(tiny_target, tiny_draft, max_tokens=3, num_draft_tokens=6)
    first = stats[0]
    assert first.target_passes == 1 and first.drafted_tokens == 2  # 3 tokens to go: 2 drafted, 1 drawn
    assert first.depth_limits == (("max_tokens", 1),)
    assert dict(stats[-1].depth_limits)["max_tokens"] == stats[-1].target_passes
    # negative control: with room, the first step drafts all 6 and reports no limit
    roomy, roomy_stats = _run(tiny_target, tiny_draft, max_tokens=40, num_draft_tokens=6)
    assert roomy_stats[0].drafted_tokens == 6 and roomy_stats[0].depth_limits == ()
    assert_greedy_equal(tiny_target, PROMPT, tokens, roomy[:3])


def test_near_the_end_of_the_context_drafts_less_and_says_so(tiny_paths: tuple[Path, Path]) -> None:
    with load(tiny_paths[0], n_ctx=32) as t, load(tiny_paths[1], n_ctx=32) as d:
        n_prompt = len(t.tokenize(PROMPT))
        tokens, stats = _run(t, d, max_tokens=500, num_draft_tokens=6)
        assert len(tokens) + n_prompt == t.n_ctx + 1  # ran to the end of the context
        assert stats[0].depth_limits == ()  # room at first (negative control)
        limits = dict(stats[-1].depth_limits)
        assert limits.get("context", 0) >= 1 and set(limits) == {"context"}
        # the steps near the end drafted fewer than 6: the drafts' total is below 6 a step
        last = stats[-1]
        assert last.drafted_tokens < 6 * last.target_passes


def test_a_small_batch_drafts_less_and_says_so(tiny_paths: tuple[Path, Path]) -> None:
    opts = ModelOptions(ctx_size=512, batch_size=8, n_seq_max=4, **EXACT)  # llama.cpp aborts on n_batch < n_seq_max
    with Model(tiny_paths[0], opts) as t, Model(tiny_paths[1], opts) as d:
        assert t.n_batch == 8
        _, stats = _run(t, d, max_tokens=40, num_draft_tokens=12)
        assert stats[0].drafted_tokens == 7 and stats[0].depth_limits == (("batch", 1),)
        _, fits = _run(t, d, max_tokens=40, num_draft_tokens=7)
        assert fits[0].drafted_tokens == 7 and fits[0].depth_limits == ()  # negative control
