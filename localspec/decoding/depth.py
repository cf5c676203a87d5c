"""How deep one step may draft: the user's ``num_draft_tokens``, cut in one place.

The user asks for at most ``num_draft_tokens`` draft levels a step (``--num-draft-tokens``/``-k``,
the keyword ``num_draft_tokens``, the server's request field; a tree's depth is its number of
branching factors); the shape (a chain, K paths, a tree) says how many nodes each level holds.
A step drafts fewer levels, for one of :data:`LIMITS`, where

* ``"context"``: the committed tokens and every draft node must fit the target's context (each
  node takes a KV cell; the last committed token is decoded with them);
* ``"max_tokens"``: a step yields its accepted tokens and one more, so it drafts at most one
  fewer than the tokens left to generate;
* ``"batch"``: one target decode takes the root and every node, at most the target's n_batch
  (chains and paths are cut to fit; a tree that does not fit is a ConfigError:
  :meth:`~localspec.settings.generation.GenerationConfig.check_fits`).

:func:`step_depth` is the only place that cuts the depth for these; the engine counts the steps
it cut, by reason, in its statistics (``GenerationStats.depth_limits``). Below that cap the
drafters offer what they have (a proposal's ``levels``, at most the cap) and the policy (the
planner, or ``--plan fixed``) picks a step's depth: choices, not limits, and not counted.

A leaf module (the shape is only read), so the engine and the benchmarks can import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localspec.settings.shape import Shape

LIMITS: tuple[str, ...] = ("context", "max_tokens", "batch")  # a tie names the first


def deepest(shape: Shape, cells: int) -> int:
    """The most levels of `shape` whose nodes fit in `cells` (0: none)."""
    if shape.n_nodes <= cells:
        return shape.depth
    if shape.branching is None:
        return max(0, cells // shape.paths)
    depth = shape.depth
    while depth > 0 and shape.truncated(depth).n_nodes > cells:
        depth -= 1
    return depth


def batch_depth(shape: Shape, n_batch: int) -> int:
    """The most levels of `shape` one target decode holds (the root and every node)."""
    return deepest(shape, n_batch - 1)


def step_depth(shape: Shape, remaining: int, context_left: int, n_batch: int) -> tuple[int, str | None]:
    """The most levels this step may draft, and why it is fewer than the shape's depth (the
    user's num_draft_tokens): one of LIMITS, the tightest; None when nothing cut it.
    `remaining`: tokens left to generate (at least 1); `context_left`: the context's cells left
    after the committed tokens (the last of them, the root, is not in the cache yet)."""
    caps = {"context": deepest(shape, context_left), "max_tokens": remaining - 1,
            "batch": batch_depth(shape, n_batch)}
    depth = max(0, min(shape.depth, *caps.values()))
    if depth >= shape.depth:
        return shape.depth, None
    return depth, next(reason for reason in LIMITS if caps[reason] <= depth)
