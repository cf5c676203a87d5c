"""CPU kernel configurations (localspec.llama.kernels, buffer_types, kernel_verdicts): what each one
loads where, the rule auto follows, and the check in a child process that keeps a configuration
whose process dies from ever being used on a machine again (a configuration made to die here: the
negative control on a host where none crashes by itself)."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from localspec.llama import buffer_types, compat, kernel_check, kernel_verdicts, kernels
from localspec.cli import cli
from localspec.settings.models import ModelOptions
from localspec.errors import ConfigError, ModelError
from localspec.llama.model import Model

from conftest import load

X86_AVX512 = frozenset({"AVX", "AVX2", "AVX512", "FMA", "F16C"})
ARM_I8MM = frozenset({"NEON", "ARM_FMA", "DOTPROD", "MATMUL_INT8"})


@pytest.fixture()
def fresh_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty verdict store (the child processes inherit the variable)."""
    monkeypatch.setenv("LOCALSPEC_PROFILE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def q4_0(quantized_paths: dict[str, tuple[Path, Path]]) -> Path:
    return quantized_paths["q4_0"][0]


# ---------------------------------------------------------------- which weights go where


def test_repack_rule_follows_llama_cpp() -> None:
    """ggml_repack_get_optimal_repack_type, per CPU (llama.compat's copy): x86 repacks
    Q4_0/Q4_K/IQ4_NL in 8-row blocks and nothing of Q6_K/Q8_0; Arm with int8 matmul takes those
    and Q6_K/Q8_0 too."""
    rows = compat.repack_rows
    assert rows("Q4_K", X86_AVX512) == 8 and rows("Q4_0", X86_AVX512) == 8
    assert rows("Q2_K", X86_AVX512) == 8 and rows("Q2_K", X86_AVX512 - {"AVX512"}) is None
    assert rows("Q6_K", X86_AVX512) is None and rows("Q8_0", X86_AVX512) is None
    assert rows("Q4_0", ARM_I8MM) == 4 and rows("Q8_0", ARM_I8MM) == 4
    assert rows("Q6_K", ARM_I8MM) == 8
    assert rows("F32", X86_AVX512) is None and rows("Q4_K", frozenset()) is None


def test_only_matrix_weights_with_whole_blocks_are_repacked() -> None:
    weights = [buffer_types.Weight("token_embd.weight", "Q4_K", 2, 1024),  # read row by row: never
               buffer_types.Weight("output.weight", "Q4_K", 2, 1024),
               buffer_types.Weight("blk.0.attn_q.weight", "Q4_K", 2, 256),
               buffer_types.Weight("blk.0.attn_k.weight", "Q4_K", 2, 100),  # 100 rows: no 8-row blocks
               buffer_types.Weight("blk.0.ffn_down.weight", "Q6_K", 2, 256),  # no x86 kernel
               buffer_types.Weight("blk.0.attn_norm.weight", "F32", 1, 1),
               buffer_types.Weight("blk.0.mystery.weight", "Q4_0", 2, 256)]  # unknown role: never
    got = [w.name for w in buffer_types.repackable(weights, X86_AVX512)]
    assert got == ["output.weight", "blk.0.attn_q.weight"]


def test_name_pattern_matches_exactly_its_names() -> None:
    names = [f"blk.{i}.{kind}.weight" for i in range(12) for kind in ("attn_q", "ffn_down", "ffn_up")]
    chosen = [n for n in names if int(n.split(".")[1]) % 3 != 1] + ["output.weight"]
    pattern = re.compile(buffer_types.name_pattern(chosen))
    for name in names + ["output.weight", "token_embd.weight", "blk.10.attn_q.weight.bias", "xblk.0.attn_q.weight"]:
        assert bool(pattern.search(name)) == (name in chosen), name


def test_read_weights(q4_0: Path, tmp_path: Path) -> None:
    weights = buffer_types.read_weights(q4_0)
    by_name = {w.name: w for w in weights}
    assert by_name["blk.0.ffn_up.weight"] == buffer_types.Weight("blk.0.ffn_up.weight", "Q4_0", 2, 512)
    assert by_name["blk.0.attn_norm.weight"].dims == 1
    assert buffer_types.checked_types(weights) == ("Q4_0", "Q6_K")  # Q6_K: the output matrix
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(q4_0.read_bytes()[:3000])
    with pytest.raises(ModelError, match="could not load .*cut.gguf"):
        buffer_types.read_weights(cut)


@pytest.mark.parametrize("config", ["llama", "repack", "plain"])
def test_each_configuration_loads_and_computes_the_same(q4_0: Path, config: str) -> None:
    """Every configuration gives logits within quantization noise of the plain kernels (a wrong
    layout would be off by whole logits); repack puts exactly llama.cpp's choice in CPU_REPACK
    where AMX is absent, plain nothing."""
    crashing = buffer_types.crashing_buffer_types()
    if config == "llama" and crashing:
        pytest.skip(f"llama.cpp's own choice here includes {', '.join(crashing)}, known to crash on some CPUs")
    tokens = list(range(5, 29))
    with load(q4_0, cpu_kernels="plain") as plain:
        plain.decode(tokens, range(len(tokens)))
        want = plain.logits_array(len(tokens)).copy()
    with load(q4_0, cpu_kernels=config) as m:
        assert m.kernels is not None and m.kernels.config == config
        m.decode(tokens, range(len(tokens)))
        got = m.logits_array(len(tokens)).copy()
        buffers = m.weight_buffers
    assert np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2)) < 1e-3
    repacks = buffer_types.REPACK_BUFFER in buffer_types.extra_buffer_types() and "AVX2" in buffer_types.cpu_features()
    if config == "plain" or not repacks:
        assert buffer_types.REPACK_BUFFER not in buffers and "AMX" not in buffers
    else:
        assert buffers.get(buffer_types.REPACK_BUFFER, 0) > 0
    if config == "repack":
        assert "AMX" not in buffers
        if "AMX" not in buffer_types.extra_buffer_types():
            with load(q4_0, cpu_kernels="llama") as own:
                assert own.weight_buffers == buffers


def test_bad_configuration_is_a_config_error(q4_0: Path) -> None:
    with pytest.raises(ConfigError, match="cpu_kernels must be one of auto, llama, repack, plain"):
        ModelOptions(cpu_kernels="amx")
    result = CliRunner().invoke(cli, ["-m", str(q4_0), "--cpu-kernels", "fast", "hi"])
    assert result.exit_code == 2 and "--cpu-kernels" in result.output


# ---------------------------------------------------------------- auto and its checks


def test_auto_never_offers_a_buffer_type_known_to_crash(q4_0: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX among the extra buffer types (an Intel host), llama.cpp's own choice is no
    candidate: repack first, then plain."""
    weights = buffer_types.read_weights(q4_0)
    real = buffer_types.extra_buffer_types()
    monkeypatch.setattr(buffer_types, "extra_buffer_types", lambda: {"AMX": 1, **real})
    names = [name for name, _ in kernels.candidates(weights)]
    assert "llama" not in names and names[-1] == "plain"
    if buffer_types.REPACK_BUFFER in real and buffer_types.repackable(weights, buffer_types.cpu_features()):
        assert names == ["repack", "plain"]
        assert "AMX" in kernels.candidates(weights)[0][1] and "20824" in kernels.candidates(weights)[0][1]
    monkeypatch.setattr(buffer_types, "extra_buffer_types", lambda: real)
    assert [name for name, _ in kernels.candidates(weights)][0] == "llama"  # control: no AMX, llama first


def test_auto_checks_once_and_says_what_it_chose(q4_0: Path, fresh_checks: Path,
                                                 caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with caplog.at_level(logging.WARNING, logger="localspec.llama.kernels"):
        chosen = kernels.resolve(q4_0, "auto")
    assert chosen.config == "llama" or "AMX" in buffer_types.extra_buffer_types()
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 1 and "CPU kernels for Q4_0/Q6_K weights" in notices[0] and "child process" in notices[0]
    verdicts = kernel_verdicts.Checks().all()
    assert [v.ok for v in verdicts.values()] == [True]
    caplog.clear()

    def no_child(*args: object) -> kernel_verdicts.Check:
        raise AssertionError("a recorded verdict must not be checked again")

    monkeypatch.setattr(kernel_verdicts, "Check", no_child)
    with caplog.at_level(logging.WARNING, logger="localspec.llama.kernels"):
        assert kernels.resolve(q4_0, "auto") == chosen
    assert not caplog.records  # later runs: silent, no child


CRASHING_CHILD = """import os, signal, sys
if sys.argv[2] in sys.argv[1].split(","):
    os.kill(os.getpid(), signal.SIGSEGV)
from localspec.llama import kernel_check
sys.exit(kernel_check.main(sys.argv[2:]))
"""


def crash_checks_of(monkeypatch: pytest.MonkeyPatch, configs: str) -> None:
    """The check's child dies of SIGSEGV checking these configurations (comma-separated), as
    llama.cpp's AMX kernels die on the hosts where they crash; the others are checked as usual.
    The child is another process, so its command is replaced (kernel_verdicts.CHILD)."""
    monkeypatch.setattr(kernel_verdicts, "CHILD", [sys.executable, "-c", CRASHING_CHILD, configs])


def test_a_configuration_whose_child_dies_is_never_used(q4_0: Path, fresh_checks: Path,
                                                        caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the child checking the first candidate dies of SIGSEGV (as llama.cpp's
    AMX kernels die on the hosts where they crash); auto rejects it, says so, takes the next one,
    and a later run never tries it again."""
    first = kernels.candidates(buffer_types.read_weights(q4_0))[0][0]
    healthy = kernel_verdicts.CHILD
    crash_checks_of(monkeypatch, first)
    with caplog.at_level(logging.WARNING, logger="localspec.llama.kernels"):
        chosen = kernels.resolve(q4_0, "auto")
    assert chosen.config != first
    message = caplog.records[-1].getMessage()
    assert f"not {first} (killed by SIGSEGV" in message, message
    dead = kernel_verdicts.Checks().get(kernel_verdicts.check_key(first, ("Q4_0", "Q6_K")))
    assert dead is not None and not dead.ok and "SIGSEGV" in dead.detail
    monkeypatch.setattr(kernel_verdicts, "CHILD", healthy)  # the machine "heals", but the verdict stands
    assert kernels.resolve(q4_0, "auto").config == chosen.config
    with Model(q4_0, ModelOptions(ctx_size=64, batch_size=32)) as m:  # the default path obeys it too
        assert m.kernels is not None and m.kernels.config == chosen.config


class Dies:
    """A check whose child always dies (without starting one)."""

    def __init__(self, config: str, types: tuple[str, ...]) -> None:
        self.config, self.types = config, tuple(types)

    def wait(self) -> kernel_verdicts.KernelVerdict:
        return kernel_verdicts.KernelVerdict(False, "killed by SIGSEGV", 0.1)


def test_a_load_overlaps_the_check_and_reloads_when_it_fails(q4_0: Path, fresh_checks: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine's first run the model loads while its configuration is checked; when the
    check's child dies (negative control), the model is loaded again with the next configuration
    before anything is decoded, and it decodes."""
    first, second = [name for name, _ in kernels.candidates(buffer_types.read_weights(q4_0))][:2]
    crash_checks_of(monkeypatch, first)
    choice = kernels.choose(q4_0, "auto")
    assert isinstance(choice, kernels.PendingChoice) and choice.candidate.config == first
    assert not choice.confirmed()
    kernel_verdicts.Checks().path.unlink()  # again, through a model load
    with Model(q4_0, ModelOptions(ctx_size=64, batch_size=32)) as m:
        assert m.kernels is not None and m.kernels.config == second
        if second == "plain":
            assert set(m.weight_buffers) == {"CPU"}
        m.decode([5, 6, 7], range(3))
        assert np.isfinite(m.logits_array(3)).all()


def test_when_every_configuration_dies_the_error_says_so(q4_0: Path, fresh_checks: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """... and how to go on: the --cpu-kernels choice to try, the record, how to check again."""
    monkeypatch.setattr(kernel_verdicts, "Check", Dies)
    failed = "every CPU kernel configuration failed its check on Q4_0/Q6_K weights"
    with pytest.raises(ModelError, match=failed) as info:
        kernels.resolve(q4_0, "auto")
    message = str(info.value)
    assert "try --cpu-kernels plain" in message and f"delete {kernel_verdicts.Checks().path}" in message
    assert kernel_verdicts.Checks().path.is_file() and "timed out" not in message  # died: no retry promised


class TimesOut(Dies):
    """A check whose child never answers (a busy machine)."""

    def wait(self) -> kernel_verdicts.KernelVerdict:
        return kernel_verdicts.KernelVerdict(False, "no answer within 180 s", 180.0, timed_out=True)


class Passes(Dies):
    def wait(self) -> kernel_verdicts.KernelVerdict:
        return kernel_verdicts.KernelVerdict(True, "fine", 0.1)


def test_a_check_that_timed_out_is_checked_again_on_a_later_run(q4_0: Path, fresh_checks: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout fails the configuration in this run only (recorded as timed out, not as a
    verdict); a later run checks again, until it has timed out TIMEOUT_TRIES times. The
    negative control: a configuration whose child died is never checked again (above)."""
    first = kernels.candidates(buffer_types.read_weights(q4_0))[0][0]
    key = kernel_verdicts.check_key(first, ("Q4_0", "Q6_K"))
    monkeypatch.setattr(kernel_verdicts, "Check", TimesOut)
    with pytest.raises(ModelError, match="checks that timed out run again by themselves"):
        kernels.resolve(q4_0, "auto")
    record = json.loads(kernel_verdicts.Checks().path.read_text())
    assert record[key]["timed_out"] is True and record[key]["timeouts"] == 1 and record[key]["ok"] is False
    assert kernel_verdicts.Checks().get(key) is None  # a later run: not a verdict
    monkeypatch.setattr(kernel_verdicts, "Check", Passes)
    assert kernels.resolve(q4_0, "auto").config == first  # checked again, and it passes now
    assert kernel_verdicts.Checks().get(key) == kernel_verdicts.KernelVerdict(True, "fine", 0.1)
    kernel_verdicts.Checks().path.unlink()
    monkeypatch.setattr(kernel_verdicts, "Check", TimesOut)
    for _ in range(kernel_verdicts.TIMEOUT_TRIES):
        with pytest.raises(ModelError):
            kernels.resolve(q4_0, "auto")
    verdict = kernel_verdicts.Checks().get(key)
    assert verdict is not None and not verdict.ok and "taken for a hang" in verdict.detail


def test_child_that_computes_garbage_is_rejected() -> None:
    """The check compares logits with the plain kernels': a configuration that runs but computes
    something else is refused like one that dies (here: the comparison of two different models)."""
    with pytest.raises(SystemExit, match="logits differ"):
        kernel_check.compare_logits("Q4_0", np.ones((3, 8)), -np.ones((3, 8)))
    assert kernel_check.compare_logits("Q4_0", np.ones((3, 8)), np.ones((3, 8))) == 0.0


def test_damaged_verdicts_are_ignored(q4_0: Path, fresh_checks: Path, caplog: pytest.LogCaptureFixture) -> None:
    checks = kernel_verdicts.Checks()
    checks.path.parent.mkdir(parents=True, exist_ok=True)
    checks.path.write_text('{"llama:Q4_0,Q6_K": {"ok": "maybe"}, "x": 3')
    with caplog.at_level(logging.WARNING, logger="localspec.llama.kernel_verdicts"):
        chosen = kernels.resolve(q4_0, "auto")
    assert chosen.config in ("llama", "repack", "plain")
    assert any("unreadable kernel checks" in r.getMessage() for r in caplog.records)
    checks.path.write_text('{"llama:Q4_0,Q6_K": {"ok": true}, "plain:Q4_0,Q6_K": [1, 2]}')
    assert kernel_verdicts.Checks().get("llama:Q4_0,Q6_K") is None
    assert kernel_verdicts.Checks().get("plain:Q4_0,Q6_K") is None


def test_f32_models_need_no_check(tiny_paths: tuple[Path, Path], fresh_checks: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_verdicts, "Check", lambda *a: pytest.fail("no extra buffer type takes F32 weights"))
    assert kernels.resolve(tiny_paths[0], "auto").config in ("llama", "repack", "plain")


def test_child_usage_error() -> None:
    assert kernel_check.main(["fast", "Q4_0"]) == 2
    assert kernel_check.main(["llama", "Q9_9"]) == 2


def test_repack_leaves_offloaded_layers_alone() -> None:
    """An override wins over device placement in llama.cpp's loader: with layers on a GPU or an
    RPC server, repack names only the weights that stay on the CPU (the last blocks and the
    output go first)."""
    weights = [buffer_types.Weight(f"blk.{i}.attn_q.weight", "Q4_K", 2, 256) for i in range(4)]
    weights.append(buffer_types.Weight("output.weight", "Q4_K", 2, 1024))
    cpu = lambda n: [w.name for w in buffer_types.repackable(buffer_types.on_cpu(weights, n), X86_AVX512)]  # noqa: E731
    assert cpu(0) == [w.name for w in weights]
    assert cpu(1) == [f"blk.{i}.attn_q.weight" for i in range(4)]  # the output layer offloaded
    assert cpu(3) == ["blk.0.attn_q.weight", "blk.1.attn_q.weight"]
    assert cpu(999) == []
