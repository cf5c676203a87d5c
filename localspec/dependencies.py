"""The installed version of a dependency whose internals localspec uses, checked against the
versions localspec was tested with.

localspec uses its dependencies through their documented interfaces, but for a few places that
reach further (docs/design.md lists them). Each such dependency has one module that holds all
that localspec takes from its internals (``localspec.llama.compat``: llama-cpp-python and the
libggml it bundles; ``localspec.server.compat``: uvicorn), and that module calls
:func:`require_tested` when it is imported: a version that may have moved one of those
internals is refused with a message that says what to install, rather than failing later (a
wrong C signature, a missing method) in a way that names nothing.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from localspec.errors import DependencyError


def installed_version(package: str) -> str | None:
    """The installed version of a distribution (pip's name), or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def within(version: str, tested: str) -> bool:
    """Is `version` inside `tested` (a PEP 440 specifier such as ``>=0.29,<0.60``)? Pre-releases
    count as their version; a version that is not PEP 440 is outside every range."""
    try:
        return SpecifierSet(tested).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def require_tested(package: str, tested: str, internals: str) -> str:
    """The installed version of `package` (pip's name); DependencyError naming the package, the
    installed version, the tested range and what to install when it is missing or outside
    `tested` (pyproject.toml's requirement, the same specifier). `internals` says what localspec
    uses beyond the package's documented interface (the reason the range is enforced)."""
    try:
        SpecifierSet(tested)
    except InvalidSpecifier:
        raise ValueError(f"{package}'s tested range {tested!r} is not a PEP 440 specifier") from None
    install = f"pip install '{package}{tested}'"
    version = installed_version(package)
    if version is None:
        raise DependencyError(f"{package} is not installed; localspec needs {package}{tested} "
                              f"(it uses {internals}): {install}")
    if not within(version, tested):
        raise DependencyError(f"{package} {version} is installed, but localspec is tested with {package}{tested} "
                              f"only: it uses {internals}, which other versions may change. Install a tested "
                              f"version: {install}")
    return version
