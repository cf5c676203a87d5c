"""The README and docs/*.md say true things about the repository and speak to users.

* Every relative link points to a file that exists, and an anchor (``doc.md#part``, ``#part``)
  to a heading of that file, by GitHub's rule for heading anchors.
* Every repository path written as code (`localspec/...py`, `benchmarks/...py`, `docs/...md`,
  `native/...c`, `tests/...py`, a package-relative `decoding/...py`), every ``python X.py``
  command and every dotted name `localspec.a.b` exists.
* No doc refers to the project's own issues or to the history of its making ("issue 43", "#36",
  "this round", "the previous design"): a user reading them has neither.

Each check is a function over a file's text, so that the negative controls below can feed it a
broken document and see the fault reported."""

from __future__ import annotations

import importlib
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
URL = re.compile(r"\b(?:https?|ftp|mailto):[^\s)>\]]+")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
TOP_LEVEL = ("localspec", "benchmarks", "docs", "native", "tests", "models", ".ci")
_TOPS = "|".join(re.escape(t) for t in TOP_LEVEL)
PATH = re.compile(rf"(?<![\w/.~$<>-])((?:{_TOPS})/[\w./-]*\w(?:::\w+)?)")  # from the root; `file.py::test` too
PLACEHOLDERS = {"NAME", "PART", "MODULE", "FILE", "DIR", "MODEL"}  # `benchmarks/NAME.py` stands for any script
RELATIVE_PATH = re.compile(r"(?<![\w/.~$<>-])([a-z_]+/[\w/-]*\w\.(?:py|c|h))\b")
COMMAND = re.compile(r"\bpython3?\s+(?:-\S+\s+)*([\w./-]+\.py)\b")
DOTTED = re.compile(r"(?<![\w.])(localspec(?:\.\w+)+)")
INTERNAL = [
    re.compile(r"\bissues?\s+#?\d{1,3}\b", re.I),  # issue 43, issues 42 and 43 (llama.cpp's are 5 digits)
    re.compile(r"\(issue:", re.I),  # (issue: CPU kernels)
    re.compile(r"(?<![\w&/#])#\d{2,3}\b"),  # #36, (#44); an HTML entity &#36; is no reference
    re.compile(r"\b(?:this|that|the same|last|previous|earlier|next|an earlier)\s+(?:round|session)s?\b", re.I),
    re.compile(r"\b(?:previous|earlier|old) design\b|\bround before\b|\bround's\b|\bconsolidation\b", re.I),
    re.compile(r"\b(?:was|were) lent\b|\bavailable to this (?:work|session)\b", re.I),
]


def blank(match: re.Match[str]) -> str:
    """The match as spaces, its line breaks kept: what is left keeps its line numbers."""
    return re.sub(r"[^\n]", " ", match.group(0))


def strip_code(text: str) -> str:
    """The text with fenced blocks and code spans blanked out."""
    return CODE_SPAN.sub(blank, FENCE.sub(blank, text))


def code_of(text: str) -> list[str]:
    """The text of every code span and fenced block."""
    fenced = [m.group(0) for m in FENCE.finditer(text)]
    return fenced + [m.group(2) for m in CODE_SPAN.finditer(FENCE.sub(" ", text))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (github-slugger): the rendered text lower-cased, every
    character but letters, digits, marks, '_', '-' and ' ' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"`+|\*\*|__|(?<!\w)[*_]|[*_](?!\w)", "", text).strip().lower()
    kept = (c for c in text if c in "-_ " or unicodedata.category(c)[0] in "LNM")
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a document's headings, repeated ones numbered as GitHub numbers them."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in HEADING.finditer(FENCE.sub(" ", text)):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path, text: str, root: Path = ROOT) -> list[str]:
    """Each relative link of `text` (the document at `path`) whose file or anchor is missing."""
    problems = []
    for target in (m.group(1) for m in LINK.finditer(strip_code(text))):
        if URL.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{target}: no file {linked.relative_to(root) if linked.is_relative_to(root) else linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text(encoding="utf-8")):
            problems.append(f"{target}: no heading with the anchor #{anchor} in {linked.name}")
    return problems


def exists(root: Path, path: str) -> bool:
    """Whether `path` (from `root`) is there: a file or directory, or a module written without
    its platform suffix (`localspec/_verifier`: `_verifier.cpython-*.so`); with `::name` (a
    test, pytest's way), a file that defines that function. A placeholder (`benchmarks/NAME.py`)
    is no path."""
    if any(part.split(".")[0] in PLACEHOLDERS for part in path.split("/")):
        return True
    file_part, _, function = path.partition("::")
    found = root / file_part
    if function:
        definition = re.compile(rf"^\s*(?:async\s+)?def {function}\b", re.M)
        return found.is_file() and definition.search(found.read_text(encoding="utf-8")) is not None
    return found.exists() or any(found.parent.glob(found.name + ".*"))


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Each repository path written as code, or run as `python X.py`, that does not exist: paths
    from the repository root anywhere in code, package-relative ones (`decoding/x.py`, under
    localspec/) in code spans."""
    problems = [path for code in code_of(text) for path in PATH.findall(code) + COMMAND.findall(code)
                if not exists(root, path)]
    for code in (m.group(2) for m in CODE_SPAN.finditer(FENCE.sub(" ", text))):
        for path in RELATIVE_PATH.findall(code):
            package = root / "localspec" / path.split("/")[0]
            if path.split("/")[0] not in TOP_LEVEL and package.is_dir() and not exists(root / "localspec", path):
                problems.append(f"{path} (under localspec/)")
    return sorted(set(problems))


def resolves(name: str) -> bool:
    """Whether `localspec.a.b.c` names a module, or an attribute of one, of the installed tree."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found: object = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:  # a dependency missing is no verdict on the name
                raise
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def missing_names(text: str) -> list[str]:
    """Each dotted name `localspec.x.y` written as code that names nothing."""
    names = {m for code in code_of(text) for m in DOTTED.findall(code)}
    return sorted(name for name in names if not resolves(name))


def internal_references(text: str) -> list[str]:
    """Each phrase of the prose (code, link targets and URLs left out) that refers to the
    project's issues or to the sessions that made it, with its line number."""
    prose = URL.sub(" ", LINK.sub(lambda m: m.group(0).split("](")[0], strip_code(text)))
    problems = []
    for pattern in INTERNAL:
        for match in pattern.finditer(prose):
            problems.append(f"line {prose.count(chr(10), 0, match.start()) + 1}: {match.group(0)!r}")
    return problems


# Known failures, each to be removed once the file is fixed. {file: {check: what is wrong}}
KNOWN: dict[str, dict[str, str]] = {}


def params(check: str) -> list[object]:
    """Every document; a known failure of this check marked xfail (not strict) with its reason."""
    out: list[object] = []
    for doc in DOCS:
        name = str(doc.relative_to(ROOT))
        reason = KNOWN.get(name, {}).get(check)
        marks = [pytest.mark.xfail(reason=reason, strict=False)] if reason else []
        out.append(pytest.param(doc, id=name, marks=marks))
    return out


@pytest.mark.parametrize("doc", params("links"))
def test_relative_links_point_to_files_and_headings_that_exist(doc: Path) -> None:
    assert broken_links(doc, doc.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("doc", params("paths"))
def test_paths_and_commands_written_as_code_exist(doc: Path) -> None:
    assert missing_paths(doc.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("doc", params("names"))
def test_dotted_names_written_as_code_exist(doc: Path) -> None:
    assert missing_names(doc.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("doc", params("internal"))
def test_no_internal_issue_numbers_or_session_history(doc: Path) -> None:
    assert internal_references(doc.read_text(encoding="utf-8")) == []


def test_the_readme_runs_existing_benchmark_scripts() -> None:
    commands = COMMAND.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    assert any(c.startswith("benchmarks/") for c in commands)  # the check has something to check
    assert [c for c in commands if not (ROOT / c).is_file()] == []


def test_slugs_follow_githubs_rule() -> None:
    assert slug("Speed (`python benchmarks/resident.py`)") == "speed-python-benchmarksresidentpy"
    assert slug("Where targets are missed, and why") == "where-targets-are-missed-and-why"
    assert slug("Is the hindsight best within a planner's reach?") == "is-the-hindsight-best-within-a-planners-reach"
    assert slug("AMD EPYC (Zen 4), 2 cores — **1.5×**") == "amd-epyc-zen-4-2-cores--15"
    assert anchors("# A\n\n## A\n\n```\n# not a heading\n```\n") == {"a", "a-1"}


NEGATIVE = """# Title

## Part one

A [good link](other.md#the-part), a [good anchor](#part-one), an [outside one](https://example.com/#12).
A [broken link](nowhere.md), a [missing anchor](other.md#no-such-part), [here](#no-part).
Paths: `benchmarks/real.py`, `benchmarks/not_there.py`, `decoding/gone.py`, `~/.cache/localspec/x`,
`benchmarks/real.py::test_here`, `benchmarks/real.py::test_gone`, `benchmarks/NAME.py`.

```bash
python benchmarks/real.py --flag
python benchmarks/also_missing.py
python tools/missing.py
```

Names: `localspec.errors.ConfigError`, `localspec.errors.NoSuchError`, `localspec.nosuchmodule`.
"""


def test_a_broken_document_is_reported(tmp_path: Path) -> None:
    """The negative control: a document with a broken link, a missing anchor, missing paths and
    names; the good ones beside them are not reported."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "real.py").write_text("def test_here():\n    pass\n")
    (tmp_path / "localspec" / "decoding").mkdir(parents=True)
    (tmp_path / "other.md").write_text("# Other\n\n## The part\n")
    doc = tmp_path / "doc.md"
    doc.write_text(NEGATIVE)
    assert broken_links(doc, NEGATIVE, tmp_path) == [
        "nowhere.md: no file nowhere.md",
        "other.md#no-such-part: no heading with the anchor #no-such-part in other.md",
        "#no-part: no heading with the anchor #no-part in doc.md",
    ]
    assert missing_paths(NEGATIVE, tmp_path) == [
        "benchmarks/also_missing.py", "benchmarks/not_there.py", "benchmarks/real.py::test_gone",
        "decoding/gone.py (under localspec/)", "tools/missing.py"]
    assert missing_names(NEGATIVE) == ["localspec.errors.NoSuchError", "localspec.nosuchmodule"]


def test_internal_references_are_reported() -> None:
    """The negative control: each kind of reference is found in prose, and none in code, URLs,
    link targets or llama.cpp's own issue numbers."""
    found = internal_references(
        "As issue 43 asked (#36), this round measured it; the previous design held three\n"
        "contexts. Issues 42 and 44 (issue: CPU kernels), the last session's run.\n"
    )
    assert [f.split(": ", 1)[1] for f in found] == [
        "'issue 43'", "'Issues 42'", "'(issue:'", "'#36'", "'this round'", "'last session'",
        "'previous design'"]
    assert found[0].startswith("line 1") and found[-2].startswith("line 2")
    clean = (
        "llama.cpp issue 20824 crashes AMX. `issue 43` in code, [a link](x.md#issue-43), "
        "https://github.com/o/r/issues/36 and http://x/#36. Medians of 3 alternated rounds; "
        "a pytest session fixture.\n```\n#36 this round\n```\n"
    )
    assert internal_references(clean) == []
