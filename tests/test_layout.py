"""The package's layout: imports go one way. No module of localspec/ imports one that imports it
back, function-level imports included; within localspec/cli/: ``__init__`` → commands → ``options``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"localspec": ROOT / "localspec", "localspec.models": ROOT / "models"}  # pyproject's package-dir


def find_modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Module name → file, for every .py under each package's directory (subpackages included)."""
    found = {}
    for name, directory in packages.items():
        for path in sorted(directory.rglob("*.py")):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `module` imports anywhere in its file (in functions too),
    relative imports resolved. ``from pkg import sub`` counts as importing pkg.sub, not pkg; and
    ``import pkg.sub`` as importing pkg.sub: a package's ``__init__`` may import its submodules."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            names = submodules + ([base] if len(submodules) < len(node.names) else [])
        else:
            continue
        found.update(name for name in names if name in known and name != module)
    return found


def import_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the modules it imports, for the modules of `packages`."""
    modules = find_modules(packages)
    return {module: imports_of(module, path, set(modules)) for module, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle as a path that ends where it starts (a → b → a), or None."""
    state: dict[str, str] = {}  # "open" while on the path, then "done"
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_import_cycle() -> None:
    graph = import_graph(PACKAGES)
    # the checker sees the code: module-level and function-level imports, the package's own edges
    assert "localspec.cli.options" in graph["localspec.cli.chat"]
    assert "localspec.core.run" in graph["localspec.cli.resolve"]  # imported inside a function
    assert "localspec.cli.generate" in graph["localspec.cli"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cli_modules_do_not_import_the_cli_package() -> None:
    graph = import_graph(PACKAGES)
    back = sorted(module for module, imported in graph.items()
                  if module.startswith("localspec.cli.") and "localspec.cli" in imported)
    assert not back, f"these import localspec.cli (the package): {back}"
    assert not {module for module in graph["localspec.cli.options"] if module.startswith("localspec.cli")}


def test_every_cli_module_adds_its_command() -> None:
    """localspec/cli/__init__ lists the command modules by hand (imported when they run): none is
    forgotten (a module that defines a click command adds one to the root; the others, e.g.
    report, support them)."""
    from localspec.cli import cli

    ctx = click.Context(cli)
    registered = {id(cli.get_command(ctx, name)) for name in cli.list_commands(ctx)}
    with_commands = []
    for path in sorted((ROOT / "localspec" / "cli").glob("*.py")):
        if path.stem in ("__init__", "options"):
            continue
        module = importlib.import_module(f"localspec.cli.{path.stem}")
        commands = [value for value in vars(module).values() if isinstance(value, click.Command)
                    and (value.callback is None or value.callback.__module__ == module.__name__)]
        if commands:
            with_commands.append(path.stem)
            assert any(id(command) in registered for command in commands), f"{path.name} adds no command to the root"
    assert len(with_commands) >= 8, with_commands


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_checker_finds_a_cycle(tmp_path: Path) -> None:
    """Negative control: a cycle through a relative import and two function-level imports is found,
    and once it is broken there is none."""
    pkg = tmp_path / "pkg"
    write(pkg / "__init__.py", "from pkg import a\n")
    write(pkg / "a.py", "from .b import f\n")
    write(pkg / "b.py", "def f():\n    from pkg.sub import c\n")
    write(pkg / "sub" / "__init__.py", "")
    write(pkg / "sub" / "c.py", "def g():\n    if True:\n        from .. import a\n")
    graph = import_graph({"pkg": pkg})
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c"}, "pkg.sub": set(),
                     "pkg.sub.c": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]

    write(pkg / "sub" / "c.py", "def g():\n    import os\n")
    assert find_cycle(import_graph({"pkg": pkg})) is None


# ---------------------------------------------------------------- the benchmarks package

BENCHMARKS = {"benchmarks": ROOT / "benchmarks"}
MAX_LINES = 450


def test_benchmarks_import_no_cycle_and_no_private_names_across_modules() -> None:
    """benchmarks/ is one package: its modules import each other by absolute name, never in a cycle,
    and none takes another's private (underscored) names."""
    graph = import_graph(BENCHMARKS)
    assert "benchmarks.common.runs" in graph["benchmarks.process.whole_process"]  # the checker sees the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
    modules = find_modules(BENCHMARKS)
    borrowed = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "") in modules:
                borrowed += [f"{module}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not borrowed, borrowed


def test_benchmarks_keep_to_their_package() -> None:
    """No module puts a directory on sys.path or imports the test suite's helpers (tests import the
    benchmarks, not the other way round), and none is longer than MAX_LINES."""
    test_helpers = {p.stem for p in (ROOT / "tests").glob("*.py")}
    for module, path in find_modules(BENCHMARKS).items():
        text = path.read_text(encoding="utf-8")
        assert "sys.path" not in text, f"{module} changes sys.path"
        assert len(text.splitlines()) <= MAX_LINES, f"{module}: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text, str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not {n.split(".")[0] for n in names} & test_helpers, f"{module} imports tests/: {names}"


def test_the_commands_the_docs_show_run_their_modules(tmp_path: Path) -> None:
    """`python benchmarks/NAME.py` runs its module of the package (from the repository root, as the
    docs give it, and from elsewhere); every such script names a module that exists."""
    import subprocess
    import sys

    scripts = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "launch"))
    assert len(scripts) >= 14
    modules = find_modules(BENCHMARKS)
    for script in scripts:
        named = [n for n in modules if f'run_module("{n}")' in script.read_text(encoding="utf-8")]
        assert len(named) == 1, f"{script.name} names no module of the package"
    for cwd in (ROOT, tmp_path):
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tree_replay.py"), "--help"], cwd=cwd,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "--answers" in out.stdout, out.stderr


# ---------------------------------------------------------------- packages as a whole

def package_graph(graph: dict[str, set[str]], roots: tuple[str, ...]) -> dict[str, set[str]]:
    """The module graph collapsed to packages: localspec.cli.resolve → localspec.cli, a top module
    (localspec.api) stays itself. A root package's own ``__init__`` (localspec: its lazy public
    names) is left out, as an edge to it names the package's version, not its contents."""
    def package(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:2]) if parts[0] in roots and len(parts) > 1 else None

    collapsed: dict[str, set[str]] = {}
    for module, imported in graph.items():
        source = package(module)
        if source is None:
            continue
        targets = {package(m) for m in imported} - {None, source}
        collapsed.setdefault(source, set()).update(t for t in targets if t is not None)
    for targets in list(collapsed.values()):
        for t in targets:
            collapsed.setdefault(t, set())
    return collapsed


def test_no_two_packages_import_each_other() -> None:
    """The layers of docs/design.md's diagram: no cycle between packages (localspec's and the
    benchmarks'), not only between modules."""
    graph = package_graph(import_graph({**PACKAGES, **BENCHMARKS}), ("localspec", "benchmarks"))
    assert "localspec.verify" in graph["localspec.decoding"]  # the checker sees the packages
    assert "benchmarks.common" in graph["benchmarks.replay"]
    cycle = find_cycle(graph)
    assert cycle is None, "packages in a cycle: " + " -> ".join(cycle or [])


def test_package_checker_finds_a_cycle() -> None:
    """Negative control: two packages whose modules import each other one way each are a cycle,
    though no module imports one that imports it back."""
    graph = {"pkg.a.x": {"pkg.b.y"}, "pkg.b.y": set(), "pkg.b.z": {"pkg.a.w"}, "pkg.a.w": set()}
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph, ("pkg",))) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])


def test_every_module_is_short() -> None:
    """A module holds one concern: none of localspec's is longer than MAX_LINES."""
    long = {module: n for module, path in find_modules(PACKAGES).items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"longer than {MAX_LINES} lines: {long}"
