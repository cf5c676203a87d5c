"""Drafters: propose a chain, K paths or a tree of tokens together with the distributions they
were actually drawn from (what makes verification lossless).

* :class:`ModelDrafter` samples from a draft model at the target's sampling settings
  (temperature-matched; temperature 0 drafts greedily, i.e. from one-hot rows);
* :class:`NGramDrafter` looks the context up in itself (prompt lookup over the whole context)
  and proposes what followed the longest match; its rows are one-hot (deterministic proposals);
* :class:`ForcedDrafter` (constrained generations) proposes the tokens the grammar forces.

:func:`make_drafters` turns a drafter name into the drafters the engine considers each step.

Each step the engine asks every drafter to :meth:`~Drafter.propose` (a :class:`DraftProposal`:
its acceptance kind, how many levels it offers, what it must decode first), the policy picks
one (localspec.decoding.policy), and the engine passes that proposal back to its drafter's
:meth:`~Drafter.draft`, which returns a :class:`~localspec.decoding.state.Draft`: the tree and
what committing it needs. The pair's state (localspec.decoding.state.PairState) commits a
verified step to every cache; drafters keep nothing between steps but the n-gram lookup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from localspec.decoding import passes
from localspec.decoding.history import History, HistoryMatch, history_kind
from localspec.decoding.lookup import ContextLookup, Proposal
from localspec.decoding.pairing import check_lazy_pair, check_pair
from localspec.decoding.passes import Steps
from localspec.decoding.profiles import Profiled
from localspec.decoding.state import Draft, PairState
from localspec.decoding.tree import DraftTree, leaf_ranges
from localspec.errors import ConfigError
from localspec.llama.host import key_of
from localspec.llama.lazy import LazyModel
from localspec.llama.model import Model
from localspec.settings.generation import GenerationConfig
from localspec.settings.sampling import SamplingParams
from localspec.settings.shape import Shape
from localspec.verify import verifier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftProposal:
    """What a drafter offers at one step, passed from :meth:`Drafter.propose` through the planner
    to :meth:`Drafter.draft`."""

    drafter: Drafter
    kind: str  # the planner's acceptance kind
    levels: int  # draft levels it can offer (at most the step's depth, what propose was asked for)
    lag: int = 0  # committed tokens it must decode before drafting (a draft model's catch-up)
    tokens: tuple[int, ...] = ()  # a deterministic proposal's tokens (n-gram); empty: drawn when drafting


class RowMasks(Protocol):
    """The token masks of a constrained generation's draft rows (localspec.decoding.grammar.steps.StepMasks)."""

    def row(self, tree: DraftTree, node: int) -> np.ndarray:
        """The uint32 mask row of the tokens allowed after `node` of `tree` (-1: after the committed
        tokens): where its children may be drawn from."""


class Drafter(Protocol):
    """What the engine and the planner need of a drafter."""

    kind: str  # "model" (a draft-model pass per level) or "ngram" (free proposals)

    @property
    def source(self) -> Profiled | None:
        """The draft model it decodes with; None: its proposals cost nothing."""

    @property
    def loaded(self) -> bool:
        """False: drafting would load the draft model first."""

    def start(self, prompt: Sequence[int]) -> None:
        """Prepare for a new prompt."""

    def propose(self, context: Sequence[int], depth: int) -> DraftProposal | None:
        """What it can draft now after the committed `context`, at most `depth` levels (the step's
        cap: localspec.decoding.depth.step_depth; None: nothing)."""

    def draft(self, proposal: DraftProposal, state: PairState, shape: Shape, sampling: SamplingParams,
              rng: np.random.Generator, without_replacement: bool,
              masks: RowMasks | None = None) -> Draft | Steps[Draft]:
        """The draft of `shape` for its own `proposal`, with the rows it was drawn from (a drafter
        that decodes returns a generator of its decode requests: localspec.decoding.passes). With
        `masks` (a constrained generation), a drafter that samples draws from its masked
        distributions; a fixed proposal is already cut at its first forbidden token."""


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
        self.acceptance_kind = f"{self.kind}:{key_of(source.identity)[:8]}"  # acceptance is per pair
        self.timing = DraftTiming()
        self.slot = 0  # the slot of the draft model's cache the generation uses (PairState.bind)

    @property
    def loaded(self) -> bool:
        return not isinstance(self.source, LazyModel) or self.source.loaded

    def model(self) -> Model:
        """The draft model, loaded (and checked against the target) if it was lazy."""
        if isinstance(self.source, LazyModel):
            if not self.source.loaded:
                check_pair(self.target, self.source.get())
            return self.source.get()
        return self.source

    def propose(self, context: Sequence[int], depth: int) -> DraftProposal | None:
        """Any depth (acceptance is tracked per pair), after catching up on what it has not seen."""
        lag = len(context) - self.model().sequences[self.slot].n_cached if self.loaded else len(context)
        return DraftProposal(self, self.acceptance_kind, depth, lag)

    def start(self, prompt: Sequence[int]) -> None:
        pass  # the pair's state starts the draft model's sequence

    def _fill_row(self, r: int, logits: np.ndarray, sampling: SamplingParams,
                  mask: np.ndarray | None = None) -> np.ndarray:
        """Draft distribution of one logit row into buffer row r (float32, target vocab); with a
        mask row, the masked distribution (all zero where the mask allows none of its tokens)."""
        row = self.buf.rows[r]
        v = min(self.n_vocab, logits.shape[-1])
        if v < self.n_vocab:
            row[v:] = 0.0
        if mask is None:
            verifier.probs(logits[:v], out=row[:v], sampling=sampling)
            return row
        mask = mask[: (v + 31) // 32]
        if v % 32 and not (mask[:-1].any() or int(mask[-1]) & ((1 << (v % 32)) - 1)) \
                or not v % 32 and not mask.any():
            row[:v] = 0.0  # every allowed token lies past the draft's vocabulary: nothing to draw
            return row
        verifier.probs(logits[:v], out=row[:v], sampling=sampling, masks=mask[None, :])
        return row

    def _catch_up(self, state: PairState) -> Steps[np.ndarray]:
        """Decode the committed tokens the draft has not decoded yet; the last one's logits."""
        self.model()  # loaded now if it was lazy
        seq = state.draft_sequence()
        assert seq is not None
        seq.redecode_last()  # the root's logits are needed: decode it again if the cache holds it
        pending = seq.pending
        t0 = time.perf_counter()
        yield from passes.fill(seq)
        self.timing.catch_up = (pending, time.perf_counter() - t0)
        return seq.model.logits_array(1, seq.logits_row)[0]

    def draft(self, proposal: DraftProposal, state: PairState, shape: Shape, sampling: SamplingParams,
              rng: np.random.Generator, without_replacement: bool, masks: RowMasks | None = None) -> Steps[Draft]:
        self.buf.clear_one_hot()
        tree = DraftTree()
        root_logits = yield from self._catch_up(state)
        seq = state.draft_sequence()
        assert seq is not None
        context = state.tokens
        t0 = time.perf_counter()
        self._fill_row(0, root_logits, sampling, None if masks is None else masks.row(tree, -1))
        seq.fork(shape.n_leaves)
        ranges = leaf_ranges(shape)
        base = len(context)  # position of depth-1 nodes
        level = [(-1, 0)]  # (node, structural index) of the previous level; -1 = root
        for depth in range(shape.depth):
            level = self._sample_level(tree, level, depth, shape, ranges, rng, without_replacement)
            if depth + 1 < shape.depth and level:  # decode this level to draft the next one
                nodes = [n for n, _ in level]
                part = seq.step_part([tree.tokens[n] for n in nodes], [base + depth] * len(nodes),
                                     [tree.seqs[n] for n in nodes], outputs="all")
                yield passes.Step(seq, part)
                logits = seq.model.logits_array(len(nodes), part.first_row)
                for i, n in enumerate(nodes):
                    self._fill_row(n + 1, logits[i], sampling, None if masks is None else masks.row(tree, n))
        tree.probs = self.buf.rows[: tree.n + 1]
        self.timing.levels = (shape.depth, time.perf_counter() - t0)
        return Draft(tree, proposal.kind, self, decoded_depth=shape.depth)

    def _sample_level(self, tree: DraftTree, level: list[tuple[int, int]], depth: int, shape: Shape,
                      ranges: Any, rng: np.random.Generator, without_replacement: bool) -> list[tuple[int, int]]:
        """Draw the children of the previous level's nodes (from their rows), added to the tree;
        the new level's (node, structural index) pairs."""
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
                child_struct = struct * count + i if shape.branching is not None else (i if parent < 0 else struct)
                lo, hi = ranges[depth][child_struct]
                node = tree.add(x, parent, tuple(range(lo, hi)))
                new_level.append((node, child_struct))
        return new_level


def ngram_kind(proposal: Proposal) -> str:
    """The planner's acceptance kind of an n-gram proposal."""
    return f"{NGramDrafter.kind}:{proposal.kind}"


class NGramDrafter:
    """Prompt lookup over the whole context (localspec.decoding.lookup): the continuation of the longest
    earlier match, re-aligned after the output replaced a source token. Chains only; one-hot
    rows (deterministic proposals). Its planning kind is the proposal's match-length bucket."""

    kind = "ngram"
    source = None
    loaded = True

    def __init__(self, n_vocab: int, max_nodes: int, ends: Callable[[int], bool] | None = None) -> None:
        self.buf = RowBuffer(max_nodes + 1, n_vocab)
        self.lookup = ContextLookup(ends)  # proposals end at the target's end-of-generation tokens

    def start(self, prompt: Sequence[int]) -> None:
        self.lookup.reset()

    def propose(self, context: Sequence[int], depth: int) -> DraftProposal | None:
        """The continuation of the longest earlier match, its kind the match-length bucket."""
        found = self.lookup.propose(context, depth)
        if found is None or not found.tokens:
            return None
        return DraftProposal(self, ngram_kind(found), len(found.tokens), 0, tuple(found.tokens))

    def draft(self, proposal: DraftProposal, state: PairState, shape: Shape, sampling: SamplingParams,
              rng: np.random.Generator, without_replacement: bool, masks: RowMasks | None = None) -> Draft:
        return Draft(one_hot_chain(self.buf, proposal.tokens[: shape.depth]), proposal.kind, self,
                     offered=proposal.tokens)


class HistoryDrafter:
    """Proposals from earlier calls of the same target (localspec.decoding.history.History): the
    continuation of the longest match with them, one-hot chains as the n-gram drafter's; its
    planning kind the match-length bucket (history_kind)."""

    kind = "history"
    source = None
    loaded = True

    def __init__(self, history: History, n_vocab: int, max_nodes: int, ends: Callable[[int], bool] | None = None) -> None:
        self.history = history
        self.ends = ends
        self.buf = RowBuffer(max_nodes + 1, n_vocab)
        self.match: HistoryMatch | None = None
        self.fed = 0

    def start(self, prompt: Sequence[int]) -> None:
        self.match, self.fed = self.history.matcher(), 0

    def propose(self, context: Sequence[int], depth: int) -> DraftProposal | None:
        if self.match is None:
            self.start(context)
        assert self.match is not None
        for t in context[self.fed:]:
            self.match.feed(int(t))
        self.fed = len(context)
        tokens = self.match.continuation(depth, self.ends)
        if not tokens:
            return None
        return DraftProposal(self, history_kind(self.match.length), len(tokens), 0, tokens)

    def draft(self, proposal: DraftProposal, state: PairState, shape: Shape, sampling: SamplingParams,
              rng: np.random.Generator, without_replacement: bool, masks: RowMasks | None = None) -> Draft:
        return Draft(one_hot_chain(self.buf, proposal.tokens[: shape.depth]), proposal.kind, self,
                     offered=proposal.tokens)


def one_hot_chain(buf: RowBuffer, tokens: Sequence[int]) -> DraftTree:
    """A chain of fixed tokens with one-hot rows (a deterministic proposal)."""
    buf.clear_one_hot()
    tree = DraftTree()
    parent = -1
    for x in tokens:
        buf.one_hot(parent + 1, x)
        parent = tree.add(x, parent, (0,))
    tree.probs = buf.rows[: tree.n + 1]
    return tree


class ForcedSource(Protocol):
    """What the forced-token drafter reads: the grammar matcher of the target's committed tokens
    (localspec.decoding.grammar.follower.GrammarFollower)."""

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (empty: there is a choice)."""


class ForcedDrafter:
    """The tokens a constrained generation's grammar forces next (JSON's braces, keys and
    separators): free proposals, one-hot rows, verified like any draft (the target's masked row
    allows exactly that token, so each is accepted). Its planning kind is "forced"."""

    kind = "forced"
    source = None
    loaded = True

    def __init__(self, grammar: ForcedSource, n_vocab: int, max_nodes: int) -> None:
        self.grammar = grammar  # the matcher that follows the target's committed tokens
        self.buf = RowBuffer(max_nodes + 1, n_vocab)

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, context: Sequence[int], depth: int) -> DraftProposal | None:
        tokens = self.grammar.forced()[:depth]
        return DraftProposal(self, self.kind, len(tokens), 0, tuple(tokens)) if tokens else None

    def draft(self, proposal: DraftProposal, state: PairState, shape: Shape, sampling: SamplingParams,
              rng: np.random.Generator, without_replacement: bool, masks: RowMasks | None = None) -> Draft:
        return Draft(one_hot_chain(self.buf, proposal.tokens[: shape.depth]), proposal.kind, self, certain=True)


def make_drafters(target: Model, draft: Model | LazyModel | None, config: GenerationConfig,
                  history: History | None = None) -> list[Drafter]:
    """The drafters the engine considers for the setting `drafter` (none where
    GenerationConfig.is_target_alone: the target alone): auto: the n-gram lookup (and, given the
    target's `history`, proposals from earlier calls), and the draft model when one is given (the
    planner loads and uses it only where it pays); ngram; model; hybrid. A lazy draft's
    vocabulary is checked against the target's (once: pairing). (A constrained generation's
    engine adds the grammar's forced tokens before these.)"""
    if config.is_target_alone(draft is not None):
        return []
    drafter, shape = config.drafter, config.shape
    max_nodes = max(shape.n_nodes, 1)
    ngram: list[Drafter] = [NGramDrafter(target.n_vocab, max_nodes, target.is_eog)] if drafter != "model" else []
    if ngram and history is not None:
        ngram.append(HistoryDrafter(history, target.n_vocab, max_nodes, target.is_eog))
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
        check_lazy_pair(target, draft)
    return ngram + [ModelDrafter(draft, target, max_nodes)]
