"""KVSequence: the one owner of what a model's KV cache holds (localspec.llama.sequence)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from localspec.errors import ModelError
from localspec.llama.sequence import KVSequence, common_prefix

from conftest import load

PROMPT = "def add(a, b): return a + b"


class Recorder:
    """A follower that mirrors the committed tokens (what a grammar matcher must do)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.resets = 0

    def reset(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.resets += 1

    def commit(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def rollback(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n:]


def last_logits(seq: KVSequence) -> np.ndarray:
    return np.array(seq.model.logits_array(1)[0])


def fresh_logits(path: Path, tokens: list[int]) -> np.ndarray:
    with load(path) as m:
        m.prefill(tokens, 0)
        return np.array(m.logits_array(1)[0])


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2, 3]) == 2


def test_start_reuses_the_shared_prefix_and_followers_follow(tiny_paths: tuple[Path, Path]) -> None:
    with load(tiny_paths[0]) as m:
        seq, rec = m.sequence, Recorder()
        seq.followers.append(rec)
        prompt = m.tokenize(PROMPT)
        assert seq.start(prompt) == 0 and rec.tokens == prompt
        seq.fill(len(prompt) - 1)
        assert seq.n_cached == len(prompt) - 1 and seq.pending == 1
        seq.commit([300, 301])
        assert rec.tokens == prompt + [300, 301]
        other = prompt[:5] + [302, 303]
        assert seq.start(other) == 5  # only the shared, cached prefix is kept
        assert seq.tokens == other and rec.tokens == other and rec.resets == 2
        seq.fill()
        np.testing.assert_allclose(last_logits(seq), fresh_logits(tiny_paths[0], other), rtol=0, atol=1e-4)


def test_rollback_withdraws_from_the_cache_and_the_followers(tiny_paths: tuple[Path, Path]) -> None:
    with load(tiny_paths[0]) as m:
        seq, rec = m.sequence, Recorder()
        seq.followers.append(rec)
        prompt = m.tokenize(PROMPT)
        seq.start(prompt)
        seq.commit([310, 311, 312])
        seq.fill()
        seq.rollback(3)
        assert seq.tokens == prompt and seq.n_cached == len(prompt) and rec.tokens == prompt
        seq.commit([320])
        seq.fill()
        np.testing.assert_allclose(last_logits(seq), fresh_logits(tiny_paths[0], prompt + [320]), rtol=0, atol=1e-4)


def test_keep_branch_keeps_the_accepted_path(tiny_paths: tuple[Path, Path]) -> None:
    """Two branches decoded on forked sequences; keeping branch 1 leaves exactly its tokens."""
    with load(tiny_paths[0]) as m:
        seq = m.sequence
        prompt = m.tokenize(PROMPT)
        L = len(prompt)
        seq.start(prompt)
        seq.fill(L - 1)
        seq.fork(2)
        seq.decode([prompt[-1], 340, 341], [L - 1, L, L], [(0, 1), (0,), (1,)])
        seq.commit([341, 342])
        seq.keep_branch(1, L + 1)
        assert seq.n_cached == L + 1 and seq.pending == 1
        seq.fill()
        np.testing.assert_allclose(last_logits(seq), fresh_logits(tiny_paths[0], prompt + [341, 342]),
                                   rtol=0, atol=1e-4)


def test_a_failed_operation_leaves_the_cache_untrusted_and_start_clears_it(tiny_paths: tuple[Path, Path]) -> None:
    """A decode that fails half-way: the next start reuses nothing (the cache's content is unknown)."""
    with load(tiny_paths[0], n_ctx=64) as m:
        seq = m.sequence
        prompt = m.tokenize(PROMPT)
        seq.start(prompt)
        seq.fill()
        seq.commit(list(range(400, 400 + 80)))  # past the context: decoding them fails
        with pytest.raises(ModelError):
            seq.fill()
        assert seq.start(prompt) == 0
        seq.fill()
        np.testing.assert_allclose(last_logits(seq), fresh_logits(tiny_paths[0], prompt), rtol=0, atol=1e-4)


def test_the_stop_scanner_follows_commits_and_rollbacks(tiny_target) -> None:
    """The stop-string scanner is the target sequence's follower: text per committed token, cut
    at a stop string; a rollback of tokens not yet handed out gives the text of the rest."""
    from localspec.decoding.text import StopScanner

    words = tiny_target.tokenize(" alpha beta gamma", add_special=False)
    scanner = StopScanner(tiny_target, ["gamma"])
    scanner.reset([1, 2])
    scanner.commit(words[:2])
    first = scanner.take()
    scanner.commit(words[2:])
    scanner.rollback(len(words) - 2)  # withdrawn before they were handed out
    assert scanner.take() == [] and not scanner.stopped
    scanner.commit(words[2:])
    text = "".join(t for _, t in first + scanner.take())
    straight = StopScanner(tiny_target, ["gamma"])
    straight.commit(words)  # the same tokens, never rolled back
    assert scanner.stopped and text == "".join(t for _, t in straight.take())
    assert "alpha beta" in text and "gamma" not in text
    with pytest.raises(RuntimeError, match="already handed out"):
        scanner.rollback(len(words))
