"""Longest-match lookup: the suffix automaton against brute force, proposals, re-alignment."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.decoding.lookup import ContextLookup, SuffixAutomaton


def brute_longest_repeat(seq: list[int]) -> tuple[int, int]:
    """Longest suffix of seq that also ends earlier, and its first end position."""
    n = len(seq)
    for length in range(n - 1, 0, -1):
        suffix = seq[n - length:]
        for end in range(length - 1, n - 1):
            if seq[end - length + 1: end + 1] == suffix:
                return length, end
    return 0, -1


@pytest.mark.parametrize("alphabet", [2, 3, 10])
def test_longest_repeat_equals_brute_force(alphabet: int) -> None:
    rng = np.random.default_rng(alphabet)
    for _ in range(30):
        sam, seq = SuffixAutomaton(), []
        for t in rng.integers(0, alphabet, size=60).tolist():
            sam.extend(t)
            seq.append(t)
            assert sam.longest_repeat() == brute_longest_repeat(seq), seq


def test_proposal_copies_what_followed_the_longest_match() -> None:
    source = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    look = ContextLookup()
    context = source + [50, 51] + [1, 2, 3, 4, 5]
    p = look.propose(context, depth=3)
    assert p is not None and p.tokens == (6, 7, 8) and p.match == 5 and p.kind == "m4-7" and p.source == 5
    assert look.propose([7, 8, 9], depth=4) is None  # a new context, nothing repeats


def test_realignment_after_a_replaced_token() -> None:
    """Copying a source, the output writes 99 where the source has 4: copying goes on after 4."""
    source = [10, 11, 12, 13, 4, 20, 21, 22, 23]
    look = ContextLookup()
    context = source + [10, 11, 12, 13]
    p = look.propose(context, depth=5)
    assert p.tokens == (4, 20, 21, 22, 23)
    context.append(99)  # the target rejected 4 and wrote 99 instead
    p = look.propose(context, depth=3)
    assert p is not None and p.tokens == (20, 21, 22) and p.kind == "realign"
    # control: without the cursor, the longest match (none: 99 is new) proposes nothing
    assert ContextLookup().propose(context, depth=3) is None
    context += [20, 21]  # it copies on: the proposals follow the source, with the run as evidence
    p = look.propose(context, depth=2)
    assert p is not None and p.tokens == (22, 23) and p.match == 2 and p.kind == "m2-3"


def test_a_rename_is_applied_to_later_copies_of_the_source() -> None:
    """Copying a source, the output writes 99 where the source has 4 and then copies on: a rename.
    Later copies of the source propose 99 for 4, until the output keeps a 4."""
    source = [10, 11, 4, 12, 13, 14, 15, 4, 16, 17, 18]
    look = ContextLookup()
    context = source + [10, 11]
    look.propose(context, depth=3)
    context += [99, 12, 13]  # 4 renamed to 99, then the copy goes on
    p = look.propose(context, depth=4)
    assert p is not None and p.tokens == (14, 15, 99, 16)
    # control: a replaced token followed by one copied token and another miss is no rename
    other = ContextLookup()
    ctx = source + [10, 11]
    other.propose(ctx, depth=3)
    ctx += [99, 12, 98, 14]
    p = other.propose(ctx, depth=3)
    assert p is not None and p.tokens == (15, 4, 16) and not other.renamed
    context += [14, 15, 4]  # the output kept 4 this time: the rename is forgotten
    look.propose(context, depth=2)
    assert 4 not in look.renamed


def test_after_a_deletion_the_match_finds_the_place_again() -> None:
    """The output skips source tokens 13 and 14: the last token (15) occurs in the source, so the
    proposal continues after it there, not one token past the replaced one (the re-alignment,
    which only guesses at single-token substitutions)."""
    source = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    look = ContextLookup()
    context = source + [10, 11, 12]
    look.propose(context, depth=3)
    context.append(15)
    p = look.propose(context, depth=3)
    assert p is not None and p.tokens == (16, 17, 18) and p.kind == "m1"


def test_a_proposal_ends_at_an_end_of_generation_token() -> None:
    """The output copies the prompt's last line, which the chat template follows with the turn's
    end (2) and the next turn's header (3, 4): the proposal stops at 2, where the generation would
    stop, instead of drafting the header after it."""
    prompt = [10, 11, 12, 13, 14, 2, 3, 4]
    look = ContextLookup(ends=lambda t: t == 2)
    p = look.propose(prompt + [10, 11, 12], depth=6)
    assert p is not None and p.tokens == (13, 14, 2)
    # control: a lookup without the model's end tokens drafts on into the next turn
    assert ContextLookup().propose(prompt + [10, 11, 12], depth=6).tokens == (13, 14, 2, 3, 4, 10)
