"""benchmarks/process/checkout_ab.py: two checkouts side by side, without the real pair (this checkout on
both sides, the tiny models): it refuses what is not a checkout, and its table says whether the
texts agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.process import checkout_ab

ROOT = Path(__file__).resolve().parents[1]


def test_a_directory_that_is_not_a_checkout_is_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        checkout_ab.parse_args(["--old", str(tmp_path), "--new", str(ROOT)])
    assert exc.value.code == 2 and "not a localspec checkout" in capsys.readouterr().err
    (tmp_path / "localspec").mkdir()
    (tmp_path / "localspec" / "__init__.py").write_text("")
    with pytest.raises(SystemExit):
        checkout_ab.parse_args(["--old", str(tmp_path), "--new", str(ROOT)])
    assert "compiled verifier is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        checkout_ab.parse_args(["--old", str(ROOT), "--new", str(ROOT), "--prompts", "nope"])
    assert "unknown prompt 'nope'" in capsys.readouterr().err


def test_the_same_checkout_on_both_sides_writes_the_same_text(tiny_paths: tuple[Path, Path], tmp_path: Path,
                                                              capsys) -> None:
    args = ["--old", str(ROOT), "--new", str(ROOT), "--prompts", "code", "--repeat", "1", "--tokens", "6",
            "--profiles", str(tmp_path / "none"), "--", "-m", str(tiny_paths[0]), "-d", "none", "--ctx-size", "512"]
    assert checkout_ab.main(args) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| code |"))
    assert row.endswith("| yes |"), row
    # negative control: sampled without a seed, the two sides' texts differ (6 tokens of a model with
    # random weights over 406 tokens, at temperature 1.5: none of 12 trial runs agreed by chance)
    assert checkout_ab.main([*args, "-t", "1.5"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| code |"))
    assert row.endswith("| no |"), row
