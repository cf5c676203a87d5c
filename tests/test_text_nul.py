"""Text stays text: a NUL (U+0000) in any text that becomes tokens is kept, with everything after
it — the prompt, chat messages of every role (system included), tool definitions and tool
results, --context and stdin, request bodies — and stop strings keep theirs. llama.cpp takes C
strings in places (its built-in chat renderer), where a NUL would silently end the message; each
test has a negative control showing that its check sees the text cut at the NUL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
from click.testing import CliRunner

from localspec import prompt as prompt_module
from localspec.decoding.text import StopScanner
from localspec.cli import cli
from localspec.cli.generate import with_context
from localspec.settings.generation import GenerationConfig
from localspec.errors import PromptError
from localspec.llama.model import Model
from localspec.prompt import chat_tokens, prompt_tokens

import tiny_models as tiny
from conftest import load

TEXT = "alpha\0beta gamma"  # what a C string would keep: "alpha"
HEAD = TEXT.split("\0")[0]


def text_of(model: Model, tokens: list[int]) -> bytes:
    return b"".join(model.token_bytes(t) for t in tokens)


def keeps(model: Model, tokens: list[int], text: str = TEXT) -> bool:
    """Whether the tokens hold `text` whole (its NUL and what follows it)."""
    return text.encode() in text_of(model, tokens)


# ---------------------------------------------------------------- the Python API's prompts


def test_a_plain_prompt_keeps_its_nul(tiny_target: Model) -> None:
    tokens = prompt_tokens(tiny_target, TEXT)
    assert keeps(tiny_target, tokens)
    assert not keeps(tiny_target, prompt_tokens(tiny_target, HEAD))  # negative control: the text cut at the NUL


@pytest.mark.parametrize("role", ["user", "assistant", "system"])
def test_a_chat_message_keeps_its_nul(tiny_target: Model, role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Go on"}]
    at = next(i for i, m in enumerate(messages) if m["role"] == role)
    messages[at] = {"role": role, "content": TEXT}
    tokens = chat_tokens(tiny_target, messages)
    assert keeps(tiny_target, tokens)
    assert len(tokens) > len(chat_tokens(tiny_target, [*messages[:at], {"role": role, "content": HEAD},
                                                       *messages[at + 1:]]))
    # negative control: a renderer that takes C strings (llama.cpp's built-in one) loses the rest of the message
    render = prompt_module._render_jinja
    monkeypatch.setattr(prompt_module, "_render_jinja", lambda template, messages, *rest: render(
        template, [{**m, "content": m["content"].split("\0")[0]} for m in messages], *rest))
    assert not keeps(tiny_target, chat_tokens(tiny_target, messages))


def test_a_placeholder_like_text_in_a_message_stays_as_written(tiny_target: Model) -> None:
    """Text like the placeholders that keep markers as text is never turned into anything else."""
    written = "\ue000nul0\ue001 and \ue000o\ue001"
    tokens = chat_tokens(tiny_target, [{"role": "user", "content": f"{written}\0{written}"}])
    assert f"{written}\0{written}".encode() in text_of(tiny_target, tokens)


@pytest.fixture(scope="module")
def tool_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    """A tiny model whose chat template renders tools (the Jinja path)."""
    path = tiny.write_tiny_model(tmp_path_factory.mktemp("nul-tools") / "tools.gguf", seed=0, vocab=tiny.TOOLS_VOCAB)
    with load(path) as m:
        yield m


def test_tool_definitions_and_results_keep_their_nul(tool_target: Model) -> None:
    def conversation(text: str) -> tuple[list[dict], list[dict]]:
        tools = [{"type": "function", "function": {"name": "lookup", "description": f"d-{text}",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        messages = [{"role": "user", "content": "look it up"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "name": "lookup", "content": f"r-{text}"}]
        return messages, tools

    tokens = chat_tokens(tool_target, *conversation(TEXT))
    assert keeps(tool_target, tokens, f"r-{TEXT}")  # the tool's result
    assert keeps(tool_target, tokens, "d-alpha\\u0000beta gamma")  # the definition, as JSON writes a NUL
    cut = chat_tokens(tool_target, *conversation(HEAD))  # negative control
    assert not keeps(tool_target, cut, f"r-{TEXT}") and not keeps(tool_target, cut, "d-alpha\\u0000beta gamma")


def test_a_vocabulary_without_a_token_for_nul_is_refused_not_cut(tiny_target: Model,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert tiny_target.tokenize(TEXT, add_special=False)  # negative control: this vocabulary has <0x00>
    real = tiny_target.token_bytes
    monkeypatch.setattr(tiny_target, "token_bytes", lambda t: real(t).replace(b"\0", b""))  # as if llama.cpp dropped it
    with pytest.raises(PromptError, match=r"NUL character \(U\+0000\)"):
        prompt_tokens(tiny_target, TEXT)
    assert prompt_tokens(tiny_target, HEAD)  # text without a NUL is not checked


# ---------------------------------------------------------------- stop strings


def test_stop_strings_keep_their_nul(tiny_target: Model) -> None:
    assert GenerationConfig(stop=["a\0b"]).stop == ("a\0b",)
    tokens = tiny_target.tokenize("xa\0by", add_special=False)

    def text(stops: list[str]) -> str:
        scanner = StopScanner(tiny_target, stops)
        scanner.commit(tokens)
        return ("".join(t for _, t in scanner.take()) + scanner.flush()).lstrip(" ")  # SentencePiece's space

    assert text(["a\0b"]) == "x"
    # negative control: a stop string cut at its NUL ("a") would stop here too; the whole one does not
    assert text(["a\0z"]) == "xa\0by"


# ---------------------------------------------------------------- the command line and the server


def _prompt_tokens(*args: str, input: str | None = None) -> int:
    r = CliRunner().invoke(cli, ["generate", *args, "-n", "1", "--json", "--keep-alive", "0"], input=input)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["usage"]["prompt_tokens"]


@pytest.mark.parametrize("raw", [False, True], ids=["chat", "raw"])
def test_context_file_and_stdin_keep_their_nul(tiny_target: Model, tiny_paths: tuple[Path, Path], tmp_path: Path,
                                                raw: bool) -> None:
    common = ["-m", str(tiny_paths[0]), "-d", "none", "--drafter", "ngram", "--ctx-size", "256", "--threads", "1",
              *(["--raw"] if raw else [])]

    def expected(text: str) -> int:
        if raw:
            return len(prompt_tokens(tiny_target, text))
        return len(chat_tokens(tiny_target, [{"role": "user", "content": text}]))

    context = tmp_path / "doc.txt"
    context.write_bytes(TEXT.encode())
    assert _prompt_tokens(*common, "--context", str(context), "Why?") == expected(with_context(TEXT, "Why?"))
    assert _prompt_tokens(*common, input=TEXT) == expected(TEXT)
    assert expected(with_context(HEAD, "Why?")) < expected(with_context(TEXT, "Why?"))  # negative control
    assert expected(HEAD) < expected(TEXT)


def test_request_bodies_keep_their_nul(tiny_target: Model) -> None:
    from starlette.testclient import TestClient

    from localspec.server.app import create_app
    from localspec.server.jobs import Pair

    app = create_app(Pair.adopting(tiny_target, None, "tiny"), model_id="tiny")
    with TestClient(app) as client:
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": TEXT}],
                                                          "max_tokens": 1, "stop": ["\0"]})
        plain = client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1})
    assert chat.status_code == 200 and plain.status_code == 200, (chat.text, plain.text)
    whole_chat = len(chat_tokens(tiny_target, [{"role": "user", "content": TEXT}]))
    assert chat.json()["usage"]["prompt_tokens"] == whole_chat
    assert plain.json()["usage"]["prompt_tokens"] == len(prompt_tokens(tiny_target, TEXT))
    assert whole_chat > len(chat_tokens(tiny_target, [{"role": "user", "content": HEAD}]))  # negative control
