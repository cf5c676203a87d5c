"""What a plain install gets (pyproject.toml): every package directory of localspec/ is listed (a
`pip install .` that is not editable copies only those), and every third-party module the
package imports is a dependency of the plain install, but for the server (the extra
localspec[server]) and the plot (localspec[plot], imported behind a clear error). The tests
install the extras too, so only this check sees what a plain `pip install .` lacks."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
OPTIONAL = {"server": "server", "bench/runs.py:matplotlib": "plot"}  # where an extra's import may be


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def third_party_imports(directory: Path) -> dict[str, set[str]]:
    """Top-level module → the files (relative to `directory`) that import it, anywhere in them."""
    found: dict[str, set[str]] = {}
    for path in sorted(directory.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "localspec":
                    found.setdefault(top, set()).add(path.relative_to(directory).as_posix())
    return found


def missing_dependencies(directory: Path, base: set[str]) -> list[str]:
    distributions = packages_distributions()
    missing = []
    for module, files in third_party_imports(directory).items():
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if names & base:
            continue
        allowed = [f for f in files if f.startswith("server/") or f"{f}:{module}" in OPTIONAL]
        missing += [f"{module} ({f})" for f in sorted(files) if f not in allowed]
    return missing


def test_every_package_directory_is_installed() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = {".".join(("localspec", *p.parent.relative_to(ROOT / "localspec").parts))
               for p in (ROOT / "localspec").rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)


def test_a_plain_install_has_what_the_package_imports() -> None:
    base = requirement_names(PYPROJECT["project"]["dependencies"])
    assert missing_dependencies(ROOT / "localspec", base) == []


def test_negative_control_an_undeclared_import_is_found(tmp_path: Path) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "run.py").write_text("def f():\n    from pydantic import BaseModel\n", encoding="utf-8")
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "app.py").write_text("import starlette\n", encoding="utf-8")
    assert missing_dependencies(tmp_path, {"numpy"}) == ["pydantic (core/run.py)"]
