"""Files (localspec.settings.files and its users): localspec reads, touches and deletes only files it wrote,
never through a symbolic link, never changes the mode of a directory it did not create, refuses
a directory of another user, and reads every file the user names with a bound (a device, a FIFO,
an endless pipe end with a one-line error naming the option). Each class has its negative
control: the same steps on a file of localspec's own do read, touch or delete it."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from click.testing import CliRunner

from localspec.settings import files
from localspec.cli import cli
from localspec.errors import ConfigError
from localspec.settings.files import Foreign, StateDir
from localspec.llama.prompt_cache import PromptCache
from localspec.llama.prompt_store import SUFFIX, model_key

OTHER_UID = 12345  # another user (the tests run as root, which may chown)
OLD = 1_000_000_000  # an mtime long past: a file that is touched shows it
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user")


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """`call()` in a thread that must end within `seconds` (a hang fails the test, not the suite)."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def outside_file(tmp_path: Path, content: bytes = b"not localspec's") -> Path:
    path = tmp_path / "outside" / "file"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
    os.utime(path, (OLD, OLD))
    return path


def untouched(path: Path, content: bytes) -> bool:
    st = path.lstat()
    return stat.S_ISREG(st.st_mode) and path.read_bytes() == content and st.st_mtime == OLD


# ---------------------------------------------------------------- files the user names


def test_a_device_is_read_up_to_the_limit_only() -> None:
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"the grammar file /dev/zero: larger than 4 MiB") as info:
        files.read_user_file("/dev/zero", param="grammar", limit=files.SPEC_LIMIT, what="the grammar file")
    assert info.value.param == "grammar" and time.perf_counter() - t0 < 5


def test_the_limit_is_exact(tmp_path: Path) -> None:
    """Negative control of the bound: a file of exactly `limit` bytes is read whole, one more byte is refused."""
    path = tmp_path / "f"
    path.write_bytes(b"a" * 1000)
    assert files.read_user_file(path, param="context", limit=1000) == b"a" * 1000
    with pytest.raises(ConfigError, match="larger than"):
        files.read_user_file(path, param="context", limit=999)


def test_a_fifo_without_a_writer_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert within(10, lambda: files.read_user_file(fifo, param="context", limit=100)) == b""


def test_an_endless_fifo_ends_at_the_limit(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def writer() -> None:
        with open(fifo, "wb") as f, open("/dev/zero", "rb") as zero:
            try:
                while True:
                    f.write(zero.read(1 << 16))
            except BrokenPipeError:
                pass  # the reader stopped: as it must

    threading.Thread(target=writer, daemon=True).start()
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        within(20, lambda: files.read_user_file(fifo, param="context", limit=1 << 20))


def test_missing_directory_and_bad_text_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "bin").write_bytes(b"ok \xff")
    cases = {tmp_path / "nope": "not found", tmp_path: "is a directory", tmp_path / "bin": "not UTF-8 text (byte 0xff"}
    for path, needle in cases.items():
        with pytest.raises(ConfigError, match=re.escape(needle)) as info:
            files.read_user_text(path, param="tools", limit=100)
        assert info.value.param == "tools" and "\n" not in str(info.value)


def test_piped_input_is_bounded() -> None:
    import io

    with pytest.raises(ConfigError, match="the prompt on stdin is larger than 1 MiB"):
        files.read_stream(io.BytesIO(b"x" * ((1 << 20) + 1)), limit=1 << 20, what="the prompt on stdin")
    assert files.read_stream(io.BytesIO(b"x" * (1 << 20)), limit=1 << 20, what="stdin") == b"x" * (1 << 20)


@pytest.mark.parametrize("flag,limit", [("--grammar", "4 MiB"), ("--json-schema", "4 MiB"), ("--tools", "4 MiB"),
                                        ("--context", "32 MiB")])
def test_dev_zero_as_an_option_is_a_usage_error(flag: str, limit: str, tmp_path: Path) -> None:
    t0 = time.perf_counter()
    r = CliRunner().invoke(cli, ["-m", str(tmp_path / "none.gguf"), "--raw", flag, "/dev/zero", "hi"])
    assert r.exit_code == 2, r.output
    assert f"Invalid value for {flag}" in r.output and f"/dev/zero: larger than {limit}" in r.output, r.output
    assert "Traceback" not in r.output and time.perf_counter() - t0 < 30


def test_dev_zero_as_a_prompt_file_is_a_usage_error(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["bench", "-m", str(tmp_path / "none.gguf"), "--prompts", "/dev/zero"])
    assert r.exit_code == 2 and "--prompts" in r.output and "larger than 32 MiB" in r.output, r.output


def test_dev_zero_on_stdin_is_a_usage_error(tmp_path: Path) -> None:
    with open("/dev/zero", "rb") as zero:
        out = subprocess.run([sys.executable, "-m", "localspec", "-m", str(tmp_path / "none.gguf"), "--raw"],
                             stdin=zero, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "the prompt on stdin is larger than 32 MiB" in out.stderr and "Traceback" not in out.stderr


def test_dev_zero_on_a_chats_stdin_is_a_usage_error(tiny_paths: tuple[Path, Path]) -> None:
    with open("/dev/zero", "rb") as zero:
        out = subprocess.run([sys.executable, "-m", "localspec", "chat", "-m", str(tiny_paths[0]), "-d", "none",
                              "--threads", "1"], stdin=zero, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "a line on stdin is longer than 32 MiB" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------- directories


def test_private_dir_is_created_0700_and_an_existing_one_kept(tmp_path: Path) -> None:
    made = files.private_dir(tmp_path / "a" / "run", what="the runtime directory")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert files.private_dir(made, what="the runtime directory") == made  # control: ours and private
    with pytest.raises(FileNotFoundError):
        files.private_dir(tmp_path / "absent", what="x", create=False)


@pytest.mark.parametrize("case", ["open", "link", "file", "other user"])
def test_private_dir_refuses_and_changes_nothing(tmp_path: Path, case: str) -> None:
    target = tmp_path / "d"
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    path = target
    if case == "link":
        target.chmod(0o700)
        path = tmp_path / "link"
        path.symlink_to(target)
    elif case == "file":
        path = tmp_path / "f"
        path.write_text("x")
    elif case == "other user":
        if os.geteuid() != 0:
            pytest.skip("needs root")
        target.chmod(0o700)
        os.chown(target, OTHER_UID, OTHER_UID)
    before = target.stat()
    needle = {"open": "is open to other users (mode 0755)", "link": "is a symbolic link", "file": "is not a directory",
              "other user": f"belongs to another user (uid {OTHER_UID}"}[case]
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        files.private_dir(path, what="the runtime directory")
    assert str(info.value).startswith(f"the runtime directory {path} ") and "\n" not in str(info.value)
    after = target.stat()
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)  # never chmod'ed nor chown'ed


def test_state_root_accepts_a_shared_sticky_directory_and_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    files.state_root(shared, what="the cache", shared=True)
    if os.geteuid() == 0:
        os.chown(shared, OTHER_UID, OTHER_UID)  # /tmp belongs to root: sticky, so others' files stay theirs
        files.state_root(shared, what="the cache", shared=True)
        with pytest.raises(ConfigError, match="belongs to another user"):
            files.state_root(shared, what="the cache")  # not shared: refused
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


# ---------------------------------------------------------------- state files


@pytest.fixture()
def state(tmp_path: Path) -> StateDir:
    with StateDir.open(tmp_path / "state", what="the state") as d:
        yield d


def test_state_files_of_our_own_are_read_written_and_removed(state: StateDir) -> None:
    """The negative control of the next test: the same calls on files localspec wrote."""
    state.write("a.json", b"{}")
    path = state.path / "a.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and state.read("a.json") == b"{}"
    state.write("a.json", [b"[", b"]"])
    assert state.read("a.json") == b"[]" and state.names() == ["a.json"]  # no temporary file left
    state.unlink("a.json")
    assert not path.exists()


@pytest.mark.parametrize("kind", ["link", "fifo", "other user", "hard link"])
def test_foreign_names_are_never_read_written_or_removed(state: StateDir, tmp_path: Path, kind: str) -> None:
    content = b'{"outside": true}'
    outside = outside_file(tmp_path, content)
    name = state.path / "a.json"
    if kind == "link":
        name.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(name)
    elif kind == "hard link":
        os.link(outside, name)
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root")
        name.write_bytes(content)
        os.utime(name, (OLD, OLD))
        os.chown(name, OTHER_UID, OTHER_UID)
    if kind == "hard link":  # not read; replacing or removing the name leaves the file its other name holds
        with pytest.raises(Foreign, match="2 hard links"):
            state.read("a.json")
        state.write("a.json", b"mine")
        assert state.read("a.json") == b"mine" and untouched(outside, content)
        state.unlink("a.json")
        assert not os.path.lexists(name) and untouched(outside, content)
        return
    for call in (lambda: state.read("a.json"), lambda: state.write("a.json", b"mine"), lambda: state.unlink("a.json")):
        with pytest.raises(Foreign):
            within(10, call)
    assert os.path.lexists(name) and untouched(outside, content)
    if kind == "other user":
        assert untouched(name, content)
    assert [n for n in state.names() if n.startswith(files.TEMP_PREFIX)] == []


def test_a_child_directory_must_be_ours_and_private(state: StateDir, tmp_path: Path) -> None:
    sub = state.child("sub", create=True)
    assert stat.S_IMODE((state.path / "sub").stat().st_mode) == 0o700
    sub.close()
    outside = tmp_path / "outside-dir"
    outside.mkdir()
    (state.path / "link").symlink_to(outside, target_is_directory=True)
    (state.path / "open").mkdir(mode=0o755)
    (state.path / "open").chmod(0o755)
    for name, needle in (("link", "symbolic link"), ("open", "open to other users")):
        with pytest.raises(Foreign, match=needle):
            state.child(name, create=True)
    assert stat.S_IMODE((state.path / "open").stat().st_mode) == 0o755


# ---------------------------------------------------------------- the prompt cache


class FakeModel:
    """What the prompt cache needs of a model: its state is a function of its tokens."""

    n_ctx = 4096
    state_refusal = None

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.state_options = {"file": "/models/fake.gguf", "cache_type": "f16"}
        self.restored: bytes | None = None

    def seq_state(self) -> bytes:
        return json.dumps(self.tokens).encode() * 10

    def set_seq_state(self, data: bytes) -> bool:
        self.restored = data
        return True


PROMPT = list(range(100, 180))


def saved(root: Path) -> tuple[PromptCache, FakeModel, Path]:
    cache = PromptCache(root)
    model = FakeModel(PROMPT[:-1])
    path = cache.save(model, PROMPT[:-1])
    assert path is not None and path.is_file()
    return cache, model, path


def test_control_an_entry_of_our_own_is_found_touched_and_cleared(tmp_path: Path) -> None:
    cache, model, path = saved(tmp_path / "cache")
    os.utime(path, (OLD, OLD))
    found = cache.best(model, PROMPT)
    assert found is not None and cache.load(found[0]) is not None
    assert path.stat().st_mtime != OLD  # what the link test checks cannot happen to an outside file
    assert cache.clear() == 1 and not path.exists()


def test_a_symlinked_entry_is_never_read_touched_or_deleted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache, model, path = saved(tmp_path / "cache")
    content = path.read_bytes()
    outside = outside_file(tmp_path, content)  # a valid entry, but not in the cache's tree
    path.unlink()
    path.symlink_to(outside)
    with caplog.at_level(logging.WARNING, logger="localspec.llama.prompt_cache"):
        assert cache.best(model, PROMPT) is None and cache.entries() == []
        assert cache.save(model, PROMPT[:-1]) is None  # a link where the entry goes: not replaced
        assert cache.clear() == 0
    assert path.is_symlink() and untouched(outside, content)
    assert "a symbolic link" in caplog.text


def test_a_symlinked_directory_in_the_cache_is_left_alone(tmp_path: Path) -> None:
    """`cache list` (reads only), a plain lookup and save, and `cache clear` never reach into a
    directory the cache's tree links to; in a directory of the cache's own the same files go
    (the negative control)."""
    root = tmp_path / "cache"
    cache, model, path = saved(root)
    outside = tmp_path / "outside-dir"
    outside.mkdir()
    planted = {"junk" + SUFFIX: b"not an entry", "x" + SUFFIX: path.read_bytes(), ".tmp-1.part": b"half"}
    for name, data in planted.items():
        (outside / name).write_bytes(data)
    key = model_key(model.state_options)
    assert path.parent.name == key
    cache.clear()
    (root / key).symlink_to(outside, target_is_directory=True)
    listed = CliRunner().invoke(cli, ["cache", "list", "--prompt-cache", str(root), "--json"])
    assert listed.exit_code == 0 and json.loads(listed.stdout)["entries"] == [], listed.output
    fresh = PromptCache(root)
    assert fresh.best(model, PROMPT) is None and fresh.save(model, PROMPT[:-1]) is None and fresh.disabled
    cleared = CliRunner().invoke(cli, ["cache", "clear", "--prompt-cache", str(root)])
    assert cleared.exit_code == 0 and "removed 0" in cleared.stdout
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == planted and (root / key).is_symlink()
    (root / key).unlink()  # the control: the same files in the cache's own directory
    (root / key).mkdir(mode=0o700)
    for name, data in planted.items():
        (root / key / name).write_bytes(data)
    control = PromptCache(root)
    assert control.best(model, PROMPT) is not None  # the copy of the entry is used, the junk removed
    assert not (root / key / ("junk" + SUFFIX)).exists()
    assert control.clear() == 1 and not (root / key).exists()  # the entry, the leftover, the emptied directory


def test_a_shared_sticky_root_keeps_its_mode(tiny_paths: tuple[Path, Path], tmp_path: Path) -> None:
    """--prompt-cache on a directory like /tmp (1777): a run leaves its mode alone and keeps its
    entries in a private subdirectory."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    doc = "def add(a, b):\n    return a + b\n\n" * 6
    r = CliRunner().invoke(cli, ["-m", str(tiny_paths[0]), "-d", "none", "--threads", "1", "--raw", "-t", "0",
                                 "-n", "2", "--prompt-cache", str(shared), doc])
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    (entry,) = shared.rglob("*" + SUFFIX)
    assert entry.parent.parent == shared and stat.S_IMODE(entry.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600


def test_a_new_root_is_private(tmp_path: Path) -> None:
    """Control: a root the cache creates is 0700 (its own, so its mode is the cache's to set)."""
    saved(tmp_path / "new")
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700


@as_root
def test_a_root_of_another_user_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "theirs"
    root.mkdir(mode=0o755)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"belongs to another user \\(uid {OTHER_UID}") as info:
        PromptCache.from_setting(str(root))
    assert info.value.param == "prompt_cache"
    for args in (["cache", "list"], ["cache", "clear"]):
        r = CliRunner().invoke(cli, [*args, "--prompt-cache", str(root)])
        assert r.exit_code == 2 and "Invalid value for --prompt-cache" in r.output, r.output
    cache = PromptCache(root)  # not named by the user (the default place): off, with a warning
    with caplog.at_level(logging.WARNING):
        assert cache.save(FakeModel(PROMPT[:-1]), PROMPT[:-1]) is None
    assert cache.disabled and "belongs to another user" in caplog.text and list(root.iterdir()) == []
    assert stat.S_IMODE(root.stat().st_mode) == 0o755 and root.stat().st_uid == OTHER_UID
    os.chown(root, os.geteuid(), os.getegid())  # the control: the same directory, the user's own
    assert PromptCache.from_setting(str(root)) is not None and saved(root)[2].is_file()


@as_root
def test_another_users_subdirectory_is_ignored(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)
    key = model_key(FakeModel([]).state_options)
    (root / key).mkdir(mode=0o700)
    os.chown(root / key, OTHER_UID, OTHER_UID)  # someone made the cache's directory first
    cache = PromptCache(root)
    assert cache.save(FakeModel(PROMPT[:-1]), PROMPT[:-1]) is None and cache.disabled
    assert cache.clear() == 0 and (root / key).stat().st_uid == OTHER_UID


# ---------------------------------------------------------------- the chat store


def test_a_symlinked_chat_is_neither_resumed_nor_overwritten(tiny_paths: tuple[Path, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "root"))
    chats = tmp_path / "root" / "chats"
    chats.mkdir(parents=True, mode=0o700)
    content = json.dumps({"version": 1, "history": [{"role": "user", "content": "secret"}]}).encode()
    outside = outside_file(tmp_path, content)
    (chats / "evil.json").symlink_to(outside)
    base = ["chat", "-m", str(tiny_paths[0]), "-d", "none", "--threads", "1", "-t", "0", "-n", "2"]
    r = CliRunner().invoke(cli, [*base, "--resume", "evil"], input="")
    assert r.exit_code == 2 and "--resume" in r.output and "symbolic link" in r.output, r.output
    r = CliRunner().invoke(cli, base, input="hello\n/save evil\n")
    assert r.exit_code == 0 and "could not save the chat" in r.stderr, r.output
    assert (chats / "evil.json").is_symlink() and untouched(outside, content)
    r = CliRunner().invoke(cli, base, input="hello\n/save good\n")  # the control: a name of its own
    assert r.exit_code == 0 and "saved chat good" in r.stderr, r.output
    r = CliRunner().invoke(cli, [*base, "--resume", "good"], input="")
    assert r.exit_code == 0 and "resumed good: 2 messages" in r.stderr, r.output


def test_a_chat_store_open_to_others_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from localspec.cli.chat_store import load_chat

    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path))
    (tmp_path / "chats").mkdir(mode=0o777)
    (tmp_path / "chats").chmod(0o777)
    with pytest.raises(ConfigError, match="open to other users") as info:
        load_chat("any")
    assert info.value.param == "resume" and stat.S_IMODE((tmp_path / "chats").stat().st_mode) == 0o777


# ---------------------------------------------------------------- cost profiles


def test_profiles_reset_removes_only_profiles(tmp_path: Path) -> None:
    from localspec.decoding.profiles import Profiles
    from localspec.llama.host import key_of
    from localspec.settings.locations import PROFILE_ENV

    store = Profiles(tmp_path)
    ident = {"file": "/x/m.gguf", "threads": 1}
    store.get(ident).costs[1] = 0.01
    store.get(ident).dirty = True
    store.save()
    mine = tmp_path / f"{key_of(ident)}.json"
    foreign = {"package.json": b'{"name": "x"}', "0123456789abcdef0123.json": b'{"key": "other", "identity": {}}',
               "notes.json": b"[1, 2]"}
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    linked = mine.read_bytes().replace(key_of(ident).encode(), b"aaaaaaaaaaaaaaaaaaaa")
    outside = outside_file(tmp_path, linked)
    (tmp_path / "aaaaaaaaaaaaaaaaaaaa.json").symlink_to(outside)  # a profile's shape, through a link
    r = CliRunner().invoke(cli, ["profiles", "reset"], env={PROFILE_ENV: str(tmp_path)})
    assert r.exit_code == 0 and "removed 1 profile" in r.stdout, r.output
    assert not mine.exists()  # the control: the profile localspec wrote went
    assert {n: (tmp_path / n).read_bytes() for n in foreign} == foreign
    assert (tmp_path / "aaaaaaaaaaaaaaaaaaaa.json").is_symlink() and untouched(outside, linked)


def test_a_symlinked_profile_is_not_read(tmp_path: Path) -> None:
    from localspec.decoding.profiles import Profiles
    from localspec.llama.host import key_of

    ident = {"file": "/x/m.gguf", "threads": 1}
    store = Profiles(tmp_path / "p")
    store.get(ident).costs[1] = 0.5
    store.get(ident).dirty = True
    store.save()
    path = tmp_path / "p" / f"{key_of(ident)}.json"
    assert Profiles(tmp_path / "p").get(ident).costs == {1: 0.5}  # control: read when it is a file
    content = path.read_bytes()
    outside = outside_file(tmp_path, content)
    path.unlink()
    path.symlink_to(outside)
    again = Profiles(tmp_path / "p")
    assert again.get(ident).costs == {}
    again.get(ident).dirty = True
    again.save()  # the link's name is not replaced, the outside file not written
    assert path.is_symlink() and untouched(outside, content)


@as_root
def test_a_profile_directory_of_another_user_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from localspec.decoding.profiles import Profiles

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    store = Profiles(theirs)
    with caplog.at_level(logging.WARNING):
        store.get({"file": "m"}).dirty = True
        store.save()
    assert list(theirs.iterdir()) == [] and "belongs to another user" in caplog.text


# ---------------------------------------------------------------- kernel check records


def test_a_symlinked_kernel_record_is_not_read_nor_written(tmp_path: Path) -> None:
    from localspec.llama.kernel_verdicts import Checks, KernelVerdict

    checks = Checks(tmp_path / "kc")
    checks.put("llama:Q4_0", KernelVerdict(True, "fine", 0.5))
    assert Checks(tmp_path / "kc").get("llama:Q4_0") == KernelVerdict(True, "fine", 0.5)  # control: a file of its own
    content = checks.path.read_bytes()
    outside = outside_file(tmp_path, content)
    checks.path.unlink()
    checks.path.symlink_to(outside)
    fresh = Checks(tmp_path / "kc")
    assert fresh.get("llama:Q4_0") is None  # not read through the link: checked again
    fresh.put("plain:Q4_0", KernelVerdict(False, "died", 0.1))  # nor written
    assert checks.path.is_symlink() and untouched(outside, content)
