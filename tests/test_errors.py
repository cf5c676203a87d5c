"""One error hierarchy, one table of exit statuses (used by every command and the remote exit)."""

from __future__ import annotations

import pytest

from localspec import errors
from localspec.cli import bench_runs as bench
from localspec.llama import rpc
from localspec.errors import (BenchError, CheckFailed, ConfigError, LocalspecError, ModelError, PromptError,
                              RemoteError, exit_code)


@pytest.mark.parametrize("error,code", [
    (ConfigError("x"), 2), (BenchError("x"), 2), (RemoteError("x"), 3), (RemoteError("x", status=503), 3),
    (PromptError("x"), 1), (ModelError("x"), 1), (CheckFailed("x"), 1), (LocalspecError("x"), 1),
])
def test_exit_statuses_come_from_one_table(error: LocalspecError, code: int) -> None:
    assert exit_code(error) == code == exit_code(type(error))


def test_the_hierarchy() -> None:
    assert bench.BenchError is BenchError and issubclass(BenchError, ConfigError)  # re-exported where it was
    assert issubclass(PromptError, ModelError) and issubclass(RemoteError, ModelError)  # callers of ModelError keep working
    assert rpc.EXIT_REMOTE == exit_code(RemoteError)
    assert all(issubclass(kind, LocalspecError) for kind in errors.EXIT_CODES)
