"""Exact losslessness of a batched step: two slots whose target rows come from ONE decode.

Each slot has its own toy target/draft pair, prefix, draft shape, verifier, sampling and random
stream. The step runs the engine's code (tests/toy_batch.py): each slot's PairState.target_pass
builds its part, a real llama.cpp batch (Batch.fill) sets each part's first row, one decode lays
the rows out as llama.cpp does (in the batch's order), and each slot reads its rows through
Model.logits at the first row target_pass returned. Every random choice is enumerated: each
slot's drafts (drawn from draws of its own) and the two verifications jointly (their uniforms as
intervals that a draw narrows, so verifiers reading one stream read the same numbers). So the
check is exact: the joint output of the two slots, each continued by its target to the step's
length (as lossless.extend does), must equal the product of the two targets' own distributions
(each slot lossless, the two independent) within 1e-9. Negative controls (a slot reading the
other's rows, an offset one off, the slots' verifiers reading one random stream, the drafts'
rows swapped) must fail the same check.

The C verifier is tied to the reference draw for draw on the batched rows (as
test_verifier_draws.py does on plain arrays), and the layout Batch.fill assumes is checked
against llama.cpp itself on the tiny model: a slot's rows in a decode shared with another slot
are its rows decoded alone, up to the batch-shape noise measured on this build.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import cache

import numpy as np
import pytest

from localspec.decoding.state import Draft
from localspec.llama.batch import Batch
from localspec.llama.logits import LogitsPointer
from localspec.llama.model import Model
from localspec.settings.generation import WITHOUT_REPLACEMENT
from localspec.settings.sampling import SamplingParams
from localspec.settings.shape import Shape
from localspec.verify import lossless, reference, verifier
from localspec.verify.lossless import ToyModel, ToyTree

from greedy import batch_noise, near_tie, row_difference
from toy_batch import SPAN, F32Toy, SlotCase, Streams, ToyKV, batched_pass, draft_tree, pointer_rows, prefilled

TOL = 1e-9
V = 3
TARGET_A, TARGET_B = F32Toy(V, seed=31), F32Toy(V, seed=32)
NEAR_A = ToyModel(V, seed=41, base=TARGET_A, noise=1.0)  # a draft near its target
FAR_B = ToyModel(V, seed=42)  # a draft unrelated to its target: many rejections
NEAR_B = ToyModel(V, seed=43, base=TARGET_B, noise=1.0)

BLOCK_A = SlotCase("block", Shape.chain(2), TARGET_A, NEAR_A, prefix=(2, 0, 1))
TRAVERSAL_B = SlotCase("traversal", Shape.tree((2, 1)), TARGET_B, FAR_B, prefix=(0, 2))
TOKEN_A = SlotCase("token", Shape.chain(2), TARGET_A, NEAR_A, prefix=(2, 0, 1))
TOKEN_B = SlotCase("token", Shape.chain(2), TARGET_B, NEAR_B, prefix=(1,), settings=SamplingParams(0.6, top_k=2))
PAIRS = [pytest.param(BLOCK_A, TRAVERSAL_B, id="block-chain+traversal-tree"),
         pytest.param(TOKEN_A, TOKEN_B, id="token-chain+token-chain")]


@pytest.fixture(scope="module")
def batch() -> Iterator[Batch]:
    """One real llama.cpp batch for every toy decode (two slots of SPAN sequence ids each)."""
    b = Batch(64, 2 * SPAN)
    yield b
    b.free()


@dataclass(frozen=True)
class Fault:
    """A batched step as it runs (the default) or deliberately broken (the negative controls)."""

    row: Callable[[int, int], int] = lambda slot, first: first  # the first row slot `slot` reads
    streams: tuple[str, str] = ("A", "B")  # the random stream each slot's verifier reads
    swap_drafts: bool = False  # each slot verifies with the other's draft rows
    name: str = field(default="as it runs", compare=False)


def draft(case: SlotCase, rng: reference.Randomness) -> tuple[ToyTree, np.ndarray]:
    """A slot's draft tree, drawn through `rng`, and the rows it was drawn from (float64)."""
    tree = lossless.sample_tree(case.shape, case.draft, case.prefix, case.settings, rng,
                                case.method in WITHOUT_REPLACEMENT)
    return tree, np.stack([lossless.draft_distribution(case.draft, c, case.settings) for c in tree.contexts])


@cache
def drafts_of(case: SlotCase) -> list[tuple[ToyTree, np.ndarray, float]]:
    """Every draft tree the slot's drafter may draw, with its rows and its probability (exact).
    Each slot drafts from draws of its own, so the two slots' trees are independent."""
    found: dict = {}

    def run(rng: reference.Randomness) -> tuple:
        tree, probs = draft(case, rng)
        key = (tuple(tree.tokens), tuple(tree.parents))
        found[key] = (tree, probs)
        return key

    return [(*found[key], p) for key, p in reference.enumerate_outcomes(run).items()]


def decode_step(cases: tuple[SlotCase, ...], trees: list[ToyTree], probs: list[np.ndarray],
                batch: Batch) -> tuple[ToyKV, list[int]]:
    """The slots' target passes in one decode of a toy context; each slot's first row."""
    kv = ToyKV([c.target for c in cases], batch)
    states = [prefilled(kv, i, c.prefix) for i, c in enumerate(cases)]
    drafts = [Draft(draft_tree(t, p.astype(np.float32)), kind="toy") for t, p in zip(trees, probs, strict=True)]
    return kv, batched_pass(kv, states, drafts)


Known = tuple  # sorted ((stream, slot), (lo, hi)) pairs: what earlier draws told of each uniform


@cache
def verified(method: str, tp: bytes, dp: bytes, shape: tuple[int, int], tokens: tuple, parents: tuple,
             stream: str, known: Known) -> dict:
    """Exact distribution of (output path and token, the stream's intervals after) of one reference
    verification reading stream `stream`, whose uniforms earlier draws narrowed to `known`. A pure
    function of its inputs (the rows as bytes), so it is computed once per distinct input."""
    t = np.frombuffer(tp, dtype=np.float64).reshape(shape)
    d = np.frombuffer(dp, dtype=np.float64).reshape(shape)

    def run(rng: reference.Randomness) -> tuple:
        streams = Streams(rng, known)
        out = reference.verify(method, t, d, tokens, parents, streams.stream(stream))
        return out, tuple(sorted(streams.known.items()))

    return reference.enumerate_outcomes(run)


def verify_in_turn(slots: list[tuple[str, np.ndarray, np.ndarray, ToyTree]], streams: tuple[str, ...]) -> dict:
    """Exact joint distribution of the slots' outputs, verified one after the other, slot i
    reading stream streams[i] (chain rule: a slot's verification given the intervals the ones
    before it left on the stream it reads)."""
    level: dict = {((), ()): 1.0}
    for (method, tp, dp, tree), name in zip(slots, streams, strict=True):
        step: dict = {}
        for (outs, known), p in level.items():
            mine = tuple(k for k in known if k[0][0] == name)
            others = tuple(k for k in known if k[0][0] != name)
            given = verified(method, tp.tobytes(), dp.tobytes(), tp.shape, tuple(tree.tokens), tuple(tree.parents),
                             name, mine)
            for ((path, token), after), q in given.items():
                key = (outs + (lossless.output_sequence(tree, path, token),), tuple(sorted(others + after)))
                step[key] = step.get(key, 0.0) + p * q
        level = step
    out: dict = {}
    for (outs, _), p in level.items():
        out[outs] = out.get(outs, 0.0) + p
    return out


def batched_distribution(a: SlotCase, b: SlotCase, batch: Batch, fault: Fault = Fault()) -> dict:
    """Exact distribution of (slot A's output, slot B's output) of one batched step: every pair of
    drafts decoded in one pass, each slot verified by the numpy reference on the rows the C
    verifier would read (the float32 rows of the LogitsPointer at its first row) with its own
    stream's uniforms, both verifications enumerated jointly."""
    dist: dict = {}
    for (ta, pa, wa), (tb, pb, wb) in itertools.product(drafts_of(a), drafts_of(b)):
        kv, first = decode_step((a, b), [ta, tb], [pa, pb], batch)
        slots = []
        for i, (case, tree) in enumerate(((a, ta), (b, tb))):
            rows = pointer_rows(kv.logits(len(tree.tokens) + 1, fault.row(i, first[i])))
            tp = reference.transform(rows, **asdict(case.settings))
            slots.append((case.method, tp, (pb, pa)[i] if fault.swap_drafts else (pa, pb)[i], tree))
        for outs, p in verify_in_turn(slots, fault.streams).items():
            dist[outs] = dist.get(outs, 0.0) + wa * wb * p
    return dist


def errors(dist: dict, a: SlotCase, b: SlotCase) -> tuple[float, float, float]:
    """max |P - P_target| of the joint (against the product of the targets' distributions) and of
    each slot's marginal, every output continued by its target to its step's length."""
    extended: dict = {}

    def extend(case: SlotCase, seq: tuple) -> dict:
        key = (case, seq)
        if key not in extended:
            extended[key] = lossless.extend({seq: 1.0}, case.target, case.prefix, case.length, case.settings)
        return extended[key]

    full: dict = {}
    for (x, y), p in dist.items():
        for xs, px in extend(a, x).items():
            for ys, py in extend(b, y).items():
                full[(xs, ys)] = full.get((xs, ys), 0.0) + p * px * py
    want_a = lossless.target_joint(a.target, a.prefix, a.length, a.settings)
    want_b = lossless.target_joint(b.target, b.prefix, b.length, b.settings)
    want = {(xs, ys): pa * pb for xs, pa in want_a.items() for ys, pb in want_b.items()}
    got_a: dict = {}
    got_b: dict = {}
    for (xs, ys), p in full.items():
        got_a[xs] = got_a.get(xs, 0.0) + p
        got_b[ys] = got_b.get(ys, 0.0) + p
    return _distance(full, want), _distance(got_a, want_a), _distance(got_b, want_b)


def _distance(got: dict, want: dict) -> float:
    return max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in set(got) | set(want))


# ----------------------------------------------------------------------------- the batched step


def test_the_toy_step_lays_the_slots_out_as_the_scheduler_does(batch: Batch) -> None:
    """The layout under test: one decode, slot A's rows then slot B's, each slot's first row the
    number of rows before it; a chain's part is its root and draft nodes on one sequence, a
    tree's root on both of its sequences (the slot's own ids)."""
    a, b = BLOCK_A, TRAVERSAL_B
    trees = [ToyTree(tokens=[1, 2], parents=[-1, 0]), ToyTree(tokens=[0, 1, 2, 2], parents=[-1, 0, -1, 2])]
    for t, case in zip(trees, (a, b), strict=True):
        t.contexts = [case.prefix]
    probs = [np.full((3, V), 1 / V), np.full((5, V), 1 / V)]
    kv, first = decode_step((a, b), trees, probs, batch)
    assert first == [0, 3] and kv.rows.shape == (8, V) and kv.decodes == 3  # two prefills, one step
    raw = batch.raw
    assert [raw.token[i] for i in range(8)] == [1, 1, 2, 2, 0, 1, 2, 2]
    assert [raw.pos[i] for i in range(8)] == [2, 3, 4, 1, 2, 3, 2, 3]
    assert [tuple(raw.seq_id[i][j] for j in range(raw.n_seq_id[i])) for i in range(8)] == [
        (0,), (0,), (0,), (SPAN, SPAN + 1), (SPAN,), (SPAN,), (SPAN + 1,), (SPAN + 1,)]
    np.testing.assert_array_equal(kv.rows[4], TARGET_B.logits((0, 2, 0)).astype(np.float32))
    np.testing.assert_array_equal(kv.rows[7], TARGET_B.logits((0, 2, 2, 2)).astype(np.float32))


@pytest.mark.parametrize("a,b", PAIRS)
def test_a_batched_step_is_exactly_each_target_and_the_slots_independent(a: SlotCase, b: SlotCase,
                                                                       batch: Batch) -> None:
    joint, marginal_a, marginal_b = errors(batched_distribution(a, b, batch), a, b)
    assert max(joint, marginal_a, marginal_b) <= TOL, (joint, marginal_a, marginal_b)


ROW_FAULTS = [
    Fault(row=lambda slot, first: 0, name="B reads A's rows (first row 0 for both)"),
    Fault(row=lambda slot, first: first - slot, name="B's rows one before its own"),
    Fault(row=lambda slot, first: first + (slot == 0), name="A's rows one after its own"),
]


@pytest.mark.parametrize("fault", ROW_FAULTS, ids=lambda f: f.name)
@pytest.mark.parametrize("a,b", PAIRS)
def test_wrong_rows_fail_the_exact_check(a: SlotCase, b: SlotCase, fault: Fault, batch: Batch) -> None:
    """A slot that reads rows at a wrong offset of the shared decode is not its target."""
    joint, _, _ = errors(batched_distribution(a, b, batch, fault), a, b)
    assert joint > 1e-3, joint


@pytest.mark.parametrize("a,b", PAIRS[1:])
def test_one_random_stream_for_both_slots_fails_the_exact_check(a: SlotCase, b: SlotCase, batch: Batch) -> None:
    """Both verifiers read the same uniforms (one seed handed to both slots): each slot alone is
    still exactly its target, but their outputs are dependent, which the joint check catches."""
    joint, marginal_a, marginal_b = errors(batched_distribution(a, b, batch, Fault(streams=("A", "A"))), a, b)
    assert max(marginal_a, marginal_b) <= TOL, (marginal_a, marginal_b)
    assert joint > 1e-3, joint


def test_swapped_draft_rows_fail_the_exact_check(batch: Batch) -> None:
    """Each slot verifies its draft against the other slot's draft distribution."""
    joint, _, _ = errors(batched_distribution(TOKEN_A, TOKEN_B, batch, Fault(swap_drafts=True)), TOKEN_A, TOKEN_B)
    assert joint > 1e-3, joint


# ----------------------------------------------------------------------------- the C verifier on the batched rows

N_DRAWS = 150


def c_verify(case: SlotCase, rows: LogitsPointer, dp: np.ndarray, tree: ToyTree, u: np.ndarray
             ) -> verifier.VerifyOutcome:
    """The C verifier on a slot's rows, its draft rows (float32) and uniforms `u`."""
    return verifier.verify(case.method, rows, dp, tree.tokens, tree.parents, uniforms=u, sampling=case.settings)


@pytest.mark.parametrize("a,b", PAIRS)
def test_the_c_verifier_on_the_batched_rows_is_the_reference_draw_for_draw(a: SlotCase, b: SlotCase,
                                                                          batch: Batch) -> None:
    """Given each slot's LogitsPointer into the shared decode (as Engine._verify gives it), the C
    verifier makes the reference's choices on the same uniforms (the reference fed the C transform
    of the same rows, as in test_verifier_draws.py) and the choices it makes on the slot's rows
    decoded alone; read at a wrong offset, it makes other choices (negative control)."""
    rng = np.random.default_rng(2024)
    draws = lossless.NumpyDraws(rng)
    accepted = wrong = 0
    for _ in range(N_DRAWS):
        trees, probs = zip(*(draft(c, draws) for c in (a, b)), strict=True)
        kv, first = decode_step((a, b), list(trees), list(probs), batch)
        for i, (case, tree, p) in enumerate(zip((a, b), trees, probs, strict=True)):
            n, dp = len(tree.tokens), p.astype(np.float32)
            u = rng.random(n + 1)
            rows = kv.logits(n + 1, first[i])
            got = c_verify(case, rows, dp, tree, u)
            tp = verifier.probs(rows, sampling=case.settings)
            assert (got.path, got.token) == reference.verify(case.method, tp, dp.astype(np.float64), tree.tokens,
                                                             tree.parents, reference.Uniforms(u))
            alone, alone_first = decode_step((case,), [tree], [p], batch)
            assert c_verify(case, alone.logits(n + 1, alone_first[0]), dp, tree, u) == got
            wrong += c_verify(case, kv.logits(n + 1, first[i] + (1 if i == 0 else -1)), dp, tree, u) != got
            accepted += got.n_accepted
    assert accepted > N_DRAWS // 2 and wrong > N_DRAWS // 10, (accepted, wrong)


# ----------------------------------------------------------------------------- llama.cpp's own layout

Read = Callable[[int, int], int]  # (slot's place in the decode, its first row) -> the row it reads from


def real_pass(target: Model, slots: list[tuple[int, list[int], ToyTree]], read: Read = lambda i, first: first
              ) -> tuple[list[np.ndarray], list[int]]:
    """The slots' steps (model slot, committed tokens, draft tree) in ONE target decode on the
    model, through PairState.target_pass and Model.decode_parts as the scheduler runs them; each
    slot's rows (read through Model.logits at read(i, first row)) and the first rows."""
    target.clear()
    try:
        states = [prefilled(target, slot, prompt) for slot, prompt, _ in slots]  # type: ignore[arg-type]
        first = batched_pass(target, states, [Draft(draft_tree(tree, None)) for _, _, tree in slots])  # type: ignore[arg-type]
        rows = []
        for i, ((_, _, tree), f) in enumerate(zip(slots, first, strict=True)):
            n = len(tree.tokens) + 1
            rows.append(pointer_rows(target.logits(n, read(i, f))))
            assert np.array_equal(rows[-1], target.logits_array(n, read(i, f)))
        return rows, first
    finally:
        target.clear()


def test_rows_are_where_llama_cpp_puts_them(tiny_target: Model) -> None:
    """Two slots' parts in one decode_parts (a chain of 2, a 2x1 tree; either order): each slot's
    rows at the first row Batch.fill gave are its rows decoded alone, up to the batch-shape noise
    measured on this build (tests/greedy.py's batch_noise); at a wrong offset they differ by whole
    logits (negative control)."""
    target = tiny_target
    assert target.n_slots >= 2
    text = target.tokenize("def add(a, b): return a + b\nclass Stack:\n    def push(self, x): pass")
    assert len(text) >= 24
    tol = near_tie(batch_noise(target, text))
    a = (0, text[:12], ToyTree(tokens=[text[12], text[13]], parents=[-1, 0]))
    b = (1, text[14:21], ToyTree(tokens=[text[21], text[22], text[3], text[4]], parents=[-1, 0, -1, 2]))
    (alone_a,), _ = real_pass(target, [a])
    (alone_b,), _ = real_pass(target, [b])
    for order, firsts in (([a, b], [0, 3]), ([b, a], [0, 5])):
        rows, first = real_pass(target, order)
        assert first == firsts
        for got, slot in zip(rows, order, strict=True):
            want = alone_a if slot is a else alone_b
            assert row_difference(got, want) <= tol, (row_difference(got, want), tol)
    whole = max(100 * tol, 0.1)  # a wrong row: a difference of whole logits, far beyond the noise
    for read, slot in ((lambda i, f: 0, 1), (lambda i, f: f - i, 1), (lambda i, f: f + (i == 0), 0)):
        rows, _ = real_pass(target, [a, b], read)
        assert row_difference(rows[slot], (alone_a, alone_b)[slot]) > whole
