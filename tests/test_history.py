"""Drafts from earlier calls (localspec.decoding.history): the index finds what followed the
longest match in earlier calls, never across two of them, within its bound; drafting from it
never changes the output (T = 0 text identical, the first tokens' law at T = 1 the target's)."""

from __future__ import annotations

from localspec.api import stream_generate
from localspec.decoding.history import MIN_MATCH, History, history_kind
from localspec.llama.model import Model
from localspec.prompt import prompt_tokens

from test_engine import ALPHA, N_FIRST, N_PLAIN, N_SPEC, SAMPLING, first_tokens_key, two_sample_p


def proposal(history: History, context: list[int], depth: int = 8) -> tuple[int, ...]:
    match = history.matcher()
    for t in context:
        match.feed(t)
    return match.continuation(depth, None)


def test_the_continuation_of_the_longest_match() -> None:
    history = History()
    history.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    history.add([20, 21, 22, 23, 24, 25, 26, 27])
    assert proposal(history, [99, 3, 4, 5, 6]) == (7, 8, 9, 10)  # up to the call's end
    assert proposal(history, [21, 22, 23, 24], depth=2) == (25, 26)
    assert proposal(history, [4, 5, 6]) == ()  # shorter than MIN_MATCH: chance
    assert proposal(history, [77, 78, 79, 80, 81]) == ()  # the control: nothing like it before


def test_a_match_never_spans_two_calls() -> None:
    history = History()
    history.add([1, 2, 3, 4, 5, 6, 7, 8])
    history.add([9, 10, 11, 12, 13, 14, 15, 16])
    assert proposal(history, [5, 6, 7, 8, 9, 10]) == ()  # 8 then 9 were never one call's
    assert len(proposal(history, [6, 7, 8, 9, 10, 11, 12])) > 0  # the control: within the second call


def test_the_history_is_bounded_newest_first() -> None:
    history = History(limit=64)
    for i in range(20):
        history.add([1000 + i] + list(range(10 * i, 10 * i + 9)))
    assert history.size <= 64
    assert proposal(history, [190, 191, 192, 193]) == (194, 195, 196, 197, 198)  # the newest is kept
    assert proposal(history, [0, 1, 2, 3]) == ()  # the oldest went


def test_history_kinds_are_buckets_of_the_match() -> None:
    assert history_kind(MIN_MATCH) == "history:m4-7" and history_kind(40) == "history:m32+"


PROMPT = "The fox said: the quick brown fox jumps over the lazy dog and"


def test_greedy_text_is_the_targets_and_earlier_calls_are_drafted(tiny_target: Model) -> None:
    """An earlier call's answer is drafted from (accepted history drafts) and the text is the
    target alone's; the control: without a history nothing of that kind is drafted."""
    alone = "".join(r.text for r in stream_generate(tiny_target, None, PROMPT, temperature=0, max_tokens=40,
                                                    num_draft_tokens=0))
    history = History()
    list(stream_generate(tiny_target, None, PROMPT, temperature=0, max_tokens=40, history=history))
    assert history.size > 40
    runs = list(stream_generate(tiny_target, None, PROMPT, temperature=0, max_tokens=40, history=history,
                                drafter="ngram", plan="fixed", num_draft_tokens=8))
    assert "".join(r.text for r in runs) == alone
    by_kind = dict(runs[-1].stats.accepted_by_kind)
    assert sum(n for kind, n in by_kind.items() if kind.startswith("history:")) > 10, by_kind
    plain = list(stream_generate(tiny_target, None, PROMPT, temperature=0, max_tokens=40, drafter="ngram",
                                 plan="fixed", num_draft_tokens=8))
    assert not any(kind.startswith("history:") for kind, _ in plain[-1].stats.accepted_by_kind)


def earlier_calls(target: Model, prompt: str, n: int = 30) -> History:
    """A history of `n` earlier sampled calls of `prompt` (what drafting from history proposes)."""
    history = History()
    base = prompt_tokens(target, prompt)
    for i in range(n):
        tokens = [r.token for r in stream_generate(target, None, prompt, max_tokens=12, seed=6000 + i, **SAMPLING)]
        history.add(base + [t for t in tokens if t is not None])
    return history


def test_history_drafts_keep_the_target_distribution(tiny_target: Model) -> None:
    """At T = 1 the first tokens after a prompt seen before follow the target's law (chi-square,
    false-positive rate ALPHA), though drafts from the earlier calls are proposed and accepted."""
    prompt = "ab"
    history = earlier_calls(tiny_target, prompt)
    plain = [first_tokens_key(tiny_target, None, 10**6 + i, prompt) for i in range(N_PLAIN)]
    runs = [list(stream_generate(tiny_target, None, prompt, max_tokens=N_FIRST, seed=i, drafter="ngram",
                                 verifier="block", num_draft_tokens=3, plan="fixed", history=history, **SAMPLING))
            for i in range(N_SPEC)]
    accepted = sum(n for r in runs for kind, n in r[-1].stats.accepted_by_kind if kind.startswith("history:"))
    assert accepted > N_SPEC // 10, accepted  # history drafts were proposed and taken
    p = two_sample_p([tuple(x.token for x in r) for r in runs], plain)
    assert p > ALPHA, f"drafting from earlier calls changed the first-token distribution (p={p:.2e})"


def test_negative_control_accepting_history_drafts_lossily_fails(tiny_target: Model) -> None:
    """The same test catches a lossy acceptance of the history's drafts (lenience over-accepts
    them): the output then leans towards what earlier calls said."""
    prompt = "ab"
    history = earlier_calls(tiny_target, prompt)
    plain = [first_tokens_key(tiny_target, None, 10**6 + i, prompt) for i in range(N_PLAIN)]
    runs = [list(stream_generate(tiny_target, None, prompt, max_tokens=N_FIRST, seed=i, drafter="ngram",
                                 verifier="token", lenience=0.9, num_draft_tokens=3, plan="fixed", history=history,
                                 **SAMPLING))
            for i in range(N_SPEC)]
    assert two_sample_p([tuple(x.token for x in r) for r in runs], plain) < ALPHA
