"""The tree replay (benchmarks/replay/tree.py) on made-up token sequences, without a model: a tree of the lookup's
alternatives is priced by all its tokens, pays where the context's continuations differ and the
answer takes either, and never falls below the chain its search starts from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.replay import tree as tr
from localspec.decoding.costs import CostTable

CURVE = CostTable({1: 0.03, 2: 0.036, 4: 0.042, 8: 0.06, 16: 0.09, 32: 0.15})  # a flat (GPU-like) curve


def alternating(seed: int = 0) -> tuple[list[int], list[int]]:
    """A context where one marker is followed by either of two 2-token runs, and an answer that
    takes them in an order the lookup cannot know (after the marker it proposes one run; the
    other is the alternative a tree adds). Short runs: once a run's first token is out, the
    lookup knows the rest, so a tree saves a step only at the marker."""
    rng = np.random.default_rng(seed)
    words = [int(x) for x in rng.choice(np.arange(1000, 100000), size=300, replace=False)]
    marker, a, b = words[0], words[1:3], words[3:5]
    prompt = [*words[100:110], marker, *a, *words[110:115], marker, *b, *words[115:120]]
    output: list[int] = []
    for k, run in enumerate([a, a, b, a, b, b, a, b, a, b, b, a]):
        output += [marker, *run, words[150 + k]]
    return prompt, output


def test_a_tree_pays_where_the_answer_takes_either_continuation() -> None:
    prompt, output = alternating()
    chain, chain_policy = tr.hindsight(prompt, output, CURVE, len(output), (1,))
    tree, policy = tr.hindsight(prompt, output, CURVE, len(output), (1, 2), chain_policy)
    assert any(w == 2 for d, w in policy.values() if d), policy
    assert tree > chain * 1.1, (chain, tree)  # 1.57× against 1.38× here


def test_a_tree_is_priced_by_all_its_tokens_and_never_below_its_start() -> None:
    """With one alternative beside every draft, a step costs its tokens' pass; on text with no
    repeats (negative control) there is nothing to draft and both are the target alone."""
    prompt, output = alternating(1)
    chain, chain_policy = tr.hindsight(prompt, output, CURVE, len(output), (1,))
    wide = {kind: (depth, 2) for kind, (depth, _) in chain_policy.items()}
    assert tr.replay_tree(wide, prompt, output, CURVE, len(output)) != tr.replay_tree(
        chain_policy, prompt, output, CURVE, len(output))  # the alternatives cost (or win) something
    tree, _ = tr.hindsight(prompt, output, CURVE, len(output), (1, 2, 3), chain_policy)
    assert tree >= chain
    rng = np.random.default_rng(2)
    plain_prompt = [int(x) for x in rng.integers(1000, 10**6, size=40)]
    plain_output = [int(x) for x in rng.integers(1000, 10**6, size=40)]
    assert tr.hindsight(plain_prompt, plain_output, CURVE, 40, (1, 2, 3))[0] == pytest.approx(1.0)


def test_the_replay_needs_recorded_answers(tmp_path: Path, capsys) -> None:
    assert tr.main(["--answers", str(tmp_path / "none.json"), "--curve", "2:1.65"]) == 2
    assert "record them with" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tr.parse_args(["--answers", "a.json", "--curve", "2:1.65", "--width", "1"])
