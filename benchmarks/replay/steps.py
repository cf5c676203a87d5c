"""A recorded answer decoded again as the engine decodes it with the n-gram drafter, through the
engine's own interface to a policy (localspec.decoding.policy.Policy), with costs from a cost curve.

Each step, the engine's n-gram drafter (localspec.decoding.drafters.NGramDrafter) proposes a
continuation of the prompt and the answer so far; the policy picks it and a depth
(:meth:`Policy.pick`), the drafter drafts that many tokens; the recorded answer says how many of
them the target accepts (at T = 0 a one-hot draft is accepted exactly where it equals the output);
the step costs c(drafted + 1) from the curve, and the policy observes it
(:meth:`Policy.observe_step`); at the end, :meth:`Policy.finish`. The policy is the real planner
(benchmarks.replay.planners makes one), a variant of it, or a fixed depth per kind of proposal
(:class:`FixedDepths`): a replay takes milliseconds, and two policies compare on the same answers
with no timing noise. :func:`replay` decodes one answer alone; its step, :class:`AnswerDecode`,
is what the batch replay (benchmarks.replay.batch) drives for several answers sharing each pass. The prompt's prefill is not replayed (there is no model): the profile a
replay starts from holds what a prefill measures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from localspec.decoding.batch_plan import Offer
from localspec.decoding.drafters import DraftProposal, NGramDrafter
from localspec.decoding.lookup import ContextLookup
from localspec.decoding.policy import FixedPolicy, Policy
from localspec.decoding.state import NO_DRAFT, Draft
from localspec.settings.generation import GenerationConfig
from localspec.settings.sampling import SamplingParams

from benchmarks.replay.ceiling import matched_run

SHAPE = GenerationConfig().shape  # the engine's default draft shape (a chain)
DEPTH = SHAPE.depth  # the engine's default draft depth
TRUNCATED = [SHAPE.truncated(d) for d in range(DEPTH + 1)]  # the shape of a draft of d levels (made once)
GREEDY = SamplingParams(0.0)  # the answers are greedy (the n-gram drafter's one-hot rows do not read it)

Trace = list[tuple[int, "str | None", int, int]]  # per step: output position, kind or None, drafted, accepted


@dataclass(frozen=True)
class Replay:
    seconds: float  # target time of the replayed decode
    steps: int
    drafted: int
    accepted: int


class FixedDepths(FixedPolicy):
    """A fixed policy: that many tokens of every proposal of a kind (a kind it does not name: none).
    It learns nothing (FixedPolicy's prefill, observe_step and finish)."""

    def __init__(self, depths: Mapping[str, int]) -> None:
        super().__init__(())
        self.depths = depths  # kept as given (a mapping may answer .get for every kind)

    def pick(self, proposals: Sequence[DraftProposal], depth: int, prompt_tokens: int,
             remaining: int, batch: int = 0) -> tuple[DraftProposal, int] | None:
        for proposal in proposals:
            levels = min(self.depths.get(proposal.kind, 0), proposal.levels)
            return (proposal, levels) if levels > 0 else None
        return None


def answer_ends(output: Sequence[int], max_tokens: int) -> Callable[[int], bool] | None:
    """Where the engine's proposals end: at the model's end-of-generation tokens. A replay knows
    those only from an answer that stopped before `max_tokens` (greedy answers stop at one, its
    last token). An answer cut at `max_tokens` never reached one, so a proposal running past one is
    rejected there in any case (it costs the few tokens past it, which the engine does not draft)."""
    if output and len(output) < max_tokens:
        end = output[-1]
        return lambda t: t == end
    return None


def answer_lookup(output: Sequence[int], max_tokens: int) -> ContextLookup:
    """The context lookup as the engine makes it for this answer (its proposals end where the answer ended)."""
    return ContextLookup(answer_ends(output, max_tokens))


def renumbered(prompt: Sequence[int], output: Sequence[int]) -> tuple[list[int], list[int]]:
    """The prompt and the answer with their tokens numbered 0, 1, ... in order of first appearance.
    A replay compares tokens only with each other, so the numbers change nothing but the size of
    the drafter's rows (a row per draft level over the vocabulary: a few hundred tokens, not 150,000)."""
    ids: dict[int, int] = {}
    return [ids.setdefault(t, len(ids)) for t in prompt], [ids.setdefault(t, len(ids)) for t in output]


def answer_drafter(prompt: Sequence[int], output: Sequence[int], max_tokens: int, depth: int = DEPTH) -> NGramDrafter:
    """The engine's n-gram drafter for this answer, started on its prompt (its rows sized for
    drafts of `depth` tokens of those the prompt and answer hold)."""
    n_vocab = max(max(prompt, default=0), max(output, default=0)) + 1
    drafter = NGramDrafter(n_vocab, depth, answer_ends(output, max_tokens))
    drafter.start(prompt)
    return drafter


def drafted(drafter: NGramDrafter, picked: tuple[DraftProposal, int] | None) -> Draft:
    """The draft the engine would make of the policy's pick (none: nothing drafted). The n-gram
    drafter reads neither the pair's state nor a random generator: a replay has neither."""
    if picked is None:
        return NO_DRAFT
    proposal, levels = picked
    shape = TRUNCATED[levels] if levels < len(TRUNCATED) else SHAPE.truncated(levels)
    return drafter.draft(proposal, None, shape, GREEDY, None, False)  # type: ignore[arg-type]


class AnswerDecode:
    """One recorded answer decoded again a step at a time, as the engine's step does it: the
    drafter proposes, the policy picks (:meth:`draft`: `batch`, the tokens other calls put in the
    same target pass, as the pair's scheduler tells the engine), the recorded answer decides what
    is accepted and the policy observes what the pass cost (:meth:`commit`); :meth:`finish` ends
    it as the engine ends a generation. :func:`replay` runs one alone; the batch replay
    (benchmarks.replay.batch) runs several in the same passes."""

    def __init__(self, policy: Policy | Mapping[str, int], prompt: Sequence[int], output: Sequence[int],
                 max_tokens: int, depth: int = DEPTH, kinds: set[str] | None = None,
                 trace: Trace | None = None) -> None:
        self.policy: Policy = FixedDepths(policy) if isinstance(policy, Mapping) else policy
        self.prompt, self.output = renumbered(prompt, output)
        self.drafter = answer_drafter(self.prompt, self.output, max_tokens, depth)
        self.max_tokens, self.depth, self.kinds, self.trace = max_tokens, depth, kinds, trace
        self.position = self.steps = self.drafted = self.accepted = 0
        self.seconds = 0.0  # target time of the passes it took part in
        self._proposal: DraftProposal | None = None

    @property
    def done(self) -> bool:
        return self.position >= len(self.output)

    def _propose(self) -> int:
        """The drafter's proposal for this step (kept); the levels the step may draft."""
        i = self.position
        available = min(self.depth, self.max_tokens - i - 1)
        self._proposal = None
        if available <= 0:
            return 0
        self._proposal = self.drafter.propose([*self.prompt, *self.output[:i]], available)
        if self._proposal is not None and self.kinds is not None:
            self.kinds.add(self._proposal.kind)
        return available

    def draft(self, batch: int = 0) -> Draft:
        """This step's draft: the policy's pick of the drafter's proposal (none: a target-only step)."""
        available = self._propose()
        if available <= 0:
            return NO_DRAFT
        offered = [self._proposal] if self._proposal is not None else []
        return drafted(self.drafter, self.policy.pick(offered, available, len(self.prompt),
                                                      self.max_tokens - self.position, batch=batch))

    def offer(self) -> Offer | None:
        """This step's options for a round planned as a whole (the engine's step in a planned
        turn: localspec.decoding.batch_plan); None: it drafts as pick says (draft)."""
        available = self._propose()
        if available <= 0 or self._proposal is None:
            return None
        made = self.policy.offer([self._proposal], available, len(self.prompt), self.max_tokens - self.position)
        return None if made is None else made[1]

    def draft_at(self, levels: int) -> Draft:
        """The draft of the offered proposal at the depth the round's plan gave it."""
        assert self._proposal is not None
        return drafted(self.drafter, (self._proposal, levels) if levels > 0 else None)

    def commit(self, draft: Draft, seconds: float, pass_tokens: int | None = None) -> int:
        """The step's pass ran (`seconds`, `pass_tokens`: the whole pass's, other calls' tokens
        included; None: its own only): the answer says how much of `draft` is accepted, the
        policy observes it; returns the tokens committed."""
        i = self.position
        n = matched_run(draft.tree.tokens, self.output[i:]) if draft.n else 0
        if self.trace is not None:
            self.trace.append((i, self._proposal.kind if self._proposal is not None else None, draft.n, n))
        self.policy.observe_step(draft, n, seconds, self.output[i:i + n + 1], pass_tokens)
        self.seconds += seconds
        self.steps, self.drafted, self.accepted = self.steps + 1, self.drafted + draft.n, self.accepted + n
        self.position = i + n + 1
        return n + 1

    def finish(self) -> Replay:
        """As the engine ends a generation: what a planner learned goes into its profile."""
        self.policy.finish()
        return Replay(self.seconds, self.steps, self.drafted, self.accepted)


def replay(policy: Policy | Mapping[str, int], prompt: Sequence[int], output: Sequence[int],
           cost: Callable[[int], float], max_tokens: int, depth: int = DEPTH, kinds: set[str] | None = None,
           trace: Trace | None = None) -> Replay:
    """Decode `output` again as the engine would with the n-gram drafter and `policy` (a mapping:
    :class:`FixedDepths`), alone, each step costing cost(drafted + 1). `kinds` collects the kinds
    of the proposals seen; `trace`, every step's decision: (output position, kind of the proposal
    or None, depth drafted, tokens accepted)."""
    answer = AnswerDecode(policy, prompt, output, max_tokens, depth, kinds, trace)
    while not answer.done:
        draft = answer.draft()
        answer.commit(draft, cost(draft.n + 1))
    return answer.finish()
