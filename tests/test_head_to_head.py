"""The head-to-head benchmark's own arithmetic (benchmarks/head_to_head.py), without the real pair."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import head_to_head as h2h  # noqa: E402


def row(system: str = "localspec", tokens: int = 100, seconds: float = 4.0, be: float | None = 2.0,
        acc: float | None = 0.5) -> h2h.Row:
    return h2h.Row("code", 0.0, system, "model", "block", "fixed", tokens, seconds, be, acc, 0.01)


def test_repeats_merge_into_total_rates_and_mean_ratios() -> None:
    merged = h2h.merge_repeats([row(seconds=4.0, be=2.0), row("llama.cpp"), row(seconds=6.0, be=3.0, acc=None)])
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
    args = Namespace(seed=0, efficiency_seeds=1, efficiency_stride=2, efficiency_tokens=96, efficiency_draws=64)
    text = "\n".join(h2h.efficiency_report(scores, 300, args))
    assert "| block k8 / token k8 | 1.100 | 1.100–1.100 | ≥ 1.05 | met |" in text
    assert "| gbv K=3 k8 / block k8 | 1.000 | 1.000–1.000 | ≥ 1.15 | missed |" in text
    assert "| traversal tree 3x2x1x1x1x1x1x1 / rrsw tree 3x2x1x1x1x1x1x1 | 1.020 |" in text


def test_peak_rss_reads_the_child_process_own_high_water_mark(tiny_paths: tuple[Path, Path]) -> None:
    m = h2h.peak_rss_8k(tiny_paths[0], tiny_paths[1], 1, "read", "f16")
    assert m["files"] == tiny_paths[0].stat().st_size + tiny_paths[1].stat().st_size
    assert 10e6 < m["rss"] < 4e9  # a Python process with llama.cpp loaded, not this test's parent
    assert m["overhead"] == m["rss"] - m["files"]


def test_nonpositive_counts_are_usage_errors(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit) as exc:
        h2h.parse_args(["--efficiency-draws", "0"])
    assert exc.value.code == 2
    assert "--efficiency-draws must be at least 1" in capsys.readouterr().err
