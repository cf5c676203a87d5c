"""The persistent prompt cache (localspec.llama.prompt_cache) on tiny GGUF models: saved state
restores bit for bit, T = 0 output equals a run without the cache that splits its prefill the
same way, entries of another model or KV type are never used, bad files are removed, not used,
a read-only directory turns the cache off, eviction keeps the size limit, and two processes
writing at once leave only whole files."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from localspec.api import Generation, stream_generate
from localspec.settings.generation import GenerationConfig
from localspec.settings.models import ModelOptions
from localspec.decoding.profiles import Profiles
from localspec.errors import ConfigError
from localspec.llama.model import Model
from localspec.llama.prompt_cache import PromptCache, parse_limit
from localspec.llama.prompt_store import MAGIC, SUFFIX

from conftest import EXACT, load

DOC = ("def add(a, b):\n    return a + b\n\n" * 6)  # a shared document, well over MIN_TOKENS tokens
QUESTIONS = ("\nQ: what does add do?", "\nQ: rename add to plus")
SETTINGS = dict(temperature=0.0, max_tokens=12, drafter="ngram", plan="fixed", num_draft_tokens=4)


@pytest.fixture()
def model(tiny_paths: tuple[Path, Path]) -> Iterator[Model]:
    with load(tiny_paths[0]) as m:
        yield m


def tokens_of(model: Model, text: str) -> list[int]:
    return model.tokenize(text)


def run(model: Model, prompt: list[int], cache: PromptCache | str | None) -> tuple[list[int], Generation]:
    g = Generation(model, None, prompt, GenerationConfig.from_options(**SETTINGS), Profiles.in_memory(), cache)
    out = [r.token for r in g if r.token is not None]
    return out, g


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("*" + SUFFIX))


def test_restored_state_is_bit_identical_and_the_output_equal(model: Model, tmp_path: Path) -> None:
    cache = PromptCache(tmp_path)
    prompt = tokens_of(model, DOC + QUESTIONS[0])
    first, g = run(model, prompt, cache)
    assert g.restored == 0 and len(files(tmp_path)) == 1
    saved = cache.entries()[0]
    assert list(saved.tokens) == prompt  # the prefill decoded all of it (its last token's logits: the first step's)
    model.clear()
    assert cache.restore(model, prompt + prompt[-1:]) == len(prompt)  # a longer prompt keeps all of the entry
    assert model.seq_state() == cache.load(saved)  # the restored cells are the saved ones, byte for byte
    model.clear()
    assert cache.restore(model, prompt) == len(prompt) - 1
    model.clear()
    again, g = run(model, prompt, cache)  # a full hit: only the last prompt token is decoded
    assert g.restored == len(prompt) - 1 and again == first
    assert g.engine.stats().cached_tokens == len(prompt) - 1


def test_partial_hit_equals_the_same_split_without_the_cache(model: Model, tmp_path: Path) -> None:
    """A longer entry serves a shorter prompt: restore, trim past the common part, prefill the
    rest; the output is the one a run without the cache gets when it prefills at the same split."""
    cache = PromptCache(tmp_path)
    a, b = (tokens_of(model, DOC + q) for q in QUESTIONS)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    run(model, a, cache)
    model.clear()
    with_cache, g = run(model, b, cache)
    assert g.restored == shared
    model.clear()
    run(model, b[: shared + 1], None)  # the cache now holds b[:shared], as the restore left it
    without, g = run(model, b, None)
    assert g.restored == 0 and without == with_cache
    assert len(files(tmp_path)) == 1  # the document's entry serves both: a few more tokens are not saved again
    run(model, b + tokens_of(model, DOC), cache)
    assert len(files(tmp_path)) == 2  # many more are


def test_another_model_or_kv_type_never_reuses_an_entry(tiny_paths: tuple[Path, Path], tmp_path: Path) -> None:
    cache = PromptCache(tmp_path)
    with load(tiny_paths[0]) as m:
        prompt = tokens_of(m, DOC)
        run(m, prompt, cache)
    others = (load(tiny_paths[1]), load(tiny_paths[0], cache_type="f16"),
              Model(tiny_paths[0], ModelOptions(ctx_size=512, batch_size=128, **EXACT)))
    for other in others:
        with other:
            assert cache.best(other, prompt) is None
            _, g = run(other, prompt, cache)
            assert g.restored == 0
    assert len({p.parent for p in files(tmp_path)}) == 4  # one directory per model state key


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "foreign", "empty"])
def test_bad_files_are_removed_never_used(model: Model, tmp_path: Path, damage: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    cache = PromptCache(tmp_path)
    prompt = tokens_of(model, DOC)
    first, _ = run(model, prompt, cache)
    path = files(tmp_path)[0]
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x10  # a bit of the KV state: llama.cpp's own format would load it silently
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "header":
        data[len(MAGIC) + 6] ^= 0xFF
    elif damage == "foreign":
        data = bytearray(b"GGUF" + bytes(200))
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    model.clear()
    with caplog.at_level(logging.WARNING, logger="localspec.llama.prompt_cache"):
        out, g = run(model, prompt, cache)
    assert g.restored == 0 and out == first
    assert any("removing" in r.getMessage() for r in caplog.records)
    assert len(files(tmp_path)) == 1 and files(tmp_path)[0].read_bytes()[: len(MAGIC)] == MAGIC  # saved anew


def test_negative_control_an_intact_file_is_used(model: Model, tmp_path: Path) -> None:
    """The damage test's control: the same steps on an untouched file restore the prefix."""
    cache = PromptCache(tmp_path)
    prompt = tokens_of(model, DOC)
    run(model, prompt, cache)
    model.clear()
    _, g = run(model, prompt, cache)
    assert g.restored == len(prompt) - 1


def test_files_are_private(model: Model, tmp_path: Path) -> None:
    run(model, tokens_of(model, DOC), PromptCache(tmp_path / "c"))
    path = files(tmp_path)[0]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "c").stat().st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_read_only_directory_turns_the_cache_off(model: Model, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tmp_path.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING):
            out, g = run(model, tokens_of(model, DOC), PromptCache(tmp_path / "c"))
        assert out and "prompt cache: off" in caplog.text
    finally:
        tmp_path.chmod(0o700)


def test_unwritable_directory_turns_the_cache_off(model: Model, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = PromptCache(blocker / "cache")  # cannot be created, as root too
    with caplog.at_level(logging.WARNING):
        out, _ = run(model, tokens_of(model, DOC), cache)
        run(model, tokens_of(model, DOC + "more"), cache)
    assert out and cache.disabled and caplog.text.count("prompt cache: off") == 1


def test_eviction_keeps_the_limit(model: Model, tmp_path: Path) -> None:
    cache = PromptCache(tmp_path)
    prompts = [tokens_of(model, f"# file {i}\n" + DOC) for i in range(3)]
    run(model, prompts[0], cache)
    one = files(tmp_path)[0].stat().st_size
    cache.limit = int(2.5 * one)
    for p in prompts[1:]:
        model.clear()
        run(model, p, cache)
    kept = cache.entries()
    assert len(kept) == 2 and sum(e.size for e in kept) <= cache.limit
    assert {e.tokens[:4] for e in kept} == {tuple(p[:4]) for p in prompts[1:]}  # the oldest went
    assert cache.clear() == 2 and not files(tmp_path)


def test_short_prompts_are_not_saved(model: Model, tmp_path: Path) -> None:
    run(model, tokens_of(model, "def f(): pass"), PromptCache(tmp_path))
    assert not files(tmp_path)


def test_two_processes_writing_at_once(tiny_paths: tuple[Path, Path], tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from localspec.api import generate\n"
        "from localspec.decoding.profiles import Profiles\n"
        "from conftest import load\n"
        "with load(sys.argv[1]) as m:\n"
        "    for i in range(4):\n"
        "        generate(m, None, m.tokenize(f'# {i}\\n' + sys.argv[3]), max_tokens=2, temperature=0,\n"
        "                 profiles=Profiles.in_memory(), prompt_cache=sys.argv[2])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tiny_paths[0]), str(tmp_path), DOC], env=env)
             for _ in range(2)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    cache = PromptCache(tmp_path)
    entries = cache.entries()
    assert len(entries) == 4 and all(cache.load(e) is not None for e in entries)  # whole files only
    assert not list(tmp_path.rglob(".tmp-*"))


def test_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert PromptCache.from_setting("off") is None
    assert PromptCache.from_setting(str(tmp_path)).root == tmp_path
    monkeypatch.setenv("LOCALSPEC_PROMPT_CACHE", str(tmp_path / "env"))
    assert PromptCache.from_setting(None).root == tmp_path / "env"
    assert PromptCache.from_setting(None, "1G").limit == 1 << 30
    assert parse_limit("512M") == 512 << 20 and parse_limit("100") == 100
    with pytest.raises(ConfigError, match="LOCALSPEC_PROMPT_CACHE_LIMIT='lots' is not a size"):
        parse_limit("lots")


def test_api_keyword(model: Model, tmp_path: Path) -> None:
    prompt = tokens_of(model, DOC)
    list(stream_generate(model, None, prompt, prompt_cache=str(tmp_path), max_tokens=2, temperature=0,
                         profiles=Profiles.in_memory()))
    assert files(tmp_path)
    with pytest.raises(ConfigError, match="prompt_cache"):
        list(stream_generate(model, None, prompt, prompt_cache=3, max_tokens=2))


def test_cli_reports_cached_tokens_and_lists_the_cache(tiny_paths: tuple[Path, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from localspec.cli import cli

    base = ["-m", str(tiny_paths[0]), "-d", "none", "--threads", "1", "--prompt-cache", str(tmp_path), "--raw",
            "-t", "0", "-n", "4", "--json"]
    outs = []
    for question in QUESTIONS:
        r = CliRunner().invoke(cli, [*base, DOC + question])
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.stdout))
    assert outs[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32  # the shared document
    assert outs[1]["timings"]["prompt_cache_restore"] > 0 and outs[0]["timings"]["prompt_cache_save"] > 0
    listed = CliRunner().invoke(cli, ["cache", "list", "--prompt-cache", str(tmp_path), "--json"])
    assert listed.exit_code == 0 and len(json.loads(listed.stdout)["entries"]) == 1  # the question is not saved again
    cleared = CliRunner().invoke(cli, ["cache", "clear", "--prompt-cache", str(tmp_path)])
    assert cleared.exit_code == 0 and "removed 1" in cleared.stdout and not files(tmp_path)
    off = CliRunner().invoke(cli, [*base[:-1], "--prompt-cache", "off", "--json", DOC])
    assert off.exit_code == 0 and not files(tmp_path)


def test_context_file_goes_first_so_questions_share_it(tiny_paths: tuple[Path, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from localspec.cli import cli

    doc = tmp_path / "doc.py"
    doc.write_text(DOC)
    base = ["-m", str(tiny_paths[0]), "-d", "none", "--threads", "1", "--prompt-cache", str(tmp_path / "c"),
            "-t", "0", "-n", "4", "--json", "--context", str(doc)]
    cached = []
    for question in QUESTIONS:
        r = CliRunner().invoke(cli, [*base, question])
        assert r.exit_code == 0, r.output
        cached.append(json.loads(r.stdout)["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and cached[1] >= 32
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\xff\xfe")
    for path in (str(bad), str(tmp_path / "missing.txt")):
        r = CliRunner().invoke(cli, [*base[:-2], "--context", path, "q"])
        assert r.exit_code == 2 and "--context" in r.output and "Traceback" not in r.output


def test_chat_save_and_resume(tiny_paths: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/save NAME keeps the messages and the KV state; --resume NAME answers the next message with
    the history restored from the prompt cache, not read again."""
    from click.testing import CliRunner

    from localspec.cli import cli

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "root"))
    base = ["chat", "-m", str(tiny_paths[0]), "-d", "none", "--threads", "1", "--prompt-cache", str(tmp_path / "c"),
            "-t", "0", "-n", "8"]
    first = CliRunner().invoke(cli, base, input=DOC.replace("\n", " ") + "\n/save my-chat\n")
    assert first.exit_code == 0, first.output
    assert "saved chat my-chat (2 messages)" in first.stderr and "in the prompt cache" in first.stderr
    saved = json.loads((tmp_path / "root" / "chats" / "my-chat.json").read_text())
    assert [m["role"] for m in saved["history"]] == ["user", "assistant"]
    resumed = CliRunner().invoke(cli, [*base, "--resume", "my-chat"], input="and then?\n/stats\n")
    assert resumed.exit_code == 0, resumed.output
    assert "resumed my-chat: 2 messages" in resumed.stderr
    cached = re.search(r"prompt (\d+) tokens, (\d+) of them cached", resumed.stderr)
    assert cached and int(cached.group(2)) >= 32, resumed.stderr  # the history came from the saved state
    fresh = CliRunner().invoke(cli, [*base, "--prompt-cache", "off", "--resume", "my-chat"], input="and then?\n/stats\n")
    assert fresh.exit_code == 0 and "of them cached" not in fresh.stderr  # negative control: read again
    for bad, why in (("nope", "no saved chat 'nope'"), ("../x", "is not a chat name")):
        r = CliRunner().invoke(cli, [*base, "--resume", bad], input="")
        assert r.exit_code == 2 and why in r.output and "--resume" in r.output and "Traceback" not in r.output


def test_server_conversations_in_turn_restore_from_memory(model: Model, tmp_path: Path) -> None:
    """Two conversations served in turn: each keeps its prefix (from the in-memory states, the
    disk entries gone), reported as OpenAI's cached_tokens; another API key's server shares nothing."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from localspec.server import ServerLimits
    from localspec.server.app import create_app
    from localspec.server.jobs import Pair

    def ask(client: TestClient, doc: str, key: str | None = None) -> int:
        r = client.post("/v1/completions", json={"prompt": doc + QUESTIONS[0], "max_tokens": 2, "temperature": 0},
                        headers={"Authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    a, b = "# a\n" + DOC, "# b\n" + DOC.replace("add", "mul")
    cache = PromptCache(tmp_path, memory=64 << 20)
    with TestClient(create_app(Pair.adopting(model, None, "tiny", prompt_cache=cache), model_id="tiny")) as client:
        assert ask(client, a) == 0 and ask(client, b) < 32  # b shares only a few tokens with a
        cache.clear()  # the disk entries are gone: what follows comes from memory
        assert ask(client, a) >= 32 and ask(client, b) >= 32
    keyed = PromptCache(tmp_path, memory=0, namespace="sekret")
    with TestClient(create_app(Pair.adopting(model, None, "tiny", prompt_cache=keyed), model_id="tiny",
                               limits=ServerLimits(api_key="sekret"))) as client:
        model.clear()
        assert ask(client, a, "sekret") == 0  # the keyless server's entries are not this key's
        model.clear()
        assert ask(client, a, "sekret") >= 32  # its own are


def test_the_draft_models_state_is_cached_too(tiny_paths: tuple[Path, Path], tmp_path: Path) -> None:
    cache = PromptCache(tmp_path)
    settings = GenerationConfig.from_options(temperature=0.0, max_tokens=8, drafter="model", plan="fixed",
                                             num_draft_tokens=3)
    with load(tiny_paths[0]) as target, load(tiny_paths[1]) as draft:
        prompt = tokens_of(target, DOC + QUESTIONS[0])
        first = [r.token for r in Generation(target, draft, prompt, settings, Profiles.in_memory(), cache)]
        assert len({p.parent for p in files(tmp_path)}) == 2  # the target's entry and the draft's
        target.clear()
        draft.clear()
        generation = Generation(target, draft, prompt, settings, Profiles.in_memory(), cache)
        again = [r.token for r in generation]
        assert draft.sequences[generation.slot].tokens[: len(prompt) - 1] == prompt[:-1] and again == first
        draft.clear()
        assert cache.restore(draft, prompt) == len(prompt) - 1  # the whole prompt, from the draft's entry


def test_a_state_llama_cpp_cannot_write_turns_the_cache_off(model: Model, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    from localspec.errors import ModelError

    def broken(seq: int = 0) -> bytes:
        raise ModelError("llama.cpp wrote 0 of 10 bytes")

    monkeypatch.setattr(model, "seq_state", broken)
    cache = PromptCache(tmp_path)
    with caplog.at_level(logging.WARNING):
        out, _ = run(model, tokens_of(model, DOC), cache)
    assert out and cache.disabled and "prompt cache: off" in caplog.text and not files(tmp_path)


def test_files_being_written_and_odd_files_are_left_alone(model: Model, tmp_path: Path) -> None:
    """Another process's file in progress is not read (nor removed); a FIFO named like an entry
    does not block the lookup and is never removed (the cache did not write it); clear removes
    leftovers of a crashed write."""
    cache = PromptCache(tmp_path)
    prompt = tokens_of(model, DOC)
    run(model, prompt, cache)
    directory = files(tmp_path)[0].parent
    partial = directory / ".tmp-abc.part"
    partial.write_bytes(MAGIC + b"\x00")
    os.mkfifo(directory / "fifo.kv")
    model.clear()
    _, g = run(model, prompt, cache)
    assert g.restored == len(prompt) - 1 and partial.exists()
    assert cache.clear() == 1 and not partial.exists()  # the entry and the leftover
    assert [p.name for p in files(tmp_path)] == ["fifo.kv"] and stat.S_ISFIFO((directory / "fifo.kv").lstat().st_mode)
