"""One error hierarchy, one table of exit statuses (used by every command and the remote exit)."""

from __future__ import annotations

import pytest

from localspec import errors
from localspec.bench import runs as bench
from localspec.llama import rpc
from localspec.errors import (BenchError, CallbackError, Cancelled, CheckFailed, ConfigError, LocalspecError, ModelError,
                              PromptError, RemoteError, exit_code)


@pytest.mark.parametrize("error,code", [
    (ConfigError("x"), 2), (BenchError("x"), 2), (RemoteError("x"), 3), (RemoteError("x", status=503), 3),
    (PromptError("x"), 1), (ModelError("x"), 1), (CheckFailed("x"), 1), (LocalspecError("x"), 1),
    (CallbackError("x"), 1), (Cancelled("x"), 130),
])
def test_exit_statuses_come_from_one_table(error: LocalspecError, code: int) -> None:
    assert exit_code(error) == code == exit_code(type(error))


def test_the_hierarchy() -> None:
    assert bench.BenchError is BenchError and issubclass(BenchError, ConfigError)  # re-exported where it was
    assert issubclass(PromptError, ModelError) and issubclass(RemoteError, ModelError)  # callers of ModelError keep working
    assert rpc.EXIT_REMOTE == exit_code(RemoteError)
    assert all(issubclass(kind, LocalspecError) for kind in errors.EXIT_CODES)
    from localspec.core import cancel

    assert cancel.Cancelled is Cancelled  # one class for "the user stopped it": a load's and a call's


# ---------------------------------------------------------------- bad input, by class (issue 24)

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
from fractions import Fraction  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from localspec import stream_generate  # noqa: E402
from localspec.settings.generation import GenerationConfig
from localspec.settings.models import ModelOptions
from localspec.settings.shape import Shape  # noqa: E402


# settings a lower layer cannot represent: each is a ConfigError naming the setting, at the call
UNREPRESENTABLE = [
    ("temperature", 10**400), ("temperature", float("nan")), ("temperature", 1e308), ("top_p", float("inf")),
    ("top_p", 10**400), ("min_p", float("nan")), ("lenience", 10**400), ("top_k", 2**40), ("top_k", 2.5),
    ("seed", 2**64), ("seed", -1), ("seed", 1e30), ("seed", "1"), ("max_tokens", 2**31), ("max_tokens", float("inf")),
    ("max_tokens", True), ("max_tokens", np.bool_(True)), ("num_draft_tokens", 2**70), ("paths", 10**30),
    ("tree", "9" * 5000), ("tree", "1x" * 100 + "1"), ("tree", [1] * 100), ("tree", 5), ("tree", ""), ("tree", []),
    ("tree", "３x2"), ("tree", {"a": 1}), ("tree", [10**30]), ("stop", 5), ("stop", {"a": 1}), ("stop", ["\ud800"]),
    ("stop", ["x"] * 17), ("stop", ["x" * 1000]), ("verifier", None), ("drafter", 1), ("plan", ["auto"]),
]


@pytest.mark.parametrize("name,value", UNREPRESENTABLE, ids=[f"{n}={v!r:.20}" for n, v in UNREPRESENTABLE])
def test_unrepresentable_settings_are_config_errors_naming_them(name: str, value) -> None:
    options = {name: value}
    if name in ("tree",):
        options["verifier"] = "traversal"
    with pytest.raises(ConfigError) as info:
        GenerationConfig.from_options(**options)
    assert info.value.param == name, (info.value.param, str(info.value))
    assert len(str(info.value)) < 400  # a huge value is cut, not printed whole


# numbers of every kind Python code holds (numpy's, integral floats, Fraction) are what they say
EQUIVALENT = [
    ("max_tokens", np.int64(5), 5), ("max_tokens", 5.0, 5), ("seed", np.uint64(2**64 - 1), 2**64 - 1),
    ("seed", np.int32(3), 3), ("temperature", np.float32(0.5), 0.5), ("top_p", Fraction(1, 2), 0.5),
    ("top_k", np.int16(7), 7), ("num_draft_tokens", 3.0, 3), ("stop", None, ()),
]


@pytest.mark.parametrize("name,value,expected", EQUIVALENT, ids=[f"{n}={v!r}" for n, v, _ in EQUIVALENT])
def test_numbers_of_every_kind_become_plain_values(name: str, value, expected) -> None:
    config = GenerationConfig.from_options(**{name: value})
    got = config.options()[name]
    assert got == (list(expected) if isinstance(expected, tuple) else expected)
    assert type(got) is type(list(expected) if isinstance(expected, tuple) else expected)


def test_integral_shapes_are_ints() -> None:
    assert Shape(depth=3.0, paths=np.int64(2)) == Shape(3, 2)
    assert Shape.parse([2.0, np.int8(2)]).branching == (2, 2)
    assert isinstance(Shape(depth=3.0).depth, int)


@pytest.mark.parametrize("options,param", [
    ({"ctx_size": 2**40}, "ctx_size"), ({"ctx_size": 10**400}, "ctx_size"), ({"batch_size": True}, "batch_size"),
    ({"threads": 2**40}, "threads"), ({"n_gpu_layers": -2}, "n_gpu_layers"), ({"n_seq_max": 2.5}, "n_seq_max"),
    ({"rpc": 5}, "rpc"), ({"rpc": ":80"}, "rpc"), ({"rpc": "h:0"}, "rpc"), ({"rpc": "h:" + "1" * 400}, "rpc"),
    ({"flash_attn": True}, "flash_attn"), ({"ctx_szie": 512}, "ctx_szie"),
    ({"batch_size": 8}, "batch_size"), ({"ctx_size": 16, "n_seq_max": 32, "batch_size": 64}, "ctx_size"),
])
def test_bad_model_options_are_config_errors_naming_them(options: dict, param: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelOptions.from_options(options)
    assert info.value.param == param


def test_a_batch_that_holds_every_sequence_is_accepted() -> None:
    """A batch smaller than n_seq_max aborts llama.cpp's context creation: refused above (the
    controls here, at the limit, are accepted)."""
    assert ModelOptions.from_options({"batch_size": 16, "n_seq_max": 16, "ctx_size": 16}).batch_size == 16
    assert ModelOptions.from_options({"batch_size": 8, "n_seq_max": 8}).n_seq_max == 8


def test_model_options_of_every_integral_kind() -> None:
    o = ModelOptions.from_options({"ctx_size": 512.0, "threads": np.int64(2), "batch_size": np.uint16(64)})
    assert (o.ctx_size, o.threads, o.batch_size) == (512, 2, 64) and type(o.threads) is int


@pytest.mark.parametrize("wrong,right", [("temprature", "temperature"), ("num_draft_token", "num_draft_tokens"),
                                         ("max_token", "max_tokens"), ("topp", "top_p"), ("verifer", "verifier")])
def test_misspelt_settings_suggest_the_right_one(wrong: str, right: str) -> None:
    with pytest.raises(ConfigError) as info:
        GenerationConfig.from_options(**{wrong: 1})
    assert info.value.param == wrong and f"did you mean {right!r}" in str(info.value)
    with pytest.raises(ConfigError, match="did you mean 'ctx_size'"):
        ModelOptions.from_options({"ctx_szie": 1})
    with pytest.raises(ConfigError, match="belong to load_model"):
        GenerationConfig.from_options(ctx_size=512)


# ---------------------------------------------------------------- the Python API, used as apps use it


@pytest.fixture(scope="module")
def pair(tiny_paths: tuple[Path, Path]):
    from conftest import load

    with load(tiny_paths[0], n_ctx=256) as target, load(tiny_paths[1], n_ctx=256) as draft:
        yield target, draft


API_CASES = UNREPRESENTABLE[:12] + [("config", {"max_tokens": 3}), ("profiles", "x"), ("temprature", 0.5)]


@pytest.mark.parametrize("name,value", API_CASES, ids=[f"{n}={v!r:.20}" for n, v in API_CASES])
def test_api_refuses_bad_settings_at_the_call(pair, name: str, value) -> None:
    """The ConfigError comes from stream_generate itself, before the generator is iterated."""
    target, draft = pair
    kwargs = {"config": value} if name == "config" else {name: value}
    with pytest.raises(ConfigError) as info:
        stream_generate(target, draft, "hello", **kwargs)
    assert info.value.param == name


PROMPTS = [(b"hello", "bytes"), (None, "NoneType"), (5, "int"), ({"role": "user", "content": "x"}, "one chat message"),
           ([10**9], "not in the vocabulary"), ([-1], "not in the vocabulary"), ([], "empty"), ([1.5], "float"),
           (["a", "b"], "str"), ([{"content": "x"}], "role None"), ([{"role": "user"}], "no 'content'"),
           ([{"role": "user", "content": 5}], "'content' of type int"), ([{"role": "user", "content": "x"}, 3], "must be a dict"),
           ([{"role": "user", "content": "x", "name": "bob"}], "'name'"), ("a\ud800", "lone surrogate")]


@pytest.mark.parametrize("prompt,message", PROMPTS, ids=[m for _, m in PROMPTS])
def test_wrong_prompts_are_prompt_errors_at_the_call(pair, prompt, message: str) -> None:
    target, draft = pair
    with pytest.raises(PromptError, match=message):
        stream_generate(target, draft, prompt, max_tokens=2)


@pytest.mark.parametrize("prompt", [np.array([1, 2, 3]), [np.int64(1), np.int32(2)], (1, 2, 3)], ids=["array", "np-ints", "tuple"])
def test_token_ids_of_every_integral_kind_are_prompts(pair, prompt) -> None:
    target, draft = pair
    assert len(list(stream_generate(target, draft, prompt, max_tokens=2, temperature=0))) >= 1


def test_models_that_are_not_loaded_models(pair, tiny_paths: tuple[Path, Path]) -> None:
    target, draft = pair
    for args, param in (((str(tiny_paths[0]), None), "target"), ((target, str(tiny_paths[1])), "draft"),
                        ((target, target), "draft")):
        with pytest.raises(ConfigError) as info:
            stream_generate(*args, "hi", max_tokens=2)
        assert info.value.param == param


def test_threads_sharing_a_pair_get_a_clear_error(pair) -> None:
    import threading

    target, draft = pair
    outcomes: list[str] = []

    def run() -> None:
        try:
            for _ in stream_generate(target, draft, "hello", max_tokens=40, temperature=0):
                pass
            outcomes.append("ok")
        except ModelError as exc:
            outcomes.append("busy" if "generating already" in str(exc) else repr(exc))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            outcomes.append(repr(exc))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(outcomes) <= {"busy", "ok"} and "ok" in outcomes, outcomes


def test_a_closed_model_is_a_model_error(tiny_paths: tuple[Path, Path]) -> None:
    from conftest import load

    model = load(tiny_paths[0], n_ctx=64)
    model.close()
    with pytest.raises(ModelError, match="is closed"):
        stream_generate(model, None, "hi", max_tokens=2)


def test_a_generation_left_open_at_exit_prints_no_traceback(tiny_paths: tuple[Path, Path]) -> None:
    import subprocess
    import sys

    code = ("from localspec import load_model, stream_generate\n"
            f"t = load_model({str(tiny_paths[0])!r}, ctx_size=64, threads=1)\n"
            "g = stream_generate(t, None, 'hello', max_tokens=20); next(g)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LOCALSPEC_LLAMA_LOG": "0"})
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]


# ---------------------------------------------------------------- state files of the wrong shape


def _profile(tmp_path: Path) -> tuple[Path, dict]:
    from localspec.decoding.profiles import VERSION

    data = {"version": VERSION, "key": "k", "identity": {"file": "/x/m.gguf", "threads": 1},
            "costs": {"1": 0.01, "4": 0.02}, "prefill": 0.001, "load": 0.5,
            "acceptance": {"model": [[10.0, 8.0], [2.0, 3.0]]}, "updated": 1.0}
    return tmp_path / "k.json", data


BAD_PROFILES = {
    "prefill str": lambda d: d.update(prefill="abc"), "prefill inf": lambda d: d.update(prefill=float("inf")),
    "prefill negative": lambda d: d.update(prefill=-1), "load list": lambda d: d.update(load=[1]),
    "cost key negative": lambda d: d.update(costs={"-5": 0.1}), "cost key huge": lambda d: d.update(costs={"10" * 20: 0.1}),
    "cost nan": lambda d: d.update(costs={"1": float("nan")}), "cost bool": lambda d: d.update(costs={"1": True}),
    "costs list": lambda d: d.update(costs=[1]), "acceptance uneven": lambda d: d.update(acceptance={"m": [[1.0], []]}),
    "acceptance rejected>at risk": lambda d: d.update(acceptance={"m": [[1.0], [5.0]]}),
    "acceptance negative": lambda d: d.update(acceptance={"m": [[-1.0], [0.0]]}),
    "acceptance str": lambda d: d.update(acceptance={"m": "ab"}),
    "acceptance too long": lambda d: d.update(acceptance={"m": [[1.0] * 5000, [0.0] * 5000]}),
    "identity.file int": lambda d: d["identity"].update(file=5),
    "updated str": lambda d: d.update(updated="x"),
}
BAD_FILES = {"deep": "[" * 100000 + "]" * 100000, "utf-16": "utf16", "empty": "", "null": "null",
             "huge int": '{"version": ' + "9" * 5000 + "}"}


@pytest.mark.parametrize("case", [*BAD_PROFILES, *BAD_FILES])
def test_malformed_profiles_are_ignored_with_a_warning(tmp_path: Path, case: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    from click.testing import CliRunner

    from localspec.cli import cli
    from localspec.decoding.profiles import Profiles
    from localspec.settings.locations import PROFILE_ENV

    path, data = _profile(tmp_path)
    if case in BAD_PROFILES:
        BAD_PROFILES[case](data)
        path.write_text(json.dumps(data))
    elif BAD_FILES[case] == "utf16":
        path.write_bytes(json.dumps(data).encode("utf-16"))
    else:
        path.write_text(BAD_FILES[case])
    with caplog.at_level(logging.WARNING):
        assert Profiles(tmp_path).on_disk() == []
    assert any("ignoring the unreadable cost profile" in r.getMessage() and "k.json" in r.getMessage()
               for r in caplog.records)
    for args in (["profiles", "list"], ["profiles", "list", "--json"]):
        r = CliRunner().invoke(cli, args, env={PROFILE_ENV: str(tmp_path)})
        assert r.exit_code == 0 and r.exception is None, r.output


def test_a_well_formed_profile_is_read(tmp_path: Path) -> None:
    from localspec.decoding.profiles import Profiles

    path, data = _profile(tmp_path)
    data["costs"]["2"] = 0  # not measured (as older versions wrote): dropped, not an error
    path.write_text(json.dumps(data))
    (found,) = Profiles(tmp_path).on_disk()
    assert found.costs == {1: 0.01, 4: 0.02} and found.acceptance["model"] == [[10.0, 8.0], [2.0, 3.0]]


def test_state_files_that_are_not_regular_files_are_not_read(tmp_path: Path) -> None:
    from localspec.decoding.profiles import Profiles

    os.mkfifo(tmp_path / "k.json")  # reading a FIFO would wait forever
    (tmp_path / "d.json").mkdir()
    assert Profiles(tmp_path).on_disk() == []


@pytest.mark.parametrize("content", [
    {"k": {"ok": "false", "detail": "x", "seconds": 1}}, {"k": {"ok": True, "detail": "x", "seconds": "1"}},
    {"k": [1, 2]}, {"k": None}, "[" * 100000 + "]" * 100000, b"\xff\xfe", "[1]", None,
], ids=["ok-str", "seconds-str", "entry-list", "entry-null", "deep", "binary", "list", "fifo"])
def test_malformed_kernel_checks_are_ignored(tmp_path: Path, content) -> None:
    from localspec.llama.kernel_verdicts import Checks, KernelVerdict

    checks = Checks(tmp_path)
    if content is None:
        os.mkfifo(checks.path)
    elif isinstance(content, bytes):
        checks.path.write_bytes(content)
    else:
        checks.path.write_text(content if isinstance(content, str) else json.dumps(content))
    fresh = Checks(tmp_path)
    assert fresh.get("k") is None and fresh.all() == {}  # "ok": "false" is no verdict of ok
    if content is not None:
        fresh.put("j", KernelVerdict(True, "fine", 0.5))  # and the record is rewritten
        assert Checks(tmp_path).get("j") == KernelVerdict(True, "fine", 0.5)


@pytest.mark.parametrize("sidecar", [b"", b"\xff\xfe\x00", b"hello", b"0" * 64 + b"  m.gguf\n", b"a" * 100000, None],
                         ids=["empty", "binary", "word", "wrong-hash", "huge", "directory"])
def test_malformed_model_checksum_files_are_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sidecar) -> None:
    """A model's .sha256 sidecar of the wrong shape: the model is verified again (and found good)."""
    import hashlib

    from localspec.llama import registry

    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    data = b"a model"
    spec = registry.ModelSpec("m", "d", "m.gguf", len(data), hashlib.sha256(data).hexdigest(), ())
    directory = registry.cache_dir()
    directory.mkdir(parents=True)
    (directory / "m.gguf").write_bytes(data)
    side = directory / "m.gguf.sha256"
    side.mkdir() if sidecar is None else side.write_bytes(sidecar)
    assert registry.cached_path(spec) == directory / "m.gguf"
    if sidecar is not None:
        assert side.read_text().split()[0] == spec.sha256  # rewritten


def test_a_lock_file_that_cannot_be_opened_is_a_fetch_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from localspec.llama import registry
    from localspec.errors import FetchError

    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    spec = registry.ModelSpec("m", "d", "m.gguf", 5, "0" * 64, ())
    (registry.cache_dir() / "m.gguf.lock").mkdir(parents=True)
    with pytest.raises(FetchError, match=r"m\.gguf\.lock"):
        registry.fetch(spec, progress=False)
