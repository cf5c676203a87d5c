"""Drafters: propose a chain, K paths or a tree of tokens together with the distributions they
were actually drawn from (what makes verification lossless).

* :class:`ModelDrafter` samples from a draft model at the target's sampling settings
  (temperature-matched; temperature 0 drafts greedily, i.e. from one-hot rows);
* :class:`NGramDrafter` looks the context up in itself (prompt lookup over the whole context)
  and proposes what followed the longest match; its rows are one-hot (deterministic proposals).

:func:`make_drafters` turns a drafter name into the drafters the engine considers each step.

A drafter keeps its own KV cache in step with the committed tokens: ``draft`` is called with
all committed tokens, ``commit`` with the verifier's accepted path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from localspec import verifier
from localspec.config import GenerationConfig, SamplingParams, Shape
from localspec.errors import ConfigError
from localspec.lookup import ContextLookup, Proposal
from localspec.model import Model
from localspec.pairing import LazyModel, check_lazy_pair, check_pair
from localspec.profiles import Profiles, key_of
from localspec.tree import DraftTree, leaf_ranges

log = logging.getLogger(__name__)


class Drafter(Protocol):
    """What the engine needs of a drafter."""

    kind: str  # "model" (a draft-model pass per level) or "ngram" (free proposals)
    source: Model | LazyModel | None  # the draft model it decodes with; None: its proposals cost nothing
    loaded: bool  # False: using it would load the draft model first

    def plan(self, tokens: Sequence[int], max_depth: int) -> tuple[str, int]:
        """The acceptance kind of what it would propose now, and how many levels it can offer."""

    def lag(self, tokens: Sequence[int]) -> int:
        """Committed tokens it would have to decode before drafting (a draft model's catch-up)."""

    def draft(self, tokens: Sequence[int], shape: Shape, sampling: SamplingParams,
              rng: np.random.Generator, without_replacement: bool) -> DraftTree: ...

    def commit(self, tokens: Sequence[int], tree: DraftTree, path: tuple[int, ...]) -> None: ...

    def start(self, prompt: Sequence[int]) -> None:
        """Prepare for a new prompt (reusing what the KV cache shares with it)."""

    def finish(self, tokens: Sequence[int]) -> None:
        """The generation ended cleanly with these committed tokens."""


@dataclass
class DraftTiming:
    """What a model drafter's last draft cost: (tokens, seconds) of its catch-up and (levels,
    seconds) of its draft levels."""

    catch_up: tuple[int, float] = (0, 0.0)
    levels: tuple[int, float] = (0, 0.0)


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
    """Draft with a second, smaller model sharing the target's vocabulary. The model may be a
    LazyModel, loaded (and checked against the target) on the first draft."""

    kind = "model"

    def __init__(self, source: Model | LazyModel, target: Model, max_nodes: int) -> None:
        self.source = source
        self.target = target
        self.n_vocab = target.n_vocab  # rows are padded or cut to the target's vocabulary
        self.buf = RowBuffer(max_nodes + 1, self.n_vocab)
        self.n_past = 0  # committed tokens in the draft KV (sequence 0)
        self._branches = 1  # KV sequences the last draft used
        self._depth = 0  # its depth: nodes above it were decoded, leaves at it were not
        self._prompt: Sequence[int] = ()
        self.timing = DraftTiming()

    @property
    def loaded(self) -> bool:
        return not isinstance(self.source, LazyModel) or self.source.loaded

    @property
    def model(self) -> Model:
        if isinstance(self.source, LazyModel):
            if not self.source.loaded:
                model = self.source.get()
                check_pair(self.target, model)
                self.n_past = model.reuse_prefix(self._prompt) if self._prompt else 0
            return self.source.get()
        return self.source

    def lag(self, tokens: Sequence[int]) -> int:
        """Committed tokens the draft model would have to decode before it can draft."""
        return len(tokens) - self.n_past if self.loaded else len(tokens)

    def plan(self, tokens: Sequence[int], max_depth: int) -> tuple[str, int]:
        return f"{self.kind}:{key_of(self.source.identity)[:8]}", max_depth  # acceptance is per pair

    def start(self, prompt: Sequence[int]) -> None:
        self._prompt = prompt
        self.n_past = self.model.reuse_prefix(prompt) if self.loaded else 0

    def finish(self, tokens: Sequence[int]) -> None:
        if self.loaded:
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
        model = self.model
        pending = tokens[self.n_past:]
        if not pending:  # the root is always pending; re-decode it if not
            model.seq_rm(0, len(tokens) - 1, -1)
            self.n_past = len(tokens) - 1
            pending = tokens[self.n_past:]
        t0 = time.perf_counter()
        model.prefill(list(pending), self.n_past)
        self.timing.catch_up = (len(pending), time.perf_counter() - t0)
        self.n_past = len(tokens)
        return model.logits_array(1)[0]

    def draft(self, tokens: Sequence[int], shape: Shape, sampling: SamplingParams,
              rng: np.random.Generator, without_replacement: bool) -> DraftTree:
        self.buf.clear_one_hot()
        tree = DraftTree()
        root_logits = self._catch_up(tokens)
        t0 = time.perf_counter()
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
        self.timing.levels = (shape.depth, time.perf_counter() - t0)
        return tree

    def commit(self, tokens: Sequence[int], tree: DraftTree, path: tuple[int, ...]) -> None:
        """Keep the accepted path in the draft KV; drop everything else.
        `tokens` are the committed tokens *before* this step's accepted ones were added."""
        decoded = sum(1 for j in path if tree.depths[j] < self._depth)  # leaves were never decoded
        keep = len(tokens) + decoded
        self.model.keep_branch(tree.branch_of(path), keep, self._branches)
        self.n_past = keep


def ngram_kind(proposal: Proposal) -> str:
    """The planner's acceptance kind of an n-gram proposal."""
    return f"{NGramDrafter.kind}:{proposal.kind}"


class NGramDrafter:
    """Prompt lookup over the whole context (localspec.lookup): the continuation of the longest
    earlier match, re-aligned after the output replaced a source token. Chains only; one-hot
    rows (deterministic proposals). Its planning kind is the proposal's match-length bucket."""

    kind = "ngram"
    source = None
    loaded = True

    def __init__(self, n_vocab: int, max_nodes: int) -> None:
        self.buf = RowBuffer(max_nodes + 1, n_vocab)
        self.lookup = ContextLookup()
        self._proposal: Proposal | None = None

    def start(self, prompt: Sequence[int]) -> None:
        self.lookup.reset()

    def finish(self, tokens: Sequence[int]) -> None:
        pass

    def lag(self, tokens: Sequence[int]) -> int:
        return 0

    def plan(self, tokens: Sequence[int], max_depth: int) -> tuple[str, int]:
        """The acceptance kind of the current proposal and its length (0: none)."""
        self._proposal = self.lookup.propose(tokens, max_depth)
        if self._proposal is None:
            return self.kind, 0
        return ngram_kind(self._proposal), len(self._proposal.tokens)

    def draft(self, tokens: Sequence[int], shape: Shape, sampling: SamplingParams,
              rng: np.random.Generator, without_replacement: bool) -> DraftTree:
        self.buf.clear_one_hot()
        tree = DraftTree()
        proposal = self._proposal if self._proposal is not None else self.lookup.propose(tokens, shape.depth)
        parent = -1
        for x in (proposal.tokens[: shape.depth] if proposal else ()):
            self.buf.one_hot(parent + 1, x)
            parent = tree.add(x, parent, (0,))
        tree.probs = self.buf.rows[: tree.n + 1]
        return tree

    def commit(self, tokens: Sequence[int], tree: DraftTree, path: tuple[int, ...]) -> None:
        pass  # the lookup reads what was accepted from the context at the next proposal


def make_drafters(target: Model, draft: Model | LazyModel | None, config: GenerationConfig,
                  profiles: Profiles | None = None) -> list[Drafter]:
    """The drafters the engine considers for the setting `drafter` (none where
    GenerationConfig.is_target_alone: the target alone): auto: the n-gram lookup, and the draft
    model when one is given (the planner loads and uses it only where it pays); ngram; model;
    hybrid. A lazy draft's vocabulary check is kept in `profiles` (None: checked every time)."""
    drafter, shape = config.drafter, config.shape
    if config.is_target_alone(draft is not None):
        return []
    max_nodes = max(shape.n_nodes, 1)
    ngram: list[Drafter] = [NGramDrafter(target.n_vocab, max_nodes)] if drafter != "model" else []
    if drafter == "ngram":
        return ngram
    if draft is None:
        if drafter == "hybrid":
            raise ConfigError("the hybrid drafter needs a draft model (-d/--draft); use --drafter ngram without one",
                              "drafter")
        return ngram
    if drafter != "auto" and isinstance(draft, LazyModel):
        draft = draft.get()  # asked for by name: loaded whether or not it pays
    if isinstance(draft, Model):
        check_pair(target, draft)
    else:
        check_lazy_pair(target, draft, Profiles.in_memory() if profiles is None else profiles)
    return ngram + [ModelDrafter(draft, target, max_nodes)]
