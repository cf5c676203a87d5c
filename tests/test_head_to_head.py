"""The head-to-head benchmark's own arithmetic (benchmarks/decode/head_to_head.py and its report), without the
real pair."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from benchmarks.common.prompts import PROMPTS
from benchmarks.decode import head_to_head as h2h, head_to_head_report as report, memory
from benchmarks.replay.ceiling import ngram_runs, oracle_seconds


def row(system: str = "localspec", tokens: int = 100, seconds: float = 4.0, be: float | None = 2.0,
        acc: float | None = 0.5) -> report.Row:
    return report.Row("code", 0.0, system, "model", "block", "fixed", tokens, seconds, be, acc, 0.01)


def test_repeats_merge_into_total_rates_and_mean_ratios() -> None:
    merged = report.merge_repeats([row(seconds=4.0, be=2.0), row("llama.cpp"), row(seconds=6.0, be=3.0, acc=None)])
    assert [r.system for r in merged] == ["localspec", "llama.cpp"]
    ours = merged[0]
    assert (ours.tokens, ours.seconds) == (200, 10.0)
    assert ours.tps == 20.0
    assert ours.block_efficiency == 2.5 and ours.acceptance == 0.5


def test_efficiency_report_states_each_target() -> None:
    rng = np.random.default_rng(0)
    token = rng.uniform(3, 6, size=300)
    scores = {"token k8": token, "block k8": token * 1.10,  # clearly above 1.05
              "gbv K=3 k8": token * 1.10,  # equal to block: clearly below 1.15
              "rrsw tree 3x2x1x1x1x1x1x1": token, "traversal tree 3x2x1x1x1x1x1x1": token * 1.02}
    args = Namespace(seed=0, prompts=list(PROMPTS), efficiency_seeds=1, efficiency_stride=2, efficiency_tokens=96, efficiency_draws=64)
    text = "\n".join(report.efficiency_report(scores, 300, args))
    assert "| block k8 / token k8 | 1.100 | 1.100–1.100 | ≥ 1.05 | met |" in text
    assert "| gbv K=3 k8 / block k8 | 1.000 | 1.000–1.000 | ≥ 1.15 | missed |" in text
    assert "| traversal tree 3x2x1x1x1x1x1x1 / rrsw tree 3x2x1x1x1x1x1x1 | 1.020 |" in text


def test_peak_rss_reads_the_child_process_own_high_water_mark(tiny_paths: tuple[Path, Path]) -> None:
    m = memory.peak_rss_8k(tiny_paths[0], tiny_paths[1], 1, "read", "f16")
    assert m["files"] == tiny_paths[0].stat().st_size + tiny_paths[1].stat().st_size
    assert 10e6 < m["rss"] < 4e9  # a Python process with llama.cpp loaded, not this test's parent
    assert m["overhead"] == m["rss"] - m["files"]


def test_nonpositive_counts_are_usage_errors(capsys) -> None:

    with pytest.raises(SystemExit) as exc:
        h2h.parse_args(["--efficiency-draws", "0"])
    assert exc.value.code == 2
    assert "--efficiency-draws must be at least 1" in capsys.readouterr().err


def test_ngram_runs_count_the_lookups_right_proposals_in_a_row() -> None:
    # from the context ...6,1 the lookup proposes 2,3,4,5,6 (what followed the earlier 1): right four
    # times, then 9 differs; and so on as the match grows
    assert ngram_runs([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9]) == [0, 4, 3, 2, 1, 0]


def test_ngram_runs_with_alternatives_take_the_best_continuation() -> None:
    """After [9, 1] the longest match proposes 2; the shorter suffix [1] was also followed by 3,
    which the output takes: only the tree of candidates gets it (negative control: none)."""
    prompt, output = [9, 1, 2, 8, 1, 3, 7, 9], [1, 3]
    assert ngram_runs(prompt, output) == [1, 0]
    assert ngram_runs(prompt, output, alternatives=3) == [1, 1]


def test_oracle_seconds_is_the_cheapest_segmentation() -> None:
    runs = [0, 0, 3, 2, 1, 0]
    assert oracle_seconds(runs, lambda n: float(n), 31) == 6.0  # linear cost: drafting cannot help
    assert oracle_seconds(runs, lambda n: 1.0, 31) == 3.0  # free batches: 1 + 1 + (3 drafts + 1)
    assert oracle_seconds(runs, lambda n: 1.0, 1) == 4.0  # at most one draft per step
    assert oracle_seconds([], lambda n: 1.0, 4) == 0.0


def test_ngram_ceiling_report_against_the_measured_rows() -> None:
    prompt, output = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9]
    rows = [report.Row("code-edit", 0.0, "localspec", "-", "target only", "-", 6, 6.0, 1.0, None, None),
            report.Row("code-edit", 0.0, "localspec", "ngram", "block", "fixed", 6, 5.0, 1.5, 0.8, None)]
    curve = {1: 1.0, 2: 1.0, 32: 1.0}  # batches cost one step: the ceiling is the step count
    text = "\n".join(report.ngram_ceiling_report({("code-edit", 0.0): (prompt, output),
                                               ("code", 0.0): (prompt, output)}, curve, rows))
    assert "| code-edit | 0 | 6 | 67% | 3.00× | 3.00× | 1.20× |" in text  # 2 steps instead of 6: 0, then 4 + 1
    assert "| code |" not in text  # only the input-grounded prompts
    assert "| 1 | 1000.0 ms | 1.00 | 1.0 | 1.00× |" in "\n".join(report.cost_curve_report(curve))


def test_prompt_selection_and_extra_ngram_runs(capsys) -> None:

    args = h2h.parse_args(["--prompts", "code-edit,prose", "--ngram-k", "15"])
    assert args.prompts == ["code-edit", "prose"]
    extra = [c for c in h2h.localspec_configs("code-edit", 15) if c[3] == 15]
    assert extra == [("ngram", "block", "auto k15", 15), ("hybrid", "block", "auto k15", 15)]
    assert all(c[3] == report.K for c in h2h.localspec_configs("prose", 15))  # not an input-grounded prompt
    assert len(h2h.localspec_configs("code-edit", 0)) == len(h2h.LOCALSPEC_CONFIGS)
    with pytest.raises(SystemExit):
        h2h.parse_args(["--prompts", "code,poetry"])
    assert "unknown prompt(s) poetry in --prompts" in capsys.readouterr().err


def test_ngram_ratio_takes_the_best_plan() -> None:
    rows = [report.Row("code-edit", 0.0, "localspec", "-", "target only", "-", 100, 4.0, 1.0, None, None),
            report.Row("code-edit", 0.0, "localspec", "ngram", "block", "fixed", 100, 3.0, 2.0, 0.8, None),
            report.Row("code-edit", 0.0, "localspec", "ngram", "block", "auto k15", 100, 2.5, 3.0, 0.8, None)]
    assert "| ngram / target only (≥ 1.5) | code-edit | 0 | 1.60× |" in report.ratios(rows)


def test_expected_tokens_formula() -> None:
    """E[tokens per step] of a chain of drafts accepted at a constant rate (what-if table)."""
    from benchmarks.decode.head_to_head_report import expected_tokens

    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
