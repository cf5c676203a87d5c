"""A scheduler's slots and what runs in them (localspec.decoding.scheduler): the protocol of a
call (:class:`Call`: localspec.generation.Generation is one), a :class:`Slot` of the target's
context with the call running in it, and the decode running now (:class:`Running`)."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from localspec.decoding.passes import Request, Turn

if TYPE_CHECKING:
    from localspec.decoding.batch_plan import Offer

Program = Generator["Request | Offer | Turn", Any, None]


class Call(Protocol):
    """What the scheduler runs (localspec.generation.Generation is one)."""

    @property
    def prompt(self) -> Sequence[int]:
        """Its tokens: the slot sharing the longest prefix is chosen."""

    def cancelled(self) -> bool:
        """Whether it should stop now (its cancel set, its consumer gone)."""

    def bind(self, slot: int) -> None:
        """It runs in the target's slot `slot` (and the draft's)."""

    def program(self) -> Program:
        """Its work as requests (see the module docstring)."""

    def end(self, error: BaseException | None, cancelled: bool) -> None:
        """It ended: its program finished, failed (`error`) or was stopped (`cancelled`)."""


@dataclass(eq=False)
class Slot:
    """One of the target's slots and the call running in it."""

    index: int
    call: Call | None = None
    program: Program | None = None
    pending: Any = None  # what its program yielded last (a request, or a Turn)
    last_used: float = 0.0
    admitted: int = 0  # admission order: prompts are prefilled first come, first served
    models: set = field(default_factory=set)  # the models whose sequences of this slot its calls used

    def release(self) -> None:
        self.call = self.program = self.pending = None
        self.last_used = time.monotonic()


@dataclass
class Running:
    """The decode running now and the calls it serves."""

    model: Any
    calls: list[Call] = field(default_factory=list)
