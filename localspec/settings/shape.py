"""What to draft per step (:class:`Shape`): a chain, K paths or a tree, parsed from every
spelling by :meth:`Shape.parse`. A leaf: the standard library and the shared checks."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from localspec.settings.validation import as_int, is_int, require, show

MAX_DRAFT_TOKENS = 64  # draft depth
MAX_PATHS = 16
MAX_BRANCHING = 16  # children per node at one depth
MAX_BRANCHES = 64  # root-to-leaf paths of one draft (KV sequences)

SHAPE_SYNTAX = ("kN (a chain of N draft tokens), pKkN (K paths of N tokens), "
                "AxBx.. or tAxBx.. (a tree: A children at depth 1, B at depth 2, ...)")
# ASCII digits only (\d takes other scripts' digits too)
_SHAPE_RE = re.compile(r"^(?:k([0-9]+)|p([0-9]+)k([0-9]+)|t?([0-9]+(?:[x,][0-9]+)*))$")
_MAX_SHAPE_CHARS = 1024


def _shape_int(digits: str, param: str) -> int:
    """A number of a shape's spelling; never a parse of a huge string (Python refuses an int of
    over 4300 digits), and no number past what the limits hold."""
    require(len(digits) <= 9, param, f"{digits:.20}{'...' if len(digits) > 20 else ''} is too large for {param}")
    return int(digits)


@dataclass(frozen=True)
class Shape:
    """chain: paths 1, no branching; K paths: paths K; tree: a branching factor per depth.
    `depth` is the user's num_draft_tokens (a tree's: its number of branching factors), the most
    levels a step drafts; localspec.decoding.depth.step_depth cuts it where a step must draft fewer."""

    depth: int
    paths: int = 1
    branching: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "depth", as_int(self.depth))
        object.__setattr__(self, "paths", as_int(self.paths))
        if self.branching is not None:
            b = tuple(as_int(x) for x in self.branching)
            require(all(is_int(x) and 1 <= x <= MAX_BRANCHING for x in b) and bool(b), "tree",
                    f"tree branching factors must be integers in [1, {MAX_BRANCHING}], got {show(list(b))}")
            require(len(b) <= MAX_DRAFT_TOKENS, "tree",
                    f"a draft tree has at most {MAX_DRAFT_TOKENS} levels, got {len(b)}")
            require(self.paths == 1, "tree", "use either paths or tree, not both")
            object.__setattr__(self, "branching", b)
            object.__setattr__(self, "depth", len(b))
        require(is_int(self.depth) and 0 <= self.depth <= MAX_DRAFT_TOKENS, "num_draft_tokens",
                f"num_draft_tokens must be an integer in [0, {MAX_DRAFT_TOKENS}], got {show(self.depth)}")
        require(is_int(self.paths) and 1 <= self.paths <= MAX_PATHS, "paths",
                f"paths must be an integer in [1, {MAX_PATHS}], got {show(self.paths)}")
        require(self.n_leaves <= MAX_BRANCHES, "tree",
                f"the draft {self.describe()} has {self.n_leaves} branches; at most {MAX_BRANCHES} fit")

    @classmethod
    def chain(cls, num_draft_tokens: int) -> Shape:
        return cls(depth=num_draft_tokens)

    @classmethod
    def k_paths(cls, paths: int, num_draft_tokens: int) -> Shape:
        return cls(depth=num_draft_tokens, paths=paths)

    @classmethod
    def tree(cls, branching: Sequence[int]) -> Shape:
        return cls(depth=len(branching), branching=tuple(branching))

    @classmethod
    def parse(cls, value: str | Sequence[int]) -> Shape:
        """Every spelling: "k4" (chain), "p3k4" (3 paths of 4), "t3x2x1", "3x2x1", "3,2,1" or
        [3, 2, 1] (a tree)."""
        if isinstance(value, (bytes, bytearray)):
            value = value.decode("ascii", "replace")
        if not isinstance(value, str):
            items = list(value) if isinstance(value, (list, tuple)) else []
            require(bool(items) and all(is_int(b) for b in items), "tree",
                    f"a draft tree is a list of branching factors such as [3, 2, 1], got {show(value)}")
            require(len(items) <= MAX_DRAFT_TOKENS, "tree",
                    f"a draft tree has at most {MAX_DRAFT_TOKENS} levels, got {len(items)}")
            return cls.tree(tuple(int(b) for b in items))
        m = _SHAPE_RE.match(value.strip().lower()) if len(value) <= _MAX_SHAPE_CHARS else None
        require(m is not None, "tree", f"{show(value)} is not a draft shape; use {SHAPE_SYNTAX}")
        assert m is not None
        if m.group(1) is not None:
            return cls.chain(_shape_int(m.group(1), "num_draft_tokens"))
        if m.group(2) is not None:
            return cls.k_paths(_shape_int(m.group(2), "paths"), _shape_int(m.group(3), "num_draft_tokens"))
        levels = re.split(r"[x,]", m.group(4))
        require(len(levels) <= MAX_DRAFT_TOKENS, "tree",
                f"a draft tree has at most {MAX_DRAFT_TOKENS} levels, got {len(levels)}")
        return cls.tree(tuple(_shape_int(b, "tree") for b in levels))

    @property
    def n_nodes(self) -> int:
        if self.branching is None:
            return self.paths * self.depth
        total, width = 0, 1
        for b in self.branching:
            width *= b
            total += width
        return total

    @property
    def n_leaves(self) -> int:
        return math.prod(self.branching) if self.branching is not None else self.paths

    @property
    def is_chain(self) -> bool:
        return self.paths == 1 and (self.branching is None or all(b == 1 for b in self.branching))

    @property
    def num_draft_tokens(self) -> int:
        return self.depth

    def truncated(self, depth: int) -> Shape:
        """The same shape cut to at most `depth` levels (near the end of the context/budget)."""
        depth = max(0, min(depth, self.depth))
        if self.branching is not None:
            return Shape(0) if depth == 0 else Shape.tree(self.branching[:depth])
        return Shape(depth=depth, paths=self.paths)

    @property
    def label(self) -> str:
        """The compact spelling Shape.parse reads back: k4, p3k4, t3x2x1."""
        if self.branching is not None:
            return "t" + "x".join(map(str, self.branching))
        return f"p{self.paths}k{self.depth}" if self.paths > 1 else f"k{self.depth}"

    def describe(self) -> str:
        if self.branching is not None:
            return "tree " + "x".join(str(b) for b in self.branching)
        return f"{self.paths}x{self.depth} paths" if self.paths > 1 else f"chain {self.depth}"
