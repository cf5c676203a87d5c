"""A batched target pass over toy models, laid out as the pair's scheduler lays it out.

Each slot is a toy target/draft pair (localspec.verify.lossless) with a prefix of its own. The
step's code is the engine's: each slot's :class:`localspec.decoding.state.PairState` builds its
target part (``target_pass``: the root and every draft node, each root-to-leaf path a sequence
of the slot's), the parts go into one real llama.cpp batch (:class:`localspec.llama.batch.Batch`,
whose ``fill`` sets each part's ``first_row``), and each slot reads its rows back through
``Model.logits`` itself (a :class:`LogitsPointer` at ``first_row``), as ``Engine._verify`` does.

What llama.cpp would compute is played by :class:`ToyKV`: a cache of toy cells (sequence id ->
position -> token) with llama.cpp's ``seq_rm`` / ``seq_cp`` meaning, whose decode reads the
filled batch back (tokens, positions, sequence ids, logits flags), puts its tokens in their
cells and writes one output row per flagged token, in the batch's order: the slot's toy target
after the cells the token's first sequence id sees up to its position (llama.cpp's attention
mask). Rows therefore land where llama.cpp puts them, whatever ``first_row`` says; the real
model's layout is checked against llama.cpp itself in tests/test_lossless_batched.py.

:class:`Streams` gives each slot's verifier its uniforms the way the C verifier reads them
(``uniforms[slot]``: a seed per slot), enumerable exactly: each uniform is an interval of [0, 1)
that a draw narrows, its branches chosen through :func:`localspec.verify.reference.enumerate_outcomes`,
so two slots that read one stream read the same numbers (a real dependence) and two streams are
independent.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import numpy as np

from localspec.decoding.passes import Decoded
from localspec.decoding.state import Draft, PairState
from localspec.decoding.tree import DraftTree
from localspec.llama import model as model_module
from localspec.llama.batch import Batch
from localspec.llama.logits import LogitsPointer
from localspec.llama.model import Model
from localspec.llama.sequence import KVSequence, Part
from localspec.settings.sampling import SamplingParams
from localspec.settings.shape import Shape
from localspec.verify import reference
from localspec.verify.lossless import Context, ToyModel, ToyTree

Key = tuple[str, int]  # a uniform: (its stream, its slot)
SPAN = 4  # sequence ids per slot (a step's branches), as ModelOptions.n_seq_max per slot


@dataclass(frozen=True)
class F32Toy(ToyModel):
    """A toy target whose logits are float32 numbers, as llama.cpp's output rows are: the target's
    own distribution (numpy, float64) and the rows a batched decode holds are the same numbers."""

    def logits(self, context: Context) -> np.ndarray:
        return _f32_logits(self, context)


@lru_cache(maxsize=100_000)
def _f32_logits(model: F32Toy, context: Context) -> np.ndarray:
    return ToyModel.logits(model, context).astype(np.float32).astype(np.float64)


@dataclass(frozen=True)
class SlotCase:
    """One slot of a batched step: its verifier, draft shape, toy pair, prefix (the committed
    context; its last token is the step's root) and sampling."""

    method: str
    shape: Shape
    target: ToyModel
    draft: ToyModel
    prefix: Context
    settings: SamplingParams = SamplingParams(1.0)

    @property
    def length(self) -> int:
        """Tokens a step may output (its drafts and one more): the length outputs are continued to."""
        return self.shape.depth + 1


def draft_tree(toy: ToyTree, probs: np.ndarray | None) -> DraftTree:
    """The engine's DraftTree of a toy tree: each node in the KV sequences of the leaves below it
    (leaves numbered in drafting order, as leaf_ranges numbers a tree's), `probs` its draft rows."""
    n = len(toy.tokens)
    children: dict[int, list[int]] = {j: [] for j in range(-1, n)}
    for j, p in enumerate(toy.parents):
        children[p].append(j)
    leaves = [j for j in range(n) if not children[j]]

    def below(j: int) -> list[int]:
        return [j] if not children[j] else [leaf for c in children[j] for leaf in below(c)]

    tree = DraftTree(probs=probs)
    for j in range(n):
        tree.add(toy.tokens[j], toy.parents[j], tuple(sorted(leaves.index(leaf) for leaf in below(j))))
    return tree


class ToyKV:
    """A toy target context of len(targets) slots (see the module docstring): the CachedModel the
    slots' KVSequences drive, decoding through the real llama.cpp batch `batch`."""

    def __init__(self, targets: Sequence[ToyModel], batch: Batch) -> None:
        self.targets = list(targets)
        self.batch = batch
        self.n_batch = batch.capacity
        self.decodes = 0
        self.cells: dict[int, dict[int, int]] = defaultdict(dict)  # sequence id -> position -> token
        self.sequences = [KVSequence(self, base=i * SPAN, span=SPAN, slot=i) for i in range(len(targets))]
        self.rows = np.zeros((0, 1), dtype=np.float32)  # the last decode's output rows
        self.n_vocab = targets[0].vocab
        self._ctx: object = None  # what llama_get_logits returns for this context (see logits)

    # ------------------------------------------------------------------ llama.cpp's KV operations

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        for s in (list(self.cells) if seq < 0 else [seq]):
            hi = p1 if p1 >= 0 else 1 << 62
            self.cells[s] = {p: t for p, t in self.cells[s].items() if not max(p0, 0) <= p < hi}

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        hi = p1 if p1 >= 0 else 1 << 62
        self.cells[dst].update({p: t for p, t in self.cells[src].items() if max(p0, 0) <= p < hi})

    def seq_state(self, seq: int = 0) -> bytes:
        raise NotImplementedError("toy cells have no saved state")

    def set_seq_state(self, data: bytes, seq: int = 0) -> bool:
        raise NotImplementedError("toy cells have no saved state")

    # ------------------------------------------------------------------ a decode

    def decode_parts(self, parts: Sequence[Part]) -> int:
        """Fill the real batch with the parts (their first_row set by Batch.fill), then decode
        what the batch holds, as llama.cpp would (see the module docstring)."""
        n = self.batch.fill(parts, "toy")
        self.decodes += 1
        raw = self.batch.raw
        entries = [(int(raw.token[i]), int(raw.pos[i]), [int(raw.seq_id[i][j]) for j in range(raw.n_seq_id[i])],
                    bool(raw.logits[i])) for i in range(n)]
        for token, pos, seqs, _ in entries:
            for s in seqs:
                assert pos not in self.cells[s], f"sequence {s} already holds position {pos}"
                self.cells[s][pos] = token
        rows = []
        for _, pos, seqs, flagged in entries:
            if flagged:
                seen = self.cells[seqs[0]]
                context = tuple(seen[p] for p in sorted(seen) if p <= pos)
                assert len(context) == pos + 1, f"sequence {seqs[0]} has holes below position {pos}"
                rows.append(self.targets[seqs[0] // SPAN].logits(context))
        self.rows = np.ascontiguousarray(np.array(rows, dtype=np.float32).reshape(len(rows), self.n_vocab))
        self._ctx = self.rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        return len(rows)

    def logits(self, n_rows: int, first: int = 0) -> LogitsPointer:
        """The last decode's rows first .. first + n_rows - 1, read by ``Model.logits`` itself (its
        llama_get_logits answering with this context's output buffer)."""
        with _own_output_buffer():
            return Model.logits(self, n_rows, first)  # type: ignore[arg-type]

    def _live(self) -> None:
        """Model.logits checks that the model is open: a toy context always is."""


@contextmanager
def _own_output_buffer() -> Iterator[None]:
    """Model.logits's llama_get_logits(ctx) answers with `ctx` itself (a ToyKV's output buffer),
    for the duration of one call."""
    saved = model_module.lc
    model_module.lc = SimpleNamespace(llama_get_logits=lambda ctx: ctx)  # type: ignore[assignment]
    try:
        yield
    finally:
        model_module.lc = saved


def prefilled(kv: ToyKV, slot: int, prefix: Context) -> PairState:
    """Slot `slot`'s PairState with `prefix` committed and all of it but the root in the cache
    (the state between two steps)."""
    state = PairState(kv)
    state.bind(slot)
    state.target.start(list(prefix))
    state.target.fill(len(prefix) - 1)
    return state


def batched_pass(kv: ToyKV, states: Sequence[PairState], drafts: Sequence[Draft]) -> list[int]:
    """One target decode of every slot's step (each slot's target_pass part, in the slots'
    order); each slot's first row, as target_pass returns it to the engine."""
    passes = [state.target_pass(draft) for state, draft in zip(states, drafts, strict=True)]
    parts = [next(p).part for p in passes]
    kv.decode_parts(parts)
    decoded = Decoded(sum(len(p.tokens) for p in parts), 0.0)
    first_rows = []
    for p in passes:
        try:
            p.send(decoded)
        except StopIteration as done:
            first_rows.append(done.value[0])
        else:
            raise AssertionError("target_pass asked for a second decode")
    return first_rows


# --------------------------------------------------------------------------- uniforms


class Streams:
    """Each stream's uniforms u[slot], as intervals narrowed by the draws that read them, their
    branches chosen by the enumerating randomness `rng` (exact: a branch's probability is its
    share of the interval). `known`: the intervals earlier draws left (a later verifier on the
    same stream reads the same uniforms)."""

    def __init__(self, rng: reference.Randomness, known: Iterable[tuple[Key, tuple[float, float]]] = ()) -> None:
        self.rng = rng
        self.known: dict[Key, tuple[float, float]] = dict(known)  # what earlier draws told of each uniform

    def stream(self, name: str) -> Stream:
        return Stream(self, name)

    def pick(self, key: Key, outcome_at: Callable[[float], Any], cuts: Sequence[float]) -> Any:
        """Narrow u[key] to one of the pieces `cuts` make of its interval; that piece's outcome
        (outcome_at(u) for a u inside it)."""
        lo, hi = self.known.get(key, (0.0, 1.0))
        points = [lo] + sorted(c for c in set(cuts) if lo < c < hi) + [hi]
        pieces = [(a, b) for a, b in zip(points, points[1:], strict=False) if b > a]
        k = 0
        if len(pieces) > 1:
            lengths = np.array([b - a for a, b in pieces])
            k = self.rng.categorical(lengths, float(lengths.sum()), 0)
        self.known[key] = pieces[k]
        return outcome_at(0.5 * (pieces[k][0] + pieces[k][1]))


@dataclass
class Stream:
    """One verifier's randomness: reference.Uniforms's draws on a stream of :class:`Streams`."""

    streams: Streams
    name: str

    def bernoulli(self, prob: float, slot: int) -> bool:
        return self.streams.pick((self.name, slot), lambda u: bool(u < prob), [float(prob)])

    def categorical(self, weights: np.ndarray, total: float, slot: int) -> int:
        cum = np.cumsum(weights)
        uniforms = reference.Uniforms(np.zeros(slot + 1))

        def at(u: float) -> int:
            uniforms.u[slot] = u
            return uniforms.categorical(weights, total, slot)

        return self.streams.pick((self.name, slot), at, [float(c / total) for c in cum])


def pointer_rows(rows: LogitsPointer) -> np.ndarray:
    """A copy of the float32 rows a LogitsPointer points at: what the C verifier reads from it."""
    stride = rows.row_stride or rows.n_vocab
    flat = np.ctypeslib.as_array(ctypes.cast(rows.address, ctypes.POINTER(ctypes.c_float)),
                                 shape=(stride * (rows.n_rows - 1) + rows.n_vocab,))
    return np.array([flat[r * stride: r * stride + rows.n_vocab] for r in range(rows.n_rows)], dtype=np.float32)
