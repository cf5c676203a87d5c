"""`localspec bench` and `localspec check` through CliRunner on the tiny models, and their libraries."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from localspec.bench import prompts as prompt_sets, runs as bench
from localspec.bench import checks as check
from localspec.verify import stats
from localspec.cli import cli
from localspec.settings.sampling import SamplingParams
from localspec.settings.shape import Shape
from localspec.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def pair_args(tiny_paths: tuple[Path, Path]) -> list[str]:
    return ["-m", str(tiny_paths[0]), "-d", str(tiny_paths[1]), "--ctx-size", "512", "--threads", "1"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "mine.txt"
    path.write_text("def add(a, b):\n\nThe quick brown fox\n", encoding="utf-8")
    return path


def clean_error(result, code: int, *needles: str) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, (needle, result.output)


# ---------------------------------------------------------------- bench


@pytest.fixture(scope="module")
def bench_run(pair_args: list[str], prompt_file: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("bench-out") / "results"
    result = run("bench", *pair_args, "--prompts", str(prompt_file), "-n", "8", "--verifiers", "block,traversal",
                 "--shapes", "k2,t2x1", "--temperatures", "0,0.8", "--out", str(out))
    return result, out


def test_bench_prints_a_table_with_baseline_and_speculative_rows(bench_run) -> None:
    result, out = bench_run
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "| " + " | ".join(bench.COLUMNS) + " |"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    # per temperature: the baseline, block/k2, traversal/k2, traversal/t2x1 (block with a tree is skipped)
    assert [(r[1], r[2], r[4]) for r in rows] == [
        (t, v, s) for t in ("0", "0.8")
        for v, s in (("target only", "-"), ("block", "k2"), ("traversal", "k2"), ("traversal", "t2x1"))]
    assert all(r[0] == "mine" for r in rows)
    assert all(r[7] == "1.00x" for r in rows if r[2] == "target only")
    assert "skipped block/model/t2x1" in result.stderr
    assert f"wrote {out / 'bench.json'}" in result.stderr and f"wrote {out / 'bench.png'}" in result.stderr


def test_bench_json_has_every_row_with_its_metrics(bench_run) -> None:
    _, out = bench_run
    data = json.loads((out / "bench.json").read_text())
    assert data["settings"]["shapes"] == ["k2", "t2x1"] and data["settings"]["plan"] == "fixed"
    rows = data["results"]
    assert len(rows) == 8
    for row in rows:
        assert 0 < row["generated_tokens"] <= 2 * 8  # two prompts, at most 8 tokens each
        assert row["generations"] == 2
        assert row["tokens_per_second"] > 0 and row["generation_seconds"] > 0
        if row["baseline"]:
            assert row["speedup"] == 1.0 and row["drafted_tokens"] == 0 and row["block_efficiency"] == 1.0
        else:
            base = next(r for r in rows if r["baseline"] and r["temperature"] == row["temperature"])
            assert row["speedup"] == pytest.approx(row["tokens_per_second"] / base["tokens_per_second"])
            assert row["drafted_tokens"] > 0 and 0 <= row["acceptance_rate"] <= 1
            assert row["acceptance_rate"] == pytest.approx(row["accepted_tokens"] / row["drafted_tokens"])
            assert 0 < row["verifier_share"] < 1
    greedy_block = next(r for r in rows if r["temperature"] == 0 and r["verifier"] == "block")
    assert greedy_block["block_efficiency"] > 1.0  # the close tiny draft gets tokens accepted


def test_bench_png_is_written(bench_run) -> None:
    _, out = bench_run
    data = (out / "bench.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


@pytest.mark.parametrize("args,needles", [
    (["--shapes", "k4,x9"], ["--shapes", "'x9'", "kN"]),
    (["--shapes", "k0"], ["--shapes", "'k0'"]),
    (["--shapes", "k4,,k8"], ["--shapes", "empty"]),
    (["--verifiers", "block,bogus"], ["--verifiers", "'bogus'", "traversal"]),
    (["--drafters", "psychic"], ["--drafters", "'psychic'"]),
    (["--temperatures", "0,hot"], ["--temperatures", "'hot'"]),
    (["--temperatures", "-1"], ["--temperatures", "'-1'"]),
    (["--prompts", "/nonexistent/prompts.txt"], ["--prompts", "/nonexistent/prompts.txt", "does not exist"]),
])
def test_bench_bad_options_are_clean_errors(pair_args: list[str], args: list[str], needles: list[str]) -> None:
    clean_error(run("bench", *pair_args, *args), 2, *needles)


def test_bench_bad_prompt_files(pair_args: list[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    clean_error(run("bench", *pair_args, "--prompts", str(empty)), 2, str(empty), "no prompts")
    broken = tmp_path / "broken.json"
    broken.write_text('["a", ')
    clean_error(run("bench", *pair_args, "--prompts", str(broken)), 2, str(broken), "not valid JSON")


def test_bench_with_no_valid_combination(pair_args: list[str], prompt_file: Path, tmp_path: Path) -> None:
    result = run("bench", *pair_args, "--prompts", str(prompt_file), "--verifiers", "block", "--shapes", "t2x2",
                 "--out", str(tmp_path))
    clean_error(result, 2, "no valid speculative configuration", "block")


def test_parse_shape_and_prompt_files(tmp_path: Path) -> None:
    """One parser for every spelling of a draft shape (bench's, --tree's, the server's list)."""
    assert Shape.parse("k4") == Shape.chain(4) and Shape.parse("k4").label == "k4"
    assert Shape.parse("P3K4") == Shape.k_paths(3, 4) and Shape.parse("p3k4").label == "p3k4"
    assert Shape.parse("t3x2x1") == Shape.parse("3x2x1") == Shape.parse("3,2,1") == Shape.parse([3, 2, 1]) \
        == Shape.tree((3, 2, 1))
    assert Shape.parse("4") == Shape.tree((4,))
    for bad in ("", "k", "t3x", "p3", "k-1", "t0x2", "k65", "p17k2", "3xa", [], [0], ["2"]):
        with pytest.raises(ConfigError):
            Shape.parse(bad)
    listed = tmp_path / "set.json"
    listed.write_text(json.dumps(["first prompt\nwith two lines", "second"]))
    assert prompt_sets.load_prompts(str(listed)) == {"set": ("first prompt\nwith two lines", "second")}
    assert set(prompt_sets.load_prompts("all")) == {"code", "prose", "code-edit"}
    assert all(3 <= len(p) <= 4 for p in prompt_sets.PROMPT_SETS.values())


# ---------------------------------------------------------------- check


def test_check_toy_only_passes_and_shows_the_control() -> None:
    result = run("check", "--toy-only")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "FAIL" not in out
    for method in check.LOSSLESS_METHODS:
        assert f"PASS  exact {method} " in out and f"PASS  chi-square {method} (C)" in out
        assert f"PASS  exact {method} masked " in out and f"PASS  chi-square {method} masked (C)" in out
    assert "PASS  control: detected" in out and "PASS  control (masks dropped): detected" in out
    assert "alpha = 0.001" in out and "1.60%" in out  # the stated false-positive rate (16 chi-square checks)
    assert "model pair" not in out


def test_check_on_the_tiny_pair_passes(pair_args: list[str]) -> None:
    result = run("check", *pair_args, "--samples", "1500")
    assert result.exit_code == 0, result.output
    assert "PASS  pair first token (block, k=4)" in result.stdout
    assert "all 37 checks passed" in result.stdout


def test_check_fails_when_verification_is_lossy(tiny_paths: tuple[Path, Path], far_draft_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The user-facing command exits 1 when the speculative step is lossy (hidden --lenience)."""
    monkeypatch.setattr(check, "toy_suite", lambda *a, **k: [])  # the toy checks run in the test above
    result = run("check", "-m", str(tiny_paths[0]), "-d", str(far_draft_path), "--ctx-size", "512",
                 "--threads", "1", "--samples", "1500", "--lenience", "0.9")
    assert result.exit_code == 1, result.output
    assert "FAIL  pair first token (token, k=4, LOSSY lenience 0.9)" in result.stdout
    assert "1 of 1 checks FAILED" in result.stdout


def test_check_needs_a_draft_for_the_pair(tiny_paths: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "toy_suite", lambda *a, **k: [])
    result = run("check", "-m", str(tiny_paths[0]), "-d", "none", "--ctx-size", "512")
    clean_error(result, 1, "needs a draft model", "--toy-only")


def test_pair_check_library(tiny_target, far_draft) -> None:
    ok = check.pair_check(tiny_target, far_draft, samples=1500, alpha=1e-3, seed=3,
                          sampling=SamplingParams(1.0))
    assert ok.passed and ok.numbers["p_value"] > 1e-3 and ok.numbers["acceptance"] > 0
    assert ok.numbers["categories"] > 20  # full vocabulary at T=1: a many-category test
    lossy = check.pair_check(tiny_target, far_draft, samples=1500, alpha=1e-3, seed=3, lenience=0.5,
                             sampling=SamplingParams(1.0))
    assert not lossy.passed and lossy.numbers["p_value"] < 1e-3


def test_chi_square_without_scipy_matches_scipy() -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    for x, dof in [(0.5, 1), (3.0, 2), (10.0, 3), (25.0, 24), (200.0, 30), (1000.0, 5), (0.01, 40)]:
        assert stats.chi2_sf(x, dof) == pytest.approx(scipy_stats.chi2.sf(x, dof), rel=1e-9, abs=1e-300)
    counts = {0: 40, 1: 35, 2: 25}
    probs = {0: 0.4, 1: 0.35, 2: 0.25}
    assert stats.pearson_pvalue(counts, probs) == (0.0, 2, 1.0)
    stat, dof, p = stats.pearson_pvalue({0: 70, 1: 20, 2: 10}, probs)
    ref = scipy_stats.chisquare([70, 20, 10], [40, 35, 25])
    assert stat == pytest.approx(ref.statistic) and p == pytest.approx(ref.pvalue)
    assert stats.pearson_pvalue({0: 99, 3: 1}, probs)[2] == 0.0  # an impossible outcome
    assert not math.isnan(stats.pearson_pvalue({}, probs)[2])


def test_negative_control_is_detected_and_a_lossless_rule_is_not() -> None:
    control = check.negative_control(alpha=1e-3, seed=0, n=2000)
    assert control.passed and control.control and control.name == "control: detected"
    assert control.numbers["exact_error"] > 0.1 and control.numbers["p_value"] < 1e-3
    assert check.monte_carlo_check("token", alpha=1e-3, seed=0, n=2000).passed
