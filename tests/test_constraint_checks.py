"""Every constraint is checked before the first token, on every surface (issue 33, items 2-4).

* A stress set of constraints llguidance cannot follow — an empty language (a regex, a schema
  that is only a reference to itself, a left-recursive rule), a rule that can never end, a
  repetition too large for the lexer, a schema of more alternatives than the parser follows, a
  special token the vocabulary lacks — is refused when the
  setting is made (where it needs no vocabulary), and always before any decoding: ConfigError at
  the API's call naming the setting, exit 2 naming the flag, HTTP 400 naming the field. Negative
  control: followed as a generation follows them, without the check, each of these fails inside
  llguidance within its first tokens (what used to be an internal error mid-generation).
* A matcher failure after the check is localspec's own: ConstraintError says it is a bug (exit 1,
  HTTP 500).
* A constraint flag given an empty value (an unset shell variable) is a usage error, never a
  run without the constraint.
* Deep JSON (schemas inline, in files, tools files, tools, tool-call arguments) is refused at a
  stated depth, never with a RecursionError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import pytest
from click.testing import CliRunner

from localspec.api import Generation, stream_generate
from localspec.cli import cli
from localspec.settings.constraints import Constraint
from localspec.settings.generation import GenerationConfig
from localspec.settings.constraints import MAX_JSON_DEPTH, json_depth
from localspec.decoding.grammar import compiler as C
from localspec.decoding.grammar import follower as F, masks as M, tokenizer as T
from localspec.decoding.profiles import Profiles
from localspec.errors import ConfigError, ConstraintError, PromptError, RequestError, exit_code
from localspec.llama.model import Model
from localspec.prompt import check_messages
from localspec.server import schemas
from localspec.server.app import status_of
from localspec.tools import ToolSet

PROMPT = "def add(a, b): return a + b"
SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # no finite value
EMPTY = "no output can match it"
PARSER = "exceeds llguidance's parser limits"
LEXER = "exceeds llguidance's lexer limits"
VOCABULARY = "cannot be used with this model's vocabulary"

# (id, generation options, param, fragment of the message, whether it is refused without a model)
STRESS = [
    ("regex-empty-class", dict(regex="[a&&b]"), "regex", EMPTY, True),
    ("regex-empty-range", dict(regex="x[^\\x00-\\x{10FFFF}]"), "regex", EMPTY, True),
    ("regex-explodes", dict(regex="a{1000000}"), "regex", LEXER, True),
    ("schema-self-ref", dict(json_schema={"$ref": "#"}), "json_schema", EMPTY, True),
    ("schema-required-self-ref", dict(json_schema=SELF_REQUIRED), "json_schema", PARSER, True),
    ("format-required-self-ref", dict(response_format={"type": "json_schema", "json_schema": {
        "name": "loop", "schema": {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                                   "required": ["next"]}}, "$ref": "#/$defs/n"}}}),
     "response_format", PARSER, True),
    ("schema-too-many-alternatives", dict(json_schema={"anyOf": [  # over llguidance's 2000 items in a row
        {"type": "object", "properties": {"k": {"const": i}}, "required": ["k"]} for i in range(2100)]}),
     "json_schema", PARSER, True),
    ("gbnf-left-recursion", dict(grammar='root ::= root "a"'), "grammar", EMPTY, True),
    ("gbnf-never-ends", dict(grammar='root ::= "(" root ")"'), "grammar", PARSER, True),
    ("lark-empty-lexeme", dict(grammar='%llguidance {}\nstart: "x" A\nA: /[a&&b]/'), "grammar", EMPTY, True),
    ("lark-branch-never-ends", dict(grammar='%llguidance {}\nstart: "a" | "b" x\nx: "(" x ")"'), "grammar", PARSER,
     True),  # off the path the check follows: found among the other tokens it tries
    # grammars naming special tokens need the model's vocabulary: refused when the generation is set up
    ("lark-token-then-empty", dict(grammar="%llguidance {}\nstart: <s> A\nA: /[a&&b]/"), "grammar", VOCABULARY, False),
    ("lark-token-never-ends", dict(grammar='%llguidance {}\nstart: <s> x\nx: "(" x ")"'), "grammar", VOCABULARY,
     False),
    ("lark-unknown-token", dict(grammar='%llguidance {}\nstart: <nope> "a"'), "grammar", VOCABULARY, False),
]
IDS = [s[0] for s in STRESS]


def constraint_of(options: dict) -> Constraint:
    constraint = GenerationConfig.from_options(**options).constraint
    assert constraint is not None
    return constraint


@pytest.mark.parametrize("name,options,param,fragment,early", STRESS, ids=IDS)
def test_refused_when_the_setting_is_made(name: str, options: dict, param: str, fragment: str, early: bool) -> None:
    """Compiling checks the grammar's start over a vocabulary of bytes: no model is needed for
    the refusal (grammars naming special tokens excepted: they pass here, refused below)."""
    constraint = constraint_of(options)
    if not early:
        C.compile_constraint(constraint)
        return
    with pytest.raises(ConfigError) as err:
        C.compile_constraint(constraint)
    assert err.value.param == param and fragment in str(err.value), str(err.value)
    assert "\n" not in str(err.value) and "<state>" not in str(err.value)


@pytest.mark.parametrize("name,options,param,fragment,early", STRESS, ids=IDS)
def test_refused_at_the_call_before_any_decoding(tiny_target: Model, monkeypatch: pytest.MonkeyPatch, name: str,
                                                 options: dict, param: str, fragment: str, early: bool) -> None:
    """The API raises ConfigError naming the setting at the call (stream_generate and Generation),
    never while iterating, and nothing is decoded."""
    def no_decoding(*args: Any, **kw: Any) -> None:
        raise AssertionError("decoded before the constraint was checked")

    monkeypatch.setattr(Model, "decode_parts", no_decoding)
    with pytest.raises(ConfigError) as err:
        stream_generate(tiny_target, None, PROMPT, max_tokens=8, profiles=Profiles.in_memory(), **options)
    assert err.value.param == param and fragment in str(err.value), str(err.value)
    if not early:  # the check over the model's vocabulary, in Generation's set-up
        config = GenerationConfig(constraint=constraint_of(options), max_tokens=8)
        with pytest.raises(ConfigError, match=VOCABULARY):
            Generation(tiny_target, None, PROMPT, config, Profiles.in_memory())


def follow_unchecked(grammar: str, tokenizer: llguidance.LLTokenizer, steps: int = 8) -> str | None:
    """Follow a grammar as a generation could, with no check first: mask, then the first (and,
    in a second run, the last) allowed token that is not an end token; llguidance's error, if
    either run fails (None: neither did)."""
    for pick in (0, -1):
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        row = np.zeros(M.mask_words(tokenizer.vocab_size), dtype=np.uint32)
        for _ in range(steps):
            if not matcher.is_error():
                matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if matcher.is_error():
                return matcher.get_error()
            allowed = [int(t) for t in np.flatnonzero(M.allowed_tokens(row, tokenizer.vocab_size))
                       if int(t) not in tokenizer.eos_tokens]
            if not allowed:
                break
            matcher.consume_token(allowed[pick])
        if matcher.is_error():
            return matcher.get_error()
    return None


@pytest.mark.parametrize("name,options,param,fragment,early", STRESS, ids=IDS)
def test_negative_control_unchecked_they_fail_mid_generation(tiny_target: Model, name: str, options: dict,
                                                             param: str, fragment: str, early: bool) -> None:
    """Without the check each stress grammar makes llguidance fail within its first tokens (the
    check is not vacuous), while the grammars of valid constraints follow on."""
    tokenizer = T.tokenizer_for(tiny_target)
    assert follow_unchecked(C._to_grammar(constraint_of(options)), tokenizer) is not None
    for good in (dict(regex="[a-z]{1,5}"), dict(json_schema={"type": "object", "properties": {"a": {"$ref": "#"}}}),
                 dict(grammar='root ::= "(" root ")" | "x"'), dict(grammar='%llguidance {}\nstart: <s> "a"')):
        assert follow_unchecked(C._to_grammar(constraint_of(good)), tokenizer) is None, good
        C.compile_constraint(constraint_of(good))


def test_tool_parameters_are_checked_as_schemas() -> None:
    """A tool whose parameters no finite value satisfies is refused naming the tool's parameters
    (ToolSet.parse: when the request arrives), a sound recursive one is accepted (negative control)."""
    with pytest.raises(ConfigError) as err:
        ToolSet.parse([tool(SELF_REQUIRED)], "required")
    assert err.value.param == "tools[0].function.parameters" and PARSER in str(err.value)
    ToolSet.parse([tool({"type": "object", "properties": {"a": {"$ref": "#"}}})], "required")


def test_the_check_leaves_the_follower_at_its_start(tiny_target: Model) -> None:
    """The follower checks a copy of its matcher: its first mask and forced tokens are a fresh
    matcher's, although the check followed START_TOKENS tokens (the copy is no longer at the start)."""
    tokenizer = T.tokenizer_for(tiny_target)
    constraint = Constraint.json_schema({"type": "object", "properties": {"name": {"type": "string"}},
                                         "required": ["name"]})
    grammar = C.compile_constraint(constraint)
    walked = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert C.start_problem(walked, tokenizer) is None
    follower = F.GrammarFollower(constraint, tokenizer, tiny_target.n_vocab)
    fresh = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    rows = np.zeros((3, M.mask_words(tokenizer.vocab_size)), dtype=np.uint32)
    for matcher, row in zip((fresh, walked), rows):
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    follower.mask(rows[2])
    assert (rows[2] == rows[0]).all() and follower.forced() == fresh.compute_ff_tokens()
    assert not (rows[1] == rows[0]).all()  # negative control: the walked matcher is elsewhere


def test_the_start_is_followed_once_per_model_and_grammar(tiny_target: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server or a chat sends the same constraint again and again: its start is followed over
    the model's vocabulary once (a new grammar is followed: negative control)."""
    calls: list[int] = []
    real = C.start_problem

    def counted(matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer) -> str | None:
        if tokenizer is not C.byte_tokenizer():  # the model's vocabulary (compiling follows it over bytes once too)
            calls.append(1)
        return real(matcher, tokenizer)

    monkeypatch.setattr(F, "start_problem", counted)  # the follower follows it over the model's vocabulary
    config = GenerationConfig(constraint=Constraint.regex("[a-z]{1,7}-once"), max_tokens=2)
    for _ in range(3):
        Generation(tiny_target, None, PROMPT, config, Profiles.in_memory())
    assert len(calls) == 1
    Generation(tiny_target, None, PROMPT, GenerationConfig(constraint=Constraint.regex("[a-z]{1,7}-twice"),
                                                           max_tokens=2), Profiles.in_memory())
    assert len(calls) == 2


def test_a_matcher_failure_later_is_our_bug(tiny_target: Model) -> None:
    """After the check, a failure of the matcher is an internal error (ConstraintError saying it is a
    bug: exit 1, HTTP 500), never the client's (ConfigError: exit 2, HTTP 400)."""
    follower = F.GrammarFollower.for_model(Constraint.regex("[a-z]+"), tiny_target)
    follower.reset(tiny_target.tokenize(PROMPT))
    with pytest.raises(ConstraintError) as err:
        follower.commit(tiny_target.tokenize("7", add_special=False)[-1:])
    assert "a bug in localspec" in str(err.value)
    assert exit_code(err.value) == 1 and status_of(err.value) == 500
    assert exit_code(ConfigError("x")) == 2 and status_of(ConfigError("x")) == 400


# ---------------------------------------------------------------- the CLI


def run_cli(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def base_args(tiny_paths: tuple[Path, Path]) -> list[str]:
    return ["-m", str(tiny_paths[0]), "-d", "none", "--ctx-size", "512", "--threads", "1", "--prompt-cache", "off",
            "-n", "4"]


@pytest.mark.parametrize("flag", ["--regex", "--json-schema", "--grammar", "--tools"])
@pytest.mark.parametrize("value", ["", "  "])
def test_empty_constraint_flags_are_usage_errors(flag: str, value: str, tmp_path: Path) -> None:
    """`--regex "$UNSET"` is refused naming the flag (exit 2), before any model is looked for (the
    model named does not exist), never a run without the constraint."""
    r = run_cli("-m", str(tmp_path / "missing.gguf"), flag, value, "hi")
    assert r.exit_code == 2 and f"Invalid value for {flag}: the value is empty" in r.output, r.output
    assert r.stdout == ""


def test_empty_constraints_through_the_api_are_refused() -> None:
    """The API's keywords: an empty regex, grammar or schema text is a ConfigError naming it."""
    for options, param in ((dict(regex=""), "regex"), (dict(grammar=" "), "grammar"),
                           (dict(json_schema=""), "json_schema"), (dict(response_format=""), "response_format")):
        with pytest.raises(ConfigError) as err:
            GenerationConfig.from_options(**options)
        assert err.value.param == param, options
    with pytest.raises(ConfigError) as err:
        ToolSet.parse("")
    assert err.value.param == "tools"


def test_cli_refuses_the_stress_set_naming_the_flag(tiny_paths: tuple[Path, Path], tmp_path: Path) -> None:
    """Exit 2 naming the flag, nothing on stdout: before the model loads where no vocabulary is
    needed (a missing model file shows it), after it loads and before any token otherwise."""
    missing = ["-m", str(tmp_path / "missing.gguf")]
    for args, flag in ((["--regex", "[a&&b]"], "--regex"),
                       (["--json-schema", json.dumps(SELF_REQUIRED)], "--json-schema")):
        r = run_cli(*missing, *args, "hi")
        assert r.exit_code == 2 and f"Invalid value for {flag}" in r.output, r.output
    grammar = tmp_path / "g.lark"
    grammar.write_text("%llguidance {}\nstart: <s> A\nA: /[a&&b]/\n")
    r = run_cli(*base_args(tiny_paths), "--grammar", str(grammar), "hi")
    assert r.exit_code == 2 and "Invalid value for --grammar" in r.output and VOCABULARY in r.output, r.output
    assert r.stdout == ""


# ---------------------------------------------------------------- deep JSON


def nested_schema(levels: int) -> dict:
    """A schema whose JSON nests 2 * levels + 1 deep (an object property per level)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP = nested_schema(MAX_JSON_DEPTH)  # deeper than allowed (2 * 64 + 1 levels)
VERY_DEEP_TEXT = '{"items": ' * 5000 + "{}" + "}" * 5000  # beyond Python's recursion limit


def test_json_depth_is_measured_without_recursion() -> None:
    assert json_depth(1) == 0 and json_depth({}) == 1 and json_depth([[1], {"a": [2]}]) == 3
    assert json_depth(nested_schema(3)) == 7 and json_depth(DEEP) == MAX_JSON_DEPTH + 1  # counted up to the limit
    loop: dict = {}
    loop["a"] = loop
    assert json_depth(loop) == MAX_JSON_DEPTH + 1


def test_deep_schemas_are_refused_at_a_stated_depth() -> None:
    """Inline (a mapping or JSON text, also beyond Python's recursion limit) and in
    response_format: ConfigError naming the setting and the depth; one level less is accepted
    (negative control)."""
    ok = nested_schema((MAX_JSON_DEPTH - 1) // 2)
    assert json_depth(ok) <= MAX_JSON_DEPTH
    Constraint.json_schema(ok)
    for schema in (DEEP, json.dumps(DEEP), VERY_DEEP_TEXT):
        with pytest.raises(ConfigError, match=f"nests deeper than {MAX_JSON_DEPTH} levels") as err:
            GenerationConfig.from_options(json_schema=schema)
        assert err.value.param == "json_schema"
    with pytest.raises(ConfigError) as err:
        GenerationConfig.from_options(response_format={"type": "json_schema", "json_schema": {"schema": DEEP}})
    assert err.value.param == "response_format" and f"{MAX_JSON_DEPTH} levels" in str(err.value)


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def test_deep_tools_and_arguments_are_refused() -> None:
    """A tool nesting too deep is a ConfigError naming it; so are tool-call arguments in messages
    (a PromptError naming the field), as a string beyond Python's recursion limit too."""
    ToolSet.parse([tool(nested_schema(20))])
    with pytest.raises(ConfigError) as err:
        ToolSet.parse([tool(nested_schema(MAX_JSON_DEPTH // 2))])
    assert err.value.param == "tools[0]" and f"{MAX_JSON_DEPTH} levels" in str(err.value)
    for arguments in ('{"a": ' * 5000 + "1" + "}" * 5000, json.dumps({"a": DEEP})):
        call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        with pytest.raises(PromptError) as perr:
            check_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                                 "tool_calls": [call]}])
        assert perr.value.param == "messages[1].tool_calls[0].function.arguments", perr.value
        assert f"{MAX_JSON_DEPTH} levels" in str(perr.value)


def test_deep_json_in_server_fields_is_a_400_naming_the_field() -> None:
    """A server whose body limit (--max-nesting) lets a deep schema through: the field is named
    (response_format, json_schema, tools[0]); a RequestError is the server's 400."""
    for body, param in (({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": DEEP}}},
                         "response_format"),
                        ({"prompt": "x", "json_schema": DEEP}, "json_schema")):
        request = schemas.parse(body, chat=False)
        with pytest.raises(RequestError) as err:
            request.config(GenerationConfig())
        assert err.value.param == param and err.value.status == 400 and "levels" in str(err.value)
    chat = schemas.parse({"messages": [{"role": "user", "content": "x"}], "tools": [tool(DEEP)]}, chat=True)
    with pytest.raises(RequestError) as err:
        chat.toolset()
    assert err.value.param == "tools[0]" and err.value.status == 400


def test_cli_deep_schemas_and_tools_files(tmp_path: Path) -> None:
    """--json-schema inline and in a file, --tools FILE: exit 2 naming the flag, no traceback."""
    missing = ["-m", str(tmp_path / "missing.gguf")]
    schema_file, tools_file = tmp_path / "schema.json", tmp_path / "tools.json"
    schema_file.write_text(json.dumps(DEEP))
    for value in (json.dumps(DEEP), str(schema_file), VERY_DEEP_TEXT):
        r = run_cli(*missing, "--json-schema", value, "hi")
        assert r.exit_code == 2 and "Invalid value for --json-schema" in r.output and "levels" in r.output, r.output
    for tools in (json.dumps([tool(DEEP)]), "[" * 5000 + "]" * 5000):
        tools_file.write_text(tools)
        r = run_cli(*missing, "--tools", str(tools_file), "hi")
        assert r.exit_code == 2 and "Invalid value for --tools" in r.output, r.output
        assert f"deeper than {MAX_JSON_DEPTH} levels" in r.output and "recursion" not in r.output, r.output
