"""LOCALSPEC_* environment variables (localspec.settings.environment): each parsed in one place, a bad value
a one-line error naming the variable (exit status 2 on the command line, in every command),
never a traceback; the registry names every variable the code, the tests and CI read."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from localspec.cli import cli
from localspec.errors import ConfigError
from localspec.settings import environment
from localspec.settings.environment import parse_bool, parse_dir, parse_duration, parse_size, parse_words

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(cli, list(args), env=env)


def one_line_error(output: str, *needles: str) -> None:
    """The output holds one "Error: ..." line that names each needle, and no traceback."""
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in output, output
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


# ---------------------------------------------------------------- the parsers


@pytest.mark.parametrize("text,seconds", [
    ("0", 0.0), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("1h30m", 5400.0), ("2m30s", 150.0), ("90", 90.0),
    ("1.5", 1.5), ("250ms", 0.25), (" 5M ", 300.0), ("1h 30m", 5400.0), (".5s", 0.5), ("0s", 0.0),
])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "LOCALSPEC_KEEP_ALIVE") == seconds


@pytest.mark.parametrize("text", ["-5", "-1m", "inf", "nan", "infinity", "", "  ", "5x", "30m1h", "5m5m", "1e3", "+5",
                                  "h", "m5", "9" * 400, "99999999999h", "5 m s", "1_000", "0x10"])
def test_bad_durations_are_one_line_errors_naming_the_variable(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration(text, "LOCALSPEC_KEEP_ALIVE")
    message = str(info.value)
    assert message.startswith("LOCALSPEC_KEEP_ALIVE=") and "\n" not in message and len(message) < 200, message


@pytest.mark.parametrize("text,size", [
    ("4G", 4 << 30), ("512M", 512 << 20), ("100000", 100000), ("1.5G", 3 << 29), ("4GiB", 4 << 30), ("4gb", 4 << 30),
    ("100B", 100), ("0", 0), (".5K", 512), ("1T", 1 << 40), (str(2**63 - 1), 2**63 - 1),
])
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text, "LOCALSPEC_PROMPT_CACHE_LIMIT") == size


@pytest.mark.parametrize("text", ["inf", "nan", "-1", "-4G", "4X", "", "1e3", "4iB", "4GG", "0x10", str(2**63),
                                  "9" * 30, "9" * 100000, "0." + "1" * 5000, "lots"])
def test_bad_sizes_are_one_line_errors_naming_the_variable(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text, "LOCALSPEC_PROMPT_CACHE_LIMIT")
    message = str(info.value)
    assert message.startswith("LOCALSPEC_PROMPT_CACHE_LIMIT=") and "\n" not in message and len(message) < 200


def test_booleans_directories_and_words(tmp_path: Path) -> None:
    words = ("1", "true", "YES", "on", "0", "false", "no", "Off")
    assert [parse_bool(t, "X") for t in words] == [True] * 4 + [False] * 4
    with pytest.raises(ConfigError, match="X='maybe' is not a boolean"):
        parse_bool("maybe", "X")
    assert parse_dir(str(tmp_path / "new"), "X") == tmp_path / "new"  # need not exist yet
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        parse_dir(str(tmp_path / "file"), "X")
    with pytest.raises(ConfigError, match="home directory is unknown"):  # was a RuntimeError
        parse_dir("~no-such-user-of-localspec/x", "X")
    assert parse_words("--index-url 'https://a b/simple'", "X") == ["--index-url", "https://a b/simple"]
    with pytest.raises(ConfigError, match="cannot be split into arguments"):
        parse_words('"unclosed', "X")


def test_keep_alive_is_registered_for_the_resident_service() -> None:
    assert environment.get("LOCALSPEC_KEEP_ALIVE", {}) == 300.0  # default 5m
    assert environment.get("LOCALSPEC_KEEP_ALIVE", {"LOCALSPEC_KEEP_ALIVE": "1h30m"}) == 5400.0
    assert environment.get("LOCALSPEC_KEEP_ALIVE", {"LOCALSPEC_KEEP_ALIVE": "0"}) == 0.0  # never
    assert environment.get("LOCALSPEC_KEEP_ALIVE", {"LOCALSPEC_KEEP_ALIVE": ""}) == 300.0  # empty: unset
    with pytest.raises(ConfigError, match="LOCALSPEC_KEEP_ALIVE='inf'"):
        environment.get("LOCALSPEC_KEEP_ALIVE", {"LOCALSPEC_KEEP_ALIVE": "inf"})


def test_defaults_are_the_ones_their_modules_use() -> None:
    from localspec.llama import prompt_cache, rpc

    assert environment.get(prompt_cache.LIMIT_ENV, {}) == prompt_cache.DEFAULT_LIMIT
    assert environment.get(rpc.TIMEOUT_ENV, {}) == rpc.DECODE_TIMEOUT == 120.0


# ---------------------------------------------------------------- one registry, complete


def _names_in(paths: list[Path]) -> set[str]:
    found = set()
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        found |= set(re.findall(r"\bLOCALSPEC_[A-Z][A-Z0-9_]*[A-Z0-9]\b", text))
    return found - {"LOCALSPEC_VERIFIER_H", "LOCALSPEC_INTERNAL_H", "LOCALSPEC_CONFIGS"}  # include guards, a constant


def test_every_variable_the_code_tests_and_ci_read_is_registered() -> None:
    files = [p for d in ("localspec", "tests", "native", "benchmarks", ".ci") for p in (ROOT / d).rglob("*")
             if p.is_file() and p.suffix in (".py", ".c", ".h", "") and "__pycache__" not in p.parts]
    assert len(files) > 50
    missing = _names_in(files) - set(environment.VARIABLES)
    assert not missing, f"add these to localspec.settings.environment.VARIABLES: {sorted(missing)}"


def test_unknown_variables_are_named_with_the_closest_known_one() -> None:
    typo = "LOCALSPEC_" + "PROMPT_CACHE_LIMT"  # spelt apart: the test above scans this file too
    assert environment.unknown({typo: "1G", "LOCALSPEC_MODEL": "x", "PATH": "/bin"}) == [
        f"unknown environment variable {typo} (did you mean LOCALSPEC_PROMPT_CACHE_LIMIT?)"]
    assert environment.unknown({name: "1" for name in environment.VARIABLES}) == []  # negative control


def test_the_command_line_warns_about_an_unknown_variable(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        r = run("models", "list", env={"LOCALSPEC_" + "PROFILE_DIRR": "/tmp"})
    assert r.exit_code == 0, r.output
    assert "_PROFILE_DIRR (did you mean LOCALSPEC_PROFILE_DIR?)" in caplog.text


def _options_with_envvar(command: click.Command) -> list[tuple[str, click.Option]]:
    out = []
    for param in command.params:
        if isinstance(param, click.Option) and param.envvar:
            out.append((command.name or "", param))
    if isinstance(command, click.Group):  # every command, loaded (the root group loads them when they run)
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            out += _options_with_envvar(command.get_command(ctx, name))
    return out


def test_every_flag_read_from_the_environment_is_registered_with_its_flag() -> None:
    from localspec.cli.options import EnvOption

    options = _options_with_envvar(cli)
    assert len(options) >= 8
    for command, option in options:
        variable = environment.VARIABLES.get(option.envvar)
        assert variable is not None, (command, option.envvar)
        assert variable.flag in option.opts, (command, option.opts, variable.flag)
        assert isinstance(option, EnvOption), (command, option.opts)  # names the variable in its errors
    flags = {v.name for v in environment.VARIABLES.values() if v.flag}
    assert flags == {option.envvar for _, option in options}  # and every registered flag variable is read


# ---------------------------------------------------------------- every command: one line, exit 2


BAD = [("LOCALSPEC_PROMPT_CACHE_LIMIT", "inf"), ("LOCALSPEC_PROMPT_CACHE_LIMIT", "nan"),
       ("LOCALSPEC_PROMPT_CACHE_LIMIT", "-1"), ("LOCALSPEC_PROMPT_CACHE_LIMIT", "lots"),
       ("LOCALSPEC_RPC_TIMEOUT", "0"), ("LOCALSPEC_RPC_TIMEOUT", "inf"), ("LOCALSPEC_KEEP_ALIVE", "-5m"),
       ("LOCALSPEC_LLAMA_LOG", "maybe"), ("LOCALSPEC_PIP_ARGS", '"unclosed'), ("LOCALSPEC_CACHE_DIR", "FILE"),
       ("LOCALSPEC_PROFILE_DIR", "FILE"), ("LOCALSPEC_PROMPT_CACHE", "FILE")]
# a command that got past the check fails otherwise (a model that does not exist), never loads or serves
COMMANDS = [["cache", "list"], ["cache", "clear"], ["info", "-m", "none"], ["profiles", "list"], ["profiles", "reset"],
            ["models", "list"], ["generate", "-m", "/nonexistent.gguf", "hi"], ["-m", "/nonexistent.gguf", "hi"],
            ["chat", "-m", "/nonexistent.gguf"], ["serve", "-m", "/nonexistent.gguf", "--port", "0"],
            ["bench", "-m", "/nonexistent.gguf"], ["check", "--toy-only"]]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n[10:]}={v}" for n, v in BAD])
def test_a_bad_value_is_one_line_with_exit_2_in_every_command(name: str, value: str, tmp_path: Path) -> None:
    if value == "FILE":
        (tmp_path / "file").write_text("")
        value = str(tmp_path / "file")
    for args in COMMANDS:
        r = run(*args, env={name: value})
        assert r.exit_code == 2, (args, r.output)
        one_line_error(r.output, f"{name}=")


def test_negative_control_good_values_are_read_where_they_are_used(tmp_path: Path) -> None:
    import json

    r = run("cache", "list", "--json", env={"LOCALSPEC_PROMPT_CACHE": str(tmp_path / "pc"),
                                            "LOCALSPEC_PROMPT_CACHE_LIMIT": "512M"})
    assert r.exit_code == 0 and json.loads(r.output)["limit"] == 512 << 20, r.output
    r = run("cache", "list", "--json", env={"LOCALSPEC_PROMPT_CACHE": str(tmp_path / "pc")})
    assert json.loads(r.output)["limit"] == 4 << 30


def test_python_api_reads_raise_config_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    from localspec.llama import backend, registry, rpc
    from localspec.llama.prompt_cache import PromptCache
    from localspec.settings import locations

    monkeypatch.setenv("LOCALSPEC_PROMPT_CACHE", str(tmp_path))
    monkeypatch.setenv("LOCALSPEC_PROMPT_CACHE_LIMIT", "inf")  # was an OverflowError traceback
    with pytest.raises(ConfigError, match="LOCALSPEC_PROMPT_CACHE_LIMIT='inf'"):
        PromptCache.from_setting(None)
    (tmp_path / "file").write_text("")
    for name, call in [(locations.PROFILE_ENV, locations.profile_dir), (registry.CACHE_ENV, registry.cache_root)]:
        monkeypatch.setenv(name, str(tmp_path / "file"))
        with pytest.raises(ConfigError, match=f"{name}=.* is not a directory"):
            call()
        monkeypatch.setenv(name, str(tmp_path / "dir"))
        assert call() == tmp_path / "dir"  # negative control
    monkeypatch.setenv(rpc.TIMEOUT_ENV, "soon")
    with pytest.raises(ConfigError, match="LOCALSPEC_RPC_TIMEOUT='soon'"):  # before connecting to anything
        rpc.devices(["127.0.0.1:9"])
    monkeypatch.setenv(rpc.TIMEOUT_ENV, "2m")
    assert rpc.decode_timeout() == 120.0 and rpc.DecodeWatch(["x:1"]).timeout == 120.0
    monkeypatch.setenv(backend.LOG_ENV, "loud")
    with pytest.raises(ConfigError, match="LOCALSPEC_LLAMA_LOG='loud'"):
        backend.init()
    assert backend._log_wanted() is False  # the log callback itself never raises
    monkeypatch.setenv(backend.LOG_ENV, "0")
    assert backend._log_wanted() is False  # "0" is off (it used to turn the log on)


# ---------------------------------------------------------------- flags read from the environment


def test_a_bad_flag_value_from_the_environment_names_the_variable() -> None:
    r = run("-m", "/nonexistent.gguf", "hi", env={"LOCALSPEC_CACHE_TYPE": "f64"})
    assert r.exit_code == 2
    one_line_error(r.output, "--cache-type", "(from $LOCALSPEC_CACHE_TYPE)", "'f64'")
    r = run("-m", "/nonexistent.gguf", "--cache-type", "f64", "hi")  # negative control: given as a flag
    assert r.exit_code == 2 and "--cache-type" in r.output and "$LOCALSPEC" not in r.output
    r = run("info", "-m", "none", env={"LOCALSPEC_RPC": "no-port"})
    assert r.exit_code == 2
    one_line_error(r.output, "--rpc (from $LOCALSPEC_RPC)", "'no-port'")
    r = run("info", "-m", "none", "--rpc", "no-port")
    assert r.exit_code == 2 and "--rpc" in r.output and "$LOCALSPEC" not in r.output
    r = run("cache", "list", env={"LOCALSPEC_CPU_KERNELS": "x"})  # a command without the flag ignores it
    assert r.exit_code == 0, r.output


def test_a_model_from_the_environment_that_is_not_found_says_where_it_came_from() -> None:
    r = run("hi", env={"LOCALSPEC_MODEL": "/nonexistent.gguf"})
    assert r.exit_code == 1
    one_line_error(r.output, "'/nonexistent.gguf'", "came from $LOCALSPEC_MODEL")
    r = run("-m", "/nonexistent.gguf", "hi")
    assert r.exit_code == 1 and "$LOCALSPEC_MODEL" not in r.output  # negative control


@pytest.mark.parametrize("key", ["s3cr3t\n", " s3cr3t", "s3\x01cr3t", "s3\tcr3t"])
def test_an_api_key_no_client_could_send_is_refused(key: str) -> None:
    pytest.importorskip("uvicorn")
    r = run("serve", "-m", "/nonexistent.gguf", "--port", "0", env={"LOCALSPEC_API_KEY": key})
    assert r.exit_code == 2, r.output
    one_line_error(r.output, "--api-key (from $LOCALSPEC_API_KEY)")
    assert "s3" not in r.output  # the key itself is not shown
    r = run("serve", "-m", "/nonexistent.gguf", "--port", "0", env={"LOCALSPEC_API_KEY": "a-good-key"})
    assert r.exit_code == 1 and "nonexistent" in r.output  # negative control: on to loading the model
