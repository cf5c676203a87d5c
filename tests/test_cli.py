"""`localspec` / `localspec generate` through click's CliRunner, on the tiny models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from localspec.cli import cli
from localspec.llama.model import Model

import tiny_models as tiny
from children import popen
from greedy import assert_greedy_text

PROMPT = "def add(a, b):"


def run(*args: str, input: str | None = None, env: dict | None = None):
    return CliRunner().invoke(cli, list(args), input=input, env=env, catch_exceptions=False)


@pytest.fixture(scope="module")
def pair_args(tiny_paths: tuple[Path, Path]) -> list[str]:
    # an F32 KV cache as the tiny_target fixture's, so that outputs differ from it only in the last bits
    return ["-m", str(tiny_paths[0]), "-d", str(tiny_paths[1]), "--ctx-size", "512", "--threads", "1",
            "--cache-type", "f32"]


@pytest.fixture(scope="module")
def expected(tiny_target: Model):
    """Checks printed text against the target-only greedy text (what every lossless verifier must
    print at temperature 0, up to a near-tie of the target's logits: tests/greedy.py)."""
    def check(stdout: str, prompt: str = PROMPT, max_tokens: int = 12) -> None:
        assert stdout.endswith("\n"), stdout
        assert_greedy_text(tiny_target, prompt, stdout[:-1], max_tokens)
    return check


def test_help_lists_common_options_and_examples() -> None:
    result = run("generate", "--help")
    assert result.exit_code == 0
    for flag in ("-m, --model", "-d, --draft", "--verifier", "-k, --num-draft-tokens", "--paths", "--tree",
                 "--drafter", "--plan", "--temperature", "--top-k", "--top-p", "--min-p", "--seed",
                 "--max-tokens", "--ctx-size", "--n-gpu-layers", "--draft-n-gpu-layers", "--json", "--usage",
                 "--cache-type", "--load-mode", "LOCALSPEC_MODEL", "LOCALSPEC_DRAFT", "LOCALSPEC_CACHE_TYPE"):
        assert flag in result.output, flag
    assert "localspec \"def quicksort(xs):\"" in result.output
    root = run("--help")
    assert root.exit_code == 0 and "generate" in root.output


@pytest.mark.parametrize("spec", [
    ["--verifier", "block", "-k", "4"],
    ["--verifier", "match", "-k", "3", "--plan", "fixed"],
    ["--verifier", "gbv", "--paths", "2", "-k", "3", "--plan", "fixed"],
    ["--verifier", "traversal", "--tree", "2x2x1", "--plan", "fixed"],
    ["--drafter", "ngram", "-d", "none", "-k", "3", "--plan", "fixed"],
    ["--load-mode", "mmap", "--cache-type", "f32"],
    ["--load-mode", "auto"],
])
def test_root_command_generates_target_greedy_text(pair_args: list[str], expected: str, spec: list[str]) -> None:
    result = run(*pair_args, *spec, "--raw", "-t", "0", "-n", "12", PROMPT)
    assert result.exit_code == 0, result.output
    expected(result.stdout)


def test_root_verbose_option_before_the_prompt(pair_args: list[str], expected: str) -> None:
    result = run("-v", *pair_args, "--raw", "-t", "0", "-n", "12", PROMPT)
    assert result.exit_code == 0, result.output
    expected(result.stdout)
    assert run("-vv", "models", "--help").exit_code == 0


def test_prompt_from_stdin(pair_args: list[str], expected: str) -> None:
    result = run(*pair_args, "--raw", "-t", "0", "-n", "12", input=PROMPT)
    assert result.exit_code == 0, result.output
    expected(result.stdout)


def test_argument_and_stdin_are_joined(pair_args: list[str], expected) -> None:
    result = run(*pair_args, "--raw", "-t", "0", "-n", "8", "Summarise:", input="some notes\n")
    assert result.exit_code == 0, result.output
    expected(result.stdout, "Summarise:\n\nsome notes\n", 8)


def test_json_output(pair_args: list[str], expected: str) -> None:
    result = run("generate", *pair_args, "--raw", "-t", "0", "-n", "12", "--plan", "fixed", "--json", PROMPT)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    expected(data["text"] + "\n")
    assert data["finish_reason"] in ("stop", "length")
    assert data["usage"]["completion_tokens"] >= 1
    assert data["settings"]["verifier"] == "block"
    stats = data["stats"]
    assert stats["target_passes"] >= 1 and stats["block_efficiency"] >= 1.0
    assert 1 <= sum(stats["accept_histogram"]) <= stats["target_passes"]  # speculative steps only
    # -n 12 leaves fewer tokens than the default --num-draft-tokens at every step: each one is capped
    assert stats["depth_limits"] == {"max_tokens": stats["target_passes"]}


def test_usage_goes_to_stderr(pair_args: list[str], expected: str) -> None:
    result = run(*pair_args, "--raw", "-t", "0", "-n", "12", "--plan", "fixed", "-u", PROMPT)
    assert result.exit_code == 0, result.output
    expected(result.stdout)
    for part in ("tok/s", "block efficiency", "acceptance", "accepted per step", "speedup estimate",
                 "draft depth below --num-draft-tokens on", "few tokens were left (max_tokens)"):
        assert part in result.stderr, part


def test_chat_template_and_stop_string(pair_args: list[str], tiny_target: Model) -> None:
    messages = [{"role": "user", "content": "hello"}]
    result = run(*pair_args, "-t", "0", "-n", "16", "--plan", "fixed", "hello")
    assert result.exit_code == 0
    assert_greedy_text(tiny_target, messages, result.stdout[:-1], 16)
    full = result.stdout[:-1]
    stop = full[3:5]
    cut = run(*pair_args, "-t", "0", "-n", "16", "--plan", "fixed", "--stop", stop, "hello")
    assert cut.exit_code == 0 and cut.stdout == full[: full.index(stop)] + "\n"


def test_env_vars_name_the_models(tiny_paths: tuple[Path, Path], expected: str) -> None:
    env = {"LOCALSPEC_MODEL": str(tiny_paths[0]), "LOCALSPEC_DRAFT": str(tiny_paths[1])}
    result = run("--ctx-size", "512", "--cache-type", "f32", "--raw", "-t", "0", "-n", "12", PROMPT, env=env)
    assert result.exit_code == 0, result.output
    expected(result.stdout)


def test_seeded_sampling_repeats(pair_args: list[str]) -> None:
    args = (*pair_args, "--raw", "-t", "1", "--plan", "fixed", "-n", "12")
    a, b, c = (run(*args, "--seed", seed, PROMPT) for seed in ("7", "7", "8"))
    assert a.exit_code == 0 and a.stdout == b.stdout
    assert c.stdout != a.stdout  # control: the seed matters


@pytest.mark.parametrize("args, message", [
    (["--tree", "2y2"], "Invalid value for --tree: '2y2' is not a draft shape"),
    (["--tree", "2x0"], "branching factors must be integers in [1, 16]"),
    (["--tree", "2x2", "--verifier", "block"], "verifies one chain"),
    (["--paths", "2", "--verifier", "traversal"], "without replacement"),
    (["--verifier", "nope"], "Invalid value for '--verifier'"),
    (["-k", "99"], "Invalid value for --num-draft-tokens: num_draft_tokens must be an integer in [0, 64]"),
    (["--drafter", "hybrid", "-d", "none"], "needs a draft model"),
    (["--seed", "-1"], "Invalid value for --seed: seed must be an integer in [0, 2**64)"),
    (["-t", "-1"], "Invalid value for --temperature"),
    (["--top-p", "0"], "Invalid value for --top-p"),
    (["-n", "0"], "Invalid value for --max-tokens"),
    (["--ctx-size", "8"], "Invalid value for --ctx-size: ctx_size must be at least 16"),
    (["--threads", "0"], "Invalid value for --threads"),
    # values past what the code underneath represents (issue 24): refused where parsed, naming the option
    (["--ctx-size", str(2**31)], "Invalid value for --ctx-size"),
    (["--ctx-size", "9" * 5000], "Invalid value for '--ctx-size'"),
    (["--threads", str(2**40)], "Invalid value for --threads"),
    (["--n-gpu-layers", str(2**40)], "Invalid value for --n-gpu-layers"),
    (["--n-gpu-layers", "-5"], "Invalid value for --n-gpu-layers"),
    (["--paths", str(2**70), "--verifier", "gbv"], "Invalid value for --paths"),
    (["-k", str(2**70)], "Invalid value for --num-draft-tokens"),
    (["-n", str(2**70)], "Invalid value for --max-tokens"),
    (["--seed", str(2**64)], "Invalid value for --seed"),
    (["--top-k", str(2**40)], "Invalid value for --top-k"),
    (["-t", "1e308"], "Invalid value for --temperature"),
    (["-t", "nan"], "Invalid value for --temperature"),
    (["--top-p", "inf"], "Invalid value for --top-p"),
    (["--min-p", "-inf"], "Invalid value for --min-p"),
    (["--tree", "9" * 5000, "--verifier", "traversal"], "Invalid value for --tree"),
    (["--tree", "x".join(["1"] * 100), "--verifier", "traversal"], "Invalid value for --tree: a draft tree has at most 64 levels"),
    (["--tree", "", "--verifier", "traversal"], "Invalid value for --tree: tree is empty"),
    (["--tree", "2x2x2x2x2x2", "--verifier", "traversal"], "use a tree of at most 16 branches"),
    (["--rpc", "h:99999"], "Invalid value for --rpc"),
    (["--rpc", ",,,"], "Invalid value for --rpc"),
    (["--stop", "x" * 1000], "Invalid value for --stop"),
    (["--raw", "-s", "be brief"], "Invalid value for --system"),
])
def test_bad_settings_are_clean_errors(pair_args: list[str], args: list[str], message: str) -> None:
    result = run(*pair_args, *args, PROMPT)
    assert result.exit_code in (1, 2)
    assert message in result.output
    assert "Traceback" not in result.output


def test_bad_model_files_are_clean_errors(tmp_path: Path, tiny_paths: tuple[Path, Path]) -> None:
    missing = run("-m", str(tmp_path / "nope.gguf"), "-d", "none", PROMPT)
    assert missing.exit_code == 1 and "nope.gguf" in missing.output and "known model" in missing.output
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    bad = run("-m", str(junk), "-d", "none", PROMPT)
    assert bad.exit_code == 1 and "junk.gguf" in bad.output and "Traceback" not in bad.output
    other = tiny.make_mismatched_draft(tmp_path)
    mismatch = run("-m", str(tiny_paths[0]), "-d", str(other), "--ctx-size", "512", PROMPT)
    assert mismatch.exit_code == 1 and "cannot draft for target" in mismatch.output


def test_prompt_longer_than_context(pair_args: list[str]) -> None:
    result = run(*pair_args[:-4], "--ctx-size", "256", "--raw", "word " * 2000)
    assert result.exit_code == 1
    assert "context" in result.output and "Traceback" not in result.output


def test_empty_stdin_is_a_usage_error(pair_args: list[str]) -> None:
    result = run(*pair_args, input="   \n")
    assert result.exit_code == 2 and "empty" in result.output


def test_python_dash_m_entry_point(tiny_paths: tuple[Path, Path], expected: str) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "localspec", "-m", str(tiny_paths[0]), "-d", str(tiny_paths[1]),
                          "--ctx-size", "512", "--cache-type", "f32", "--raw", "-t", "0", "-n", "12", PROMPT],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected(out.stdout)


def test_invalid_utf8_prompts_are_clean_errors(pair_args: list[str]) -> None:
    """Bytes that are not UTF-8, on stdin or in the argument (a shell passes them through), are a
    usage error saying where, not a traceback."""
    import subprocess
    import sys

    piped = run(*pair_args, "--raw", input=b"\xff\xfehello")
    assert piped.exit_code == 2 and "the prompt on stdin is not valid UTF-8 (byte 0xff at offset 0)" in piped.output
    out = subprocess.run([sys.executable, "-m", "localspec", *pair_args, "--raw", b"caf\xe9"],
                         stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert b"the prompt argument is not valid UTF-8 (byte 0xe9 at offset 3)" in out.stderr
    assert b"Traceback" not in out.stderr


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
def test_sigterm_keeps_what_was_generated(tiny_paths: tuple[Path, Path], as_json: bool) -> None:
    """`timeout` and service managers stop a run with SIGTERM: as with Ctrl-C, the text so far
    comes out (with --json, the one JSON object) and the exit status says so (143)."""
    import json
    import signal
    import subprocess
    import time

    cmd = [sys.executable, "-m", "localspec", "-m", str(tiny_paths[0]), "-d", "none", "-k", "0", "--raw",
           "--ctx-size", "60000", "-n", "59000", "-t", "0", *(["--json"] if as_json else []), "ab"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    time.sleep(3.0)  # loaded and generating (greedy from "ab" runs for minutes without an end token)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.decode()
    assert b"terminated" in err and b"Traceback" not in err
    if as_json:
        data = json.loads(out)
        assert data["usage"]["completion_tokens"] > 0 and data["text"]
    else:
        assert len(out.strip()) > 0


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_stop_before_the_first_token_still_prints_the_json(tiny_paths: tuple[Path, Path], signum: str) -> None:
    """Stopped in the prefill of a long prompt (no token yet), --json still prints its one object."""
    import signal
    import subprocess
    import time

    cmd = [sys.executable, "-m", "localspec", "-m", str(tiny_paths[0]), "-d", "none", "-k", "0", "--raw",
           "--ctx-size", "60000", "--threads", "1", "-n", "10", "-t", "0", "--json"]
    proc = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE)  # SIGINT: as Ctrl-C
    assert proc.stdin is not None
    proc.stdin.write(("word " * 30000).encode())  # a prefill of ~30000 tokens: seconds on one thread
    proc.stdin.close()
    proc.stdin = None
    time.sleep(1.0)  # loaded (the tiny model loads in well under a second), prefilling
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(getattr(signal, signum))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == (143 if signum == "SIGTERM" else 130), err.decode()[-2000:]
    assert b"Traceback" not in err
    data = json.loads(out)
    assert data["text"] == "" and data["finish_reason"] is None and data["usage"]["completion_tokens"] == 0


# ---------------------------------------------------------------- structured output

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]},
                                           "name": {"type": "string", "maxLength": 6}},
          "required": ["ok", "level", "name"], "additionalProperties": False}


def test_json_schema_flag_file_and_text(pair_args: list[str], tmp_path: Path) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    for value in (str(schema_file), json.dumps(SCHEMA)):
        result = run(*pair_args, "--raw", "-n", "60", "-t", "0.7", "--seed", "3", "--json-schema", value, "--json",
                     PROMPT)
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert out["finish_reason"] == "stop" and out["constraint_satisfied"] is True
        value_out = json.loads(out["text"])
        assert list(value_out) == ["ok", "level", "name"] and value_out["level"] in ("low", "high")
        assert out["settings"]["response_format"]["type"] == "json_schema"


def test_regex_json_object_and_grammar_flags(pair_args: list[str], tmp_path: Path) -> None:
    import re

    result = run(*pair_args, "--raw", "-n", "20", "-t", "0", "--regex", "(yes|no)[0-9]{1,2}", PROMPT)
    assert result.exit_code == 0 and re.fullmatch(r"(yes|no)[0-9]{1,2}\n", result.stdout), result.output
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= "def " [a-z] [a-z]? "():"')
    lark = tmp_path / "g.lark"
    lark.write_text('start: "def " /[a-z]{1,2}/ "():"')
    # a file, or the grammar itself (the API's and the server's grammar is text)
    for value in (str(gbnf), str(lark), gbnf.read_text(), "%llguidance {}\n" + lark.read_text()):
        result = run(*pair_args, "--raw", "-n", "20", "-t", "0.8", "--seed", "1", "--grammar", value, PROMPT)
        assert result.exit_code == 0 and re.fullmatch(r"def [a-z]{1,2}\(\):\n", result.stdout), result.output
    result = run(*pair_args, "--raw", "-n", "3", "-t", "0", "--json-object", PROMPT)
    assert result.exit_code == 0 and result.stdout.startswith("{")
    assert "truncated" in result.stderr  # 3 tokens: never presented as complete


@pytest.mark.parametrize("args,flag", [
    (["--json-schema", '{"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)"}}}'],
     "--json-schema"),
    (["--json-schema", "no-such-file.json"], "--json-schema"),
    (["--json-schema", "{not json"], "--json-schema"),
    (["--regex", "(unclosed"], "--regex"),
    (["--grammar", "no-such.gbnf"], "--grammar"),
    (["--grammar", 'root ::= "a'], "--grammar"),
    (["--grammar", '%llguidance {}\nstart: "a'], "--grammar"),
    (["--regex", "a", "--json-object"], "--regex"),
    (["--regex", "a", "--stop", "x"], "--stop"),
])
def test_bad_constraint_flags_are_usage_errors(pair_args: list[str], args: list[str], flag: str) -> None:
    result = run(*pair_args, *args, PROMPT)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for {flag}" in result.output and "Traceback" not in result.output


def test_bad_grammar_file_is_a_usage_error(pair_args: list[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.gbnf"
    bad.write_text("root ::= missing")
    result = run(*pair_args, "--grammar", str(bad), PROMPT)
    assert result.exit_code == 2 and "Invalid value for --grammar" in result.output, result.output


def test_a_system_message_for_a_model_without_chat_template(tmp_path: Path) -> None:
    """Only the loaded model says it has no template: the error comes from where the call runs,
    naming --system (a usage error), as the raw prompt goes through without one."""
    bare = tiny.write_tiny_model(tmp_path / "bare.gguf", chat_template=False)
    refused = run("-m", str(bare), "-d", "none", "-s", "be brief", "-n", "4", PROMPT)
    assert refused.exit_code == 2 and "Invalid value for --system: bare.gguf has no chat template" in refused.output
    assert "Traceback" not in refused.output
    assert run("-m", str(bare), "-d", "none", "-n", "4", PROMPT).exit_code == 0  # the control
