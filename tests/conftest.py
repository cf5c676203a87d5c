"""Shared fixtures: tiny random-weight GGUF models written once per test session."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator, Mapping

import pytest

from localspec.settings.models import ModelOptions
from localspec.llama.model import Model
from localspec.settings.locations import PROFILE_ENV
from localspec.llama.prompt_cache import ENV as PROMPT_CACHE_ENV

import tiny_models as tiny

# exact, deterministic logits: F32 KV cache, flash attention off, one thread
EXACT = dict(cache_type="f32", flash_attn="off", threads=1)
GPU_LAYERS_ENV = "TESTS_N_GPU_LAYERS"


def gpu_layers(environ: Mapping[str, str] = os.environ) -> int:
    """The layers load() and the tiny-model fixtures offload: TESTS_N_GPU_LAYERS (-1: all; unset: 0),
    so the suite runs offloaded on a GPU build (benchmarks/gpu_check.py sets it to -1)."""
    text = (environ.get(GPU_LAYERS_ENV) or "0").strip()
    if not re.fullmatch(r"-1|\d+", text):
        raise pytest.UsageError(f"{GPU_LAYERS_ENV} must be -1 (every layer) or a number of layers, got {text!r}")
    return int(text)


def pytest_configure(config: pytest.Config) -> None:
    gpu_layers()  # a bad value is a usage error before any test runs


@pytest.fixture(scope="session", autouse=True)
def own_profiles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The user's default cost-profile directory, for the CLI runs and API calls that take no
    Profiles of their own (as a user would set LOCALSPEC_PROFILE_DIR), points into the test session's
    temporary directory, so tests never write to the user's cache; engine and planner tests pass
    their own Profiles objects."""
    directory = tmp_path_factory.mktemp("profiles")
    old = os.environ.get(PROFILE_ENV)
    os.environ[PROFILE_ENV] = str(directory)
    yield directory
    if old is None:
        os.environ.pop(PROFILE_ENV, None)
    else:
        os.environ[PROFILE_ENV] = old


@pytest.fixture(scope="session", autouse=True)
def prompt_cache_off() -> Iterator[None]:
    """No test writes the user's prompt cache: it is off unless a test names a directory
    (tests/test_prompt_cache.py does, as a user would with --prompt-cache DIR)."""
    old = os.environ.get(PROMPT_CACHE_ENV)
    os.environ[PROMPT_CACHE_ENV] = "off"
    yield
    if old is None:
        os.environ.pop(PROMPT_CACHE_ENV, None)
    else:
        os.environ[PROMPT_CACHE_ENV] = old


@pytest.fixture(scope="session", autouse=True)
def no_resident_services() -> Iterator[Path]:
    """Commands run in their own process (LOCALSPEC_KEEP_ALIVE=0) unless a test asks for a
    resident service (tests/test_resident.py), whose sockets live in a private runtime directory
    of the session's (short: a socket's path holds 108 bytes). No service may outlive the session:
    any still running at its end is stopped and the session fails."""
    import shutil
    import tempfile

    from localspec.resident import control

    runtime = Path(tempfile.mkdtemp(prefix="ls-rt-", dir="/tmp"))
    saved = {name: os.environ.get(name) for name in ("LOCALSPEC_KEEP_ALIVE", "XDG_RUNTIME_DIR")}
    os.environ["LOCALSPEC_KEEP_ALIVE"] = "0"
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    yield runtime
    left = control.services()
    for path, _ in left:
        control.stop(path, None)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(runtime, ignore_errors=True)
    assert not left, f"resident services outlived the test session: {[[p.target for p in s.pairs] for _, s in left]}"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_paths(tiny_dir: Path) -> tuple[Path, Path]:
    """(target, draft): the draft is the target plus 5 % noise (~85 % top-1 agreement)."""
    return tiny.make_pair(tiny_dir, seed=0, noise=0.05)


@pytest.fixture(scope="session")
def far_draft_path(tiny_dir: Path) -> Path:
    """A draft far from the target (50 % noise): many rejections, a strong distribution test."""
    return tiny.write_tiny_model(tiny_dir / "tiny-draft-far.gguf", seed=0, noise=0.5)


QUANTIZATIONS = tuple(tiny.QUANTIZATIONS)  # q4_k_m (with its Q6_K tensors), q4_0, q8_0: what real GGUFs use


@pytest.fixture(scope="session")
def quantized_paths(tiny_dir: Path) -> dict[str, tuple[Path, Path]]:
    """(target, draft) per kind of weights: a 256-dim tiny pair (rows that k-quants, llama.cpp's
    repacked kernels and AMX tiles all take) in F32 and quantized by llama.cpp's own quantizer,
    so the tests run the CPU kernels users run."""
    target = tiny.write_tiny_model(tiny_dir / "q-target-f32.gguf", seed=1, **tiny.QUANTIZABLE)
    draft = tiny.write_tiny_model(tiny_dir / "q-draft-f32.gguf", seed=1, noise=0.05, **tiny.QUANTIZABLE)
    out = {"f32": (target, draft)}
    for name, ftype in tiny.QUANTIZATIONS.items():
        out[name] = (tiny.quantize(target, tiny_dir / f"q-target-{name}.gguf", ftype),
                     tiny.quantize(draft, tiny_dir / f"q-draft-{name}.gguf", ftype))
    return out


def load(path: Path, n_ctx: int = 512, **options) -> Model:
    return Model(path, ModelOptions(ctx_size=n_ctx, **{"batch_size": 256, **EXACT, "n_gpu_layers": gpu_layers(), **options}))


@pytest.fixture(scope="session")
def tiny_target(tiny_paths: tuple[Path, Path]) -> Iterator[Model]:
    with load(tiny_paths[0]) as m:
        yield m


@pytest.fixture(scope="session")
def tiny_draft(tiny_paths: tuple[Path, Path]) -> Iterator[Model]:
    with load(tiny_paths[1]) as m:
        yield m


@pytest.fixture(scope="session")
def far_draft(far_draft_path: Path) -> Iterator[Model]:
    with load(far_draft_path) as m:
        yield m
