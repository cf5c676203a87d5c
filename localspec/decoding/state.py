"""One owner for a generation's pair within a step: the target's and the draft's KV sequences (of
the generation's slot) and the grammar, and the one place a verified step is committed to all of
them (as mlx-lm rewinds its caches in one place).

A step reads :attr:`PairState.tokens` (the committed context), runs :meth:`PairState.target_pass`
over a :class:`Draft` and, once verified, :meth:`PairState.accept` commits the new tokens: the
target keeps the accepted path in its KV cache, the draft model keeps what it decoded of that path
(it is told every committed token, so it never has to find out what it missed), and the grammar
follows the target's commits. Drafters return a :class:`Draft`, which carries what committing it
needs; nothing is carried from one call to the next by call order.

The decodes it needs are requests its generators yield (localspec.decoding.passes): the pair's
scheduler batches them with the other slots'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from localspec.decoding.passes import Step, Steps
from localspec.decoding.tree import DraftTree
from localspec.llama.sequence import KVSequence


class DraftModel(Protocol):
    """The draft model as the state sees it (localspec.decoding.drafters.ModelDrafter)."""

    @property
    def loaded(self) -> bool: ...

    def model(self) -> Any:
        """The model (a localspec.llama.model.Model), loaded now if it was lazy."""


class Grammar(Protocol):
    """A constrained generation's grammar (localspec.decoding.grammar.steps.Structured)."""

    def attach(self, prompt: Sequence[int], sequence: KVSequence) -> None: ...

    def detach(self) -> None: ...

    def step(self) -> Any:
        """The mask rows of a step's draft (localspec.decoding.grammar.steps.StepMasks)."""


@dataclass(frozen=True)
class Draft:
    """A step's draft, and what committing it needs."""

    tree: DraftTree = field(default_factory=DraftTree)
    kind: str | None = None  # the planner's acceptance kind (None: nothing drafted)
    # the localspec.decoding.drafters.Drafter that made it (None: nothing drafted); typed object, as
    # that module imports this one: its reader (the planner) knows which drafter decodes levels
    drafter: object = None
    decoded_depth: int = 0  # the draft model decoded the nodes above this depth (not its leaves)
    certain: bool = False  # a chain the grammar forces: every row allows exactly its token
    offered: tuple[int, ...] = ()  # a deterministic proposal's tokens, past what was drafted too (the planner's)

    @property
    def n(self) -> int:
        return self.tree.n


NO_DRAFT = Draft()


class PairState:
    """The target's sequence, the draft model's (through its drafter, which may load it on first
    use) and the grammar of a constrained generation."""

    def __init__(self, target: Any, draft: DraftModel | None = None, grammar: Grammar | None = None) -> None:
        """`target`: a localspec.llama.model.Model; `draft`: the model drafter, if any. The
        generation uses the target's first slot until it is bound to another (:meth:`bind`)."""
        self.target_model = target
        self.slot = 0
        self.target: KVSequence = target.sequences[0]
        self.draft_drafter = draft
        self.grammar = grammar

    def bind(self, slot: int) -> None:
        """The generation runs in the model's slot `slot` (its own KV sequences)."""
        self.slot = slot
        self.target = self.target_model.sequences[slot]

    @property
    def tokens(self) -> list[int]:
        """The committed context: the prompt and what was generated."""
        return self.target.tokens

    def draft_sequence(self) -> KVSequence | None:
        """The draft model's sequence, holding the committed context (pending decoding); None
        while the draft model is not loaded."""
        drafter = self.draft_drafter
        if drafter is None or not drafter.loaded:
            return None
        seq = drafter.model().sequences[self.slot]
        if seq.tokens != self.tokens:  # just loaded, or another generation used it since
            seq.start(self.tokens)
        return seq

    # ------------------------------------------------------------ a generation

    def start(self, prompt: Sequence[int], prefill: Callable[[KVSequence, int], Steps[None]]) -> Steps[int]:
        """The prompt into the target's cache (reusing the prefix an earlier context left there;
        `prefill` decodes the rest, its last token too, whose logits the first step uses as
        llama.cpp's own tools do), the grammar following it from now on; returns the prompt tokens
        the cache held already."""
        cached = self.target.start(prompt)
        yield from prefill(self.target, len(prompt))
        if self.grammar is not None:
            self.grammar.attach(prompt, self.target)
        draft = self.draft_sequence()  # a loaded draft keeps the prefix its cache shares with the prompt
        if draft is not None:
            draft.start(prompt)
        return cached

    def restore(self, cache: Any, prompt: Sequence[int]) -> int:
        """Both models' longest saved prefixes of `prompt` from the prompt cache; the prompt
        tokens the target's cache holds after."""
        held = cache.restore(self.target_model, prompt, self.target)
        if self.draft_drafter is not None and self.draft_drafter.loaded:
            model = self.draft_drafter.model()
            cache.restore(model, prompt, model.sequences[self.slot])
        return held

    def save_draft(self, cache: Any, prompt: Sequence[int]) -> None:
        """The draft model's state of what it decoded of the prompt and the answer, for a later
        prompt sharing a prefix (saved at the end: it catches up only when it drafts)."""
        if self.draft_drafter is None or not self.draft_drafter.loaded:
            return
        model = self.draft_drafter.model()
        seq = model.sequences[self.slot]
        if seq.n_cached >= len(prompt) - 1 and seq.tokens[: len(prompt) - 1] == list(prompt[:-1]):
            cache.save(model, seq.tokens[: seq.n_cached], seq)

    def new_step(self) -> Any:
        """A step begins: the grammar's mask rows for its draft (None: unconstrained)."""
        return self.grammar.step() if self.grammar is not None else None

    def close(self) -> None:
        """The generation ended (or failed): the grammar stops following the target."""
        if self.grammar is not None:
            self.grammar.detach()

    # ------------------------------------------------------------ a step

    def target_pass(self, draft: Draft) -> Steps[tuple[int, Any]]:
        """ONE target decode over the root and every draft node, each root-to-leaf path a KV
        sequence sharing the prefix; a certain draft keeps only the last node's logits. Right
        after the prompt's prefill the root's logits are there: a step that drafts nothing uses
        them, one that drafts decodes the root again with its draft. Returns the first of its
        logits rows in the target's last decode, and the decode (None: no decode was needed)."""
        tree, tokens = draft.tree, self.tokens
        if self.target.n_cached == len(tokens):
            if not tree.n and self.target.root_logits:
                return self.target.logits_row, None
            self.target.redecode_last()
        root = len(tokens) - 1
        branches = max((s[-1] for s in tree.seqs), default=0) + 1
        self.target.fork(branches)
        part = self.target.step_part([tokens[-1]] + tree.tokens, [root] + [root + d for d in tree.depths],
                                     [tuple(range(branches))] + tree.seqs, outputs="last" if draft.certain else "all")
        decoded = yield Step(self.target, part)
        return part.first_row, decoded

    def accept(self, draft: Draft, path: tuple[int, ...], new: Sequence[int]) -> None:
        """Commit a verified step: `path` of the draft was accepted and `new` (those tokens and
        the one drawn after them, cut at the end of generation) appended to the context."""
        before = len(self.tokens)
        draft_seq = self.draft_sequence()  # in step with the context (None: no draft model loaded)
        self.target.commit(new)  # the grammar and the stop-string scanner follow the target
        self.target.keep_branch(draft.tree.branch_of(path), before + len(path))
        if draft_seq is None:
            return
        draft_seq.commit(new)  # what it did not decode, it decodes when it next drafts
        if draft.decoded_depth:  # its own draft: the cache keeps the path's nodes it decoded (never a leaf)
            decoded = sum(1 for j in path if draft.tree.depths[j] < draft.decoded_depth)
            draft_seq.keep_branch(draft.tree.branch_of(path), before + decoded)
