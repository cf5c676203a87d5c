"""The decodes a generation asks for, as requests its steps yield (:data:`Steps`): a generation's
prompt, drafts and steps are generators that yield a :class:`Fill` (committed tokens into a
sequence's cache) or a :class:`Step` (a step's tokens on its forked sequences) and get a
:class:`Decoded` back once the decode has run, its logits rows in place until the model's next
decode.

Whoever runs them decides how the decodes are made: :func:`run_alone` runs each request as a
decode of its own (one generation on the model, as ``Engine.step`` does when called directly);
the pair's scheduler (localspec.decoding.scheduler) puts the requests of every active call into
one decode per model per round. The step's code is the same either way. In a round planned as a
whole (``Turn.planned``) a step may also yield an :class:`~localspec.decoding.batch_plan.Offer`
(its drafting options) and gets back the depth the round's plan gives it.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from localspec.errors import Cancelled
from localspec.llama.sequence import CachedModel, KVSequence, Part

if TYPE_CHECKING:
    from localspec.decoding.batch_plan import Offer


@dataclass
class Fill:
    """Decode `sequence`'s committed tokens up to `upto` (at most what the runner gives at once:
    the step that asked loops until its sequence holds them). `outputs` "last": the last decoded
    token's logits; "all": every token's (a pass the planner times: `measure`, run at its full size)."""

    sequence: KVSequence
    upto: int
    outputs: str = "last"
    measure: bool = False

    def part(self, most: int) -> Part:
        """The part this request decodes now: at most `most` tokens (all of them when measured)."""
        return self.sequence.fill_part(self.upto, self.outputs, None if self.measure else most)


@dataclass
class Step:
    """Decode a step's tokens (`part`: the root and the draft nodes, or one draft level) on
    `sequence`'s forked sequences; the caller keeps what it needs afterwards (keep_branch)."""

    sequence: KVSequence
    part: Part


Request = Fill | Step


@dataclass(frozen=True)
class Turn:
    """Between two steps a generation yields an empty Turn and waits for its next one: the one it
    gets back says what the other calls put in the next target pass (`batch` tokens; the step may
    add at most `room`; None: the whole batch), and whether the round is planned as a whole
    (`planned`: the step yields its options, a localspec.decoding.batch_plan.Offer, and gets back
    the depth to draft)."""

    batch: int = 0
    room: int | None = None
    planned: bool = False


ON_CPU = 0.5  # a decode whose threads got less than this share of its wall time was not on the CPU


@dataclass(frozen=True)
class Decoded:
    """A request's decode ran: the tokens the whole decode held (this request's and the other
    calls'), its wall time (seconds) and the share of that time its threads ran on the CPU
    (the process's CPU time over wall time × threads; None: not known, e.g. layers on a GPU)."""

    tokens: int
    seconds: float
    cpu_share: float | None = None

    def alone(self, own: int) -> bool:
        """Whether the decode held only `own` tokens (its time is the cost of that many)."""
        return self.tokens == own

    @property
    def timed(self) -> float | None:
        """Its seconds, as a cost to learn: None where the process was off the CPU for much of it
        (other work on the machine took the cores: its time says nothing of the model's cost)."""
        return None if self.cpu_share is not None and self.cpu_share < ON_CPU else self.seconds


T = TypeVar("T")
Steps = Generator["Request | Offer", Any, T]  # sent back: a Request's Decoded, an Offer's depth


def decode(model: CachedModel, parts: list[Part], requests: list[Request]) -> Decoded:
    """Run one decode of `parts` (one per request, in order) on `model`; fills are recorded in
    their sequences. A decode that fails leaves the requests' sequences as they were before it."""
    for r in requests:
        r.sequence.begin()
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        model.decode_parts(parts)
    except BaseException:
        for r, p in zip(requests, parts, strict=True):
            r.sequence.abandon(p)
        raise
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for r, p in zip(requests, parts, strict=True):
        if isinstance(r, Fill):
            r.sequence.filled(p)
    threads = getattr(model, "cpu_threads", None)
    share = cpu / (seconds * threads) if threads and seconds > 0 else None
    return Decoded(sum(len(p.tokens) for p in parts), seconds, share)


def run_alone(steps: Steps[T]) -> T:
    """Run a generation's requests one decode each (nothing else on the model)."""
    sent: Decoded | None = None
    while True:
        try:
            request = next(steps) if sent is None else steps.send(sent)
        except StopIteration as done:
            return done.value
        if not isinstance(request, Fill | Step):
            raise TypeError(f"{type(request).__name__} outside a planned round: a step offers only when its turn is planned")
        model = request.sequence.model
        part = request.part(model.n_batch) if isinstance(request, Fill) else request.part
        try:
            sent = decode(model, [part], [request])
        except Cancelled:
            steps.close()
            raise


def resolve(value: T | Steps[T]) -> Steps[T]:
    """The value of something that may need decodes (a generator of requests) or may not."""
    if isinstance(value, Generator):
        return (yield from value)
    return value


def fill(sequence: KVSequence, upto: int | None = None, outputs: str = "last") -> Steps[None]:
    """Decode `sequence`'s committed tokens up to `upto` (default: all of them)."""
    upto = len(sequence.tokens) if upto is None else upto
    while sequence.n_cached < upto:
        yield Fill(sequence, upto, outputs)
