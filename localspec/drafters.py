"""Drafters: propose a chain, K paths or a tree of tokens together with the distributions they
were actually drawn from (what makes verification lossless).

* :class:`ModelDrafter` samples from a draft model at the target's sampling settings
  (temperature-matched; temperature 0 drafts greedily, i.e. from one-hot rows);
* :class:`NGramDrafter` looks the context's suffix up in the context itself (prompt lookup) and
  proposes what followed last time; its rows are one-hot (deterministic proposals).

:func:`make_drafters` turns a drafter name into the drafters the engine tries in order
(``hybrid``: the n-gram proposal when there is one, else the model's).

A drafter keeps its own KV cache in step with the committed tokens: ``draft`` is called with
all committed tokens, ``commit`` with the verifier's accepted path.
"""

from __future__ import annotations

import logging
from typing import Protocol, Sequence

import numpy as np

from localspec import verifier
from localspec.config import SamplingParams, Shape
from localspec.errors import ConfigError
from localspec.model import Model, check_pair
from localspec.tree import DraftTree, leaf_ranges

log = logging.getLogger(__name__)


class Drafter(Protocol):
    """What the engine needs of a drafter."""

    kind: str  # the planner's name for its proposals: "model" (a draft-model pass per level) or "ngram" (free)
    model: Model | None  # the draft model it decodes with; None when its proposals cost no model pass

    def draft(self, tokens: Sequence[int], shape: Shape, sampling: SamplingParams,
              rng: np.random.Generator, without_replacement: bool) -> DraftTree: ...

    def commit(self, tokens: Sequence[int], tree: DraftTree, path: tuple[int, ...]) -> None: ...

    def start(self, prompt: Sequence[int]) -> None:
        """Prepare for a new prompt (reusing what the KV cache shares with it)."""

    def finish(self, tokens: Sequence[int]) -> None:
        """The generation ended cleanly with these committed tokens."""


class RowBuffer:
    """Preallocated draft rows; one-hot rows are reset entry by entry."""

    def __init__(self, n_rows: int, n_vocab: int) -> None:
        self.rows = np.zeros((n_rows, n_vocab), dtype=np.float32)
        self._one_hot: list[tuple[int, int]] = []

    def clear_one_hot(self) -> None:
        for r, x in self._one_hot:
            self.rows[r, x] = 0.0
        self._one_hot.clear()

    def one_hot(self, r: int, x: int) -> None:
        """Row r := one-hot at x (rows only ever hold one-hot entries, cleared by clear_one_hot)."""
        self.rows[r, x] = 1.0
        self._one_hot.append((r, x))


class ModelDrafter:
    """Draft with a second, smaller model sharing the target's vocabulary."""

    kind = "model"

    def __init__(self, draft: Model, n_vocab: int, max_nodes: int) -> None:
        self.model = draft
        self.n_vocab = n_vocab  # the target's: rows are padded or cut to it
        self.buf = RowBuffer(max_nodes + 1, n_vocab)
        self.n_past = 0  # committed tokens in the draft KV (sequence 0)
        self._branches = 1  # KV sequences the last draft used
        self._depth = 0  # its depth: nodes above it were decoded, leaves at it were not

    def start(self, prompt: Sequence[int]) -> None:
        self.n_past = self.model.reuse_prefix(prompt)

    def finish(self, tokens: Sequence[int]) -> None:
        self.model.kv_tokens = list(tokens[: self.n_past])

    def _fill_row(self, r: int, logits: np.ndarray, sampling: SamplingParams) -> np.ndarray:
        """Draft distribution of one logit row into buffer row r (float32, target vocab)."""
        row = self.buf.rows[r]
        v = min(self.n_vocab, logits.shape[-1])
        if v < self.n_vocab:
            row[v:] = 0.0
        verifier.probs(logits[:v], out=row[:v], sampling=sampling)
        return row

    def _catch_up(self, tokens: Sequence[int]) -> np.ndarray:
        """Decode the committed tokens the draft has not seen; the last one's logits."""
        pending = tokens[self.n_past:]
        if not pending:  # the root is always pending; re-decode it if not
            self.model.seq_rm(0, len(tokens) - 1, -1)
            self.n_past = len(tokens) - 1
            pending = tokens[self.n_past:]
        self.model.prefill(list(pending), self.n_past)
        self.n_past = len(tokens)
        return self.model.logits_array(1)[0]

    def draft(self, tokens: Sequence[int], shape: Shape, sampling: SamplingParams,
              rng: np.random.Generator, without_replacement: bool) -> DraftTree:
        self.buf.clear_one_hot()
        tree = DraftTree()
        root_logits = self._catch_up(tokens)
        self._branches = shape.n_leaves
        self._depth = shape.depth
        for s in range(1, self._branches):
            self.model.seq_cp(0, s)
        self._fill_row(0, root_logits, sampling)
        ranges = leaf_ranges(shape)
        base = len(tokens)  # position of depth-1 nodes
        level = [(-1, 0)]  # (node, structural index) of the previous level; -1 = root
        for depth in range(shape.depth):
            children_per = 1 if shape.branching is None else shape.branching[depth]
            new_level = []
            for parent, struct in level:
                count = shape.paths if (parent < 0 and shape.branching is None) else children_per
                row = self.buf.rows[parent + 1]
                taken: list[int] = []
                for i in range(count):
                    exclude = taken if without_replacement else ()
                    try:
                        x = verifier.sample_probs(row, float(rng.random()), exclude)
                    except verifier.VerifierError:
                        break  # no mass left for another distinct sibling
                    taken.append(x)
                    child_struct = struct * count + i if shape.branching is not None else (
                        i if parent < 0 else struct)
                    lo, hi = ranges[depth][child_struct]
                    node = tree.add(x, parent, tuple(range(lo, hi)))
                    new_level.append((node, child_struct))
            level = new_level
            if depth + 1 < shape.depth and level:  # decode this level to draft the next one
                nodes = [n for n, _ in level]
                self.model.decode([tree.tokens[n] for n in nodes], [base + depth] * len(nodes),
                                  [tree.seqs[n] for n in nodes], outputs="all")
                logits = self.model.logits_array(len(nodes))
                for i, n in enumerate(nodes):
                    self._fill_row(n + 1, logits[i], sampling)
        tree.probs = self.buf.rows[: tree.n + 1]
        return tree

    def commit(self, tokens: Sequence[int], tree: DraftTree, path: tuple[int, ...]) -> None:
        """Keep the accepted path in the draft KV; drop everything else.
        `tokens` are the committed tokens *before* this step's accepted ones were added."""
        decoded = sum(1 for j in path if tree.depths[j] < self._depth)  # leaves were never decoded
        keep = len(tokens) + decoded
        self.model.keep_branch(tree.branch_of(path), keep, self._branches)
        self.n_past = keep


class NGramDrafter:
    """Prompt lookup: find the longest recent n-gram (n_max down to n_min) equal to the context's
    suffix and propose the tokens that followed it. Chains only; one-hot rows."""

    kind = "ngram"
    model = None

    def __init__(self, n_vocab: int, max_nodes: int, n_min: int = 2, n_max: int = 4) -> None:
        self.buf = RowBuffer(max_nodes + 1, n_vocab)
        self.n_min, self.n_max = n_min, n_max
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # positions p < _indexed have their n-grams ending at p indexed

    def start(self, prompt: Sequence[int]) -> None:
        self._index.clear()  # rebuilt from the new context on the next lookup
        self._indexed = 0

    def finish(self, tokens: Sequence[int]) -> None:
        pass

    def _update_index(self, tokens: Sequence[int]) -> None:
        # n-grams that end right before position p map to p (the token that followed them)
        for p in range(max(self._indexed, 1), len(tokens)):
            for n in range(self.n_min, self.n_max + 1):
                if p - n >= 0:
                    self._index[tuple(tokens[p - n: p])] = p
        self._indexed = max(self._indexed, len(tokens))

    def lookup(self, tokens: Sequence[int], gamma: int) -> list[int]:
        self._update_index(tokens[:-1] if len(tokens) > 1 else tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(tokens) < n:
                continue
            p = self._index.get(tuple(tokens[-n:]))
            if p is not None:
                return list(tokens[p: p + gamma])
        return []

    def draft(self, tokens: Sequence[int], shape: Shape, sampling: SamplingParams,
              rng: np.random.Generator, without_replacement: bool) -> DraftTree:
        self.buf.clear_one_hot()
        tree = DraftTree()
        proposal = self.lookup(tokens, shape.depth)
        parent = -1
        for x in proposal:
            self.buf.one_hot(parent + 1, x)
            parent = tree.add(x, parent, (0,))
        tree.probs = self.buf.rows[: tree.n + 1]
        return tree

    def commit(self, tokens: Sequence[int], tree: DraftTree, path: tuple[int, ...]) -> None:
        pass


def make_drafters(target: Model, draft: Model | None, drafter: str, shape: Shape) -> list[Drafter]:
    """The drafters the engine tries in order for the setting `drafter` (none: the target alone).
    The model drafter without a draft model decodes with the target alone."""
    if shape.depth == 0:
        return []
    max_nodes = max(shape.n_nodes, 1)
    ngram = [NGramDrafter(target.n_vocab, max_nodes)] if drafter in ("ngram", "hybrid") else []
    if drafter == "ngram":
        return ngram
    if draft is None:
        if drafter == "hybrid":
            raise ConfigError("the hybrid drafter needs a draft model (-d/--draft); use --drafter ngram without one",
                              "drafter")
        return []
    check_pair(target, draft)
    return ngram + [ModelDrafter(draft, target.n_vocab, max_nodes)]
