"""The dependencies whose internals localspec uses (localspec.dependencies; llama.compat for
llama-cpp-python, server.compat for uvicorn): each module's tested range is what pyproject.toml
requires, the installed version is inside it, a version outside it is refused when the module is
imported (a DependencyError that names the package, the version, the range and what to install;
the command line prints it without a traceback), and the internals each module uses are there."""

from __future__ import annotations

import ctypes
import inspect
import os
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from localspec import dependencies
from localspec.errors import DependencyError
from localspec.llama import compat as llama_compat

tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
MODULES = {"localspec.llama.compat": ("llama-cpp-python", "0.3.37"),  # module: its package, a version outside
           "localspec.server.compat": ("uvicorn", "0.60.0")}


def required(requirements: list[str], package: str) -> list[SpecifierSet]:
    """The specifier of every requirement of `package` in a requirement list."""
    return [Requirement(r).specifier for r in requirements if Requirement(r).name == package]


def pyproject_ranges(package: str) -> list[SpecifierSet]:
    """Every specifier pyproject.toml gives `package`: the plain install's and each extra's."""
    lists = [PYPROJECT["project"]["dependencies"], *PYPROJECT["project"]["optional-dependencies"].values()]
    return [spec for requirements in lists for spec in required(requirements, package)]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_the_tested_range_is_what_pyproject_requires(name: str) -> None:
    module = pytest.importorskip(name)
    ranges = pyproject_ranges(module.PACKAGE)
    assert ranges, f"pyproject.toml does not require {module.PACKAGE}"
    assert all(spec == SpecifierSet(module.TESTED) for spec in ranges), (module.TESTED, ranges)
    assert module.VERSION == metadata.version(module.PACKAGE)
    assert dependencies.within(module.VERSION, module.TESTED)


def test_negative_control_a_requirement_that_differs_is_seen() -> None:
    requirements = ["numpy>=1.24", "uvicorn>=0.29,<0.61", "llama-cpp-python==0.3.36"]
    assert required(requirements, "uvicorn") == [SpecifierSet(">=0.29,<0.61")] != [SpecifierSet(">=0.29,<0.60")]
    assert required(requirements, "llama-cpp-python") == [SpecifierSet("==0.3.36")]
    assert required(requirements, "gguf") == []


@pytest.mark.parametrize(("version", "inside"), [
    ("0.29.0", True), ("0.54.0", True), ("0.59.9", True), ("0.55.0rc1", True),  # a pre-release counts as its version
    ("0.28.1", False), ("0.60.0", False), ("0.60.0rc1", False), ("1.0", False), ("not a version", False)])
def test_within_the_range(version: str, inside: bool) -> None:
    assert dependencies.within(version, ">=0.29,<0.60") is inside


def test_a_local_build_of_the_pinned_version_is_inside() -> None:
    """A wheel built with a local label (0.3.36+cu124) is the pinned version; 0.3.36.1 is not."""
    assert dependencies.within("0.3.36+cu124", "==0.3.36") and dependencies.within("0.3.36", "==0.3.36")
    assert not dependencies.within("0.3.36.1", "==0.3.36") and not dependencies.within("0.3.35", "==0.3.36")


def test_a_version_outside_the_range_is_refused_naming_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control of the check itself: the same call passes the installed version and
    refuses one outside the range, with a message that names all a user needs."""
    installed = metadata.version("uvicorn")
    assert dependencies.require_tested("uvicorn", ">=0.29,<0.60", "its internals") == installed
    monkeypatch.setattr(dependencies.metadata, "version", lambda name: "0.60.0" if name == "uvicorn" else installed)
    with pytest.raises(DependencyError) as caught:
        dependencies.require_tested("uvicorn", ">=0.29,<0.60", "its h11 protocol class")
    message = str(caught.value)
    for part in ("uvicorn 0.60.0 is installed", "uvicorn>=0.29,<0.60", "its h11 protocol class",
                 "pip install 'uvicorn>=0.29,<0.60'"):
        assert part in message, message


def test_a_missing_package_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dependencies.metadata, "version", missing)
    with pytest.raises(DependencyError, match=r"uvicorn is not installed.*pip install 'uvicorn>=0.29,<0.60'"):
        dependencies.require_tested("uvicorn", ">=0.29,<0.60", "its internals")


def test_a_range_that_is_no_specifier_is_a_bug_of_localspec() -> None:
    with pytest.raises(ValueError, match="not a PEP 440 specifier"):
        dependencies.require_tested("uvicorn", "0.29 to 0.60", "its internals")


def _child(code: str, package: str | None = None, version: str | None = None) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter; with `package`, importlib.metadata reports `version` for it."""
    patch = ""
    if package is not None:
        patch = ("import importlib.metadata as m; real = m.version; "
                 f"m.version = lambda name: {version!r} if name == {package!r} else real(name); ")
    return subprocess.run([sys.executable, "-c", patch + code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_the_module_refuses_an_untested_version_when_imported(name: str) -> None:
    module = pytest.importorskip(name)
    package, outside = MODULES[name]
    code = (f"from localspec.errors import DependencyError\ntry:\n    import {name}\n"
            "except DependencyError as exc:\n    print('refused:', exc)\nelse:\n    print('imported')")
    assert _child(code).stdout.strip() == "imported"  # the control: the installed version imports
    refused = _child(code, package, outside).stdout
    assert refused.startswith(f"refused: {package} {outside} is installed"), refused
    assert f"pip install '{package}{module.TESTED}'" in refused


def test_the_command_line_says_so_without_a_traceback(tiny_paths: tuple[Path, Path]) -> None:
    """A generation with an untested llama-cpp-python installed ends with the message and exit
    status 1, before any model loads."""
    target, _ = tiny_paths
    code = ("import sys; from localspec.cli import main; "
            f"sys.argv = ['localspec', '-m', {str(target)!r}, '-d', 'none', '-n', '4', '--keep-alive', '0', 'hello']; "
            "main()")
    result = _child(code, "llama-cpp-python", "0.3.37")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "llama-cpp-python 0.3.37 is installed" in result.stderr and "pip install 'llama-cpp-python==0.3.36'" in \
        result.stderr, result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- the internals are there


def test_the_ggml_calls_it_declares_are_there() -> None:
    """Every libggml export declared in llama.compat resolves (lib() types them all), the CPU
    backend has the function that lists its extra buffer types, and the address of llama_tokenize
    is that of libllama's own export (the binding is the bare ctypes function)."""
    import llama_cpp

    from localspec.llama import backend

    backend.init()
    lib = llama_compat.lib()
    for name, restype, _ in llama_compat._SIGNATURES:
        assert getattr(lib, name).restype is restype
    cpu = lib.ggml_backend_dev_by_type(llama_compat.DEVICE_CPU)
    assert cpu and lib.ggml_backend_dev_type(cpu) == llama_compat.DEVICE_CPU
    assert llama_compat.proc(lib.ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts") is not None
    own = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    assert llama_compat.tokenize_address() == own


def test_the_abort_callback_as_declared_turns_an_abort_into_a_clean_exit() -> None:
    """ggml_set_abort_callback's declaration (the RPC client's abort handler; the RPC tests need
    an RPC build, this one does not): llama.cpp's abort becomes rpc.fatal's message and exit
    status. The control, with no handler installed: the process aborts (SIGABRT)."""
    from localspec.errors import EXIT_CODES, RemoteError

    abort = ("from localspec.llama import backend, compat, rpc; backend.init(); {install}"
             "compat.lib().ggml_abort(b'x.c', 7, b'rpc connection lost'); print('not reached')")
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # the control's abort: no debugger started for a backtrace
    handled = subprocess.run([sys.executable, "-c", abort.format(install="rpc.install_abort_handler(); ")],
                             capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert handled.returncode == EXIT_CODES[RemoteError], handled.stderr
    assert "a remote device stopped answering (rpc connection lost)" in handled.stderr
    plain = subprocess.run([sys.executable, "-c", abort.format(install="")], capture_output=True, text=True,
                           timeout=120, cwd=ROOT, env=env)
    assert plain.returncode == -signal.SIGABRT and "not reached" not in plain.stdout, plain.stderr


def test_the_uvicorn_internals_it_uses_are_there() -> None:
    """server.compat wraps uvicorn's h11 protocol and extends Server.handle_exit; a uvicorn that
    moves either fails here, naming it."""
    pytest.importorskip("uvicorn")
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from localspec.server import compat

    assert compat.HeadDeadline.inner_protocol is H11Protocol
    version = compat.VERSION
    for name in ("connection_made", "data_received", "eof_received", "connection_lost", "pause_writing",
                 "resume_writing"):
        assert callable(getattr(H11Protocol, name, None)), f"uvicorn {version}: H11Protocol.{name} is gone"
    params = inspect.signature(H11Protocol.__init__).parameters
    assert {"config", "server_state"} <= set(params), f"uvicorn {version}: H11Protocol takes {list(params)}"
    # uvicorn's own (self, sig, frame), or sse-starlette's wrapper of it (*args, **kwargs): called as (sig, frame)
    inspect.signature(uvicorn.Server.handle_exit).bind(None, signal.SIGINT, None)
    source = inspect.getsource(uvicorn.Server)
    assert "def handle_exit(self, sig" in source, f"uvicorn {version}: Server.handle_exit changed"


def test_a_stopping_server_ends_the_generations_before_uvicorn_stops() -> None:
    """StoppingServer.handle_exit calls on_exit first, then uvicorn's own (which sets should_exit);
    the control: a plain uvicorn.Server calls nothing."""
    pytest.importorskip("uvicorn")
    import uvicorn
    from starlette.applications import Starlette

    from localspec.server import compat

    order: list[str] = []
    config = uvicorn.Config(Starlette())
    server = compat.StoppingServer(config, lambda: order.append(f"on_exit, should_exit={server.should_exit}"))
    server.handle_exit(signal.SIGTERM, None)
    assert order == ["on_exit, should_exit=False"] and server.should_exit
    plain = uvicorn.Server(config)
    plain.handle_exit(signal.SIGTERM, None)
    assert plain.should_exit and len(order) == 1
