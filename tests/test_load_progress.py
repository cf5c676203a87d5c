"""Load progress and cancel (localspec.llama.progress): `load_model(progress=)`, `load_pair` and
`default_pair(progress=)` report one fraction rising from 0 to 1 over the downloads and the loads;
a callback that returns False stops the load and frees what it took (RSS measured on a 195 MiB
model written here); one that raises gives a CallbackError; the command line draws the first
load's bar on a terminal only. Each property has its negative control: a broken version the test
catches."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import http.server
import io
import os
import pty
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest

from localspec import default_pair, load_model
from localspec.cli import render
from localspec.errors import CallbackError, Cancelled, exit_code
from localspec.llama import progress, registry
from localspec.llama.model import Model
from localspec.llama.registry import ModelSpec, Part
from localspec.loading import load_pair
from localspec.settings.models import ModelOptions, PairOptions

from test_kernels import crash_checks_of, fresh_checks, q4_0  # noqa: F401 - fixtures
from test_kernels import buffer_types, kernels
from test_registry import leftovers, make_wheel

SMALL = dict(ctx_size=256, batch_size=64)


def rising_to_one(fractions: Sequence[float]) -> str | None:
    """Why `fractions` are not one load's progress (None: they are): they start at 0, never fall,
    stay within [0, 1] and end at 1."""
    if not fractions:
        return "no fraction was reported"
    if fractions[0] != 0.0:
        return f"the first fraction is {fractions[0]}, not 0"
    fell = [(a, b) for a, b in zip(fractions, fractions[1:]) if b < a]
    if fell:
        return f"the fraction fell: {fell[0][0]} then {fell[0][1]}"
    if fractions[-1] > 1.0:
        return f"a fraction outside [0, 1]: {fractions[-1]}"
    if fractions[-1] != 1.0:
        return f"the last fraction is {fractions[-1]}, not 1"
    return None


def test_the_check_of_fractions_catches_what_it_guards() -> None:
    """Negative controls of rising_to_one itself: each broken sequence is caught, a good one passes."""
    assert rising_to_one([0.0, 0.3, 0.95, 1.0]) is None
    assert "fell" in (rising_to_one([0.0, 0.5, 0.4, 1.0]) or "")
    assert "first" in (rising_to_one([0.2, 1.0]) or "")
    assert "last" in (rising_to_one([0.0, 0.5]) or "")
    assert "outside" in (rising_to_one([0.0, 0.5, 1.5]) or "")
    assert rising_to_one([]) is not None


# ---------------------------------------------------------------- fractions


def test_load_model_reports_from_0_to_1(tiny_paths: tuple[Path, Path]) -> None:
    """llama.cpp's own fractions (one per tensor) reach the callback, through the weights' share,
    then the context's; the model loads."""
    seen: list[float] = []
    with load_model(tiny_paths[0], progress=seen.append, **SMALL) as model:
        assert model.n_vocab > 0
    assert rising_to_one(seen) is None, seen
    weights = [f for f in seen if 0.0 < f < progress.WEIGHTS_SHARE]
    assert len(weights) >= 10, seen  # the tensors' own fractions: llama.cpp's progress_callback was used
    assert progress.WEIGHTS_SHARE in seen  # the weights done, then the context


def test_a_pair_reports_one_fraction_over_both_loads(tiny_paths: tuple[Path, Path]) -> None:
    """One callback for a target and its draft: 0 → 1 once, the target's part before the draft's,
    each in proportion to its file's bytes."""
    target, draft = tiny_paths
    seen: list[float] = []
    options = PairOptions.from_flags(SMALL)
    loaded = load_pair(str(target), str(draft), options, progress=seen.append)
    try:
        assert loaded.draft is not None and loaded.draft.n_vocab == loaded.target.n_vocab
    finally:
        loaded.close()
    assert rising_to_one(seen) is None, seen
    boundary = target.stat().st_size / (target.stat().st_size + draft.stat().st_size)
    assert boundary in seen or any(abs(f - boundary) < 1e-9 for f in seen)  # the target's load ended there
    assert len([f for f in seen if boundary < f < 1.0]) >= 10  # the draft's tensors, after it


def test_a_second_load_after_a_failed_kernel_check_keeps_rising(q4_0: Path, fresh_checks: Path,  # noqa: F811
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """When the first CPU kernel configuration fails its check (its child made to die), the weights
    are loaded again: the second load continues upwards from where the first ended (its own
    fractions shown in a share of what is left), never back to 0. Negative controls: a second load
    mapped onto the first one's range shows nothing of itself; without the clamp, it falls."""
    first = kernels.candidates(buffer_types.read_weights(q4_0))[0][0]
    crash_checks_of(monkeypatch, first)
    first_end = progress.WEIGHTS_SHARE
    second_end = first_end + (1 - first_end) * progress.WEIGHTS_SHARE

    def load() -> list[float]:
        kernel_checks = kernels.kernel_verdicts.Checks().path
        kernel_checks.unlink(missing_ok=True)  # checked again: the first configuration fails once more
        seen: list[float] = []
        with Model(q4_0, ModelOptions(**SMALL), progress=seen.append) as m:
            assert m.kernels is not None and m.kernels.config != first  # it was loaded a second time
        return seen

    seen = load()
    assert rising_to_one(seen) is None, seen
    assert len([f for f in seen if first_end < f < second_end]) >= 5, seen  # the second load, shown

    with monkeypatch.context() as broken:  # the second load takes the first one's range
        broken.setattr(progress.Span, "part", lambda self, share: progress.Span(
            self.progress, self.start, self.start + (self.end - self.start) * share))
        naive = load()
    assert not [f for f in naive if first_end < f < second_end]

    def unclamped(self: progress.Progress, fraction: float) -> bool:
        self.fraction = fraction
        return self._callback(fraction) is not False

    with monkeypatch.context() as broken:  # and reported as llama.cpp gives it: it falls
        broken.setattr(progress.Span, "part", lambda self, share: progress.Span(
            self.progress, self.start, self.start + (self.end - self.start) * share))
        broken.setattr(progress.Progress, "report", unclamped)
        assert "fell" in (rising_to_one(load()) or "")


# ---------------------------------------------------------------- stops


@pytest.mark.parametrize("stop_at", [0.0, 0.5, 1.0], ids=["at-once", "half-way", "after-the-context"])
def test_a_callback_that_returns_false_cancels_the_load(tiny_paths: tuple[Path, Path], stop_at: float) -> None:
    """False at the first fraction, half-way through the weights, or at the end (the context made):
    Cancelled naming the file, no fraction after the stop, the exit status of a Ctrl-C; the file
    loads again afterwards. Negative control: a callback returning None (falsy, not False) goes on."""
    seen: list[float] = []

    def stop(fraction: float) -> bool:
        seen.append(fraction)
        return fraction < stop_at

    with pytest.raises(Cancelled, match=f"the load of {tiny_paths[0].name} was cancelled") as info:
        load_model(tiny_paths[0], progress=stop, **SMALL)
    assert exit_code(info.value) == 130
    assert seen and seen[-1] >= stop_at and all(f < stop_at for f in seen[:-1])  # nothing after the stop
    with load_model(tiny_paths[0], progress=lambda f: None, **SMALL) as model:  # None is no stop
        assert model.n_vocab > 0


def test_a_callback_that_raises_gives_a_clear_error(tiny_paths: tuple[Path, Path]) -> None:
    """The exception stops the load inside llama.cpp (it cannot cross its C frames) and comes
    back as a CallbackError naming it, chained; a KeyboardInterrupt comes back as itself.
    Negative control: a plain ctypes callback that raises loses the exception (llama.cpp returns
    no model, the error only reaches sys.unraisablehook): the trampoline is what keeps it."""
    def boom(fraction: float) -> None:
        if fraction > 0.3:
            raise ValueError("boom")

    with pytest.raises(CallbackError, match="progress callback raised ValueError: boom") as info:
        load_model(tiny_paths[0], progress=boom, **SMALL)
    assert isinstance(info.value.__cause__, ValueError)

    def interrupt(fraction: float) -> None:
        if fraction > 0.3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        load_model(tiny_paths[0], progress=interrupt, **SMALL)

    import llama_cpp as lc

    lost: list[BaseException | None] = []
    params = lc.llama_model_default_params()
    raw = lc.llama_progress_callback(lambda fraction, data: boom(fraction) or True)
    params.progress_callback = raw
    hook, sys.unraisablehook = sys.unraisablehook, lambda u: lost.append(u.exc_value)
    try:
        model = lc.llama_model_load_from_file(os.fsencode(tiny_paths[0]), params)
    finally:
        sys.unraisablehook = hook
    assert not model and isinstance(lost[0], ValueError)  # no model, and no error for its caller


def test_a_bad_progress_is_a_config_error(tiny_paths: tuple[Path, Path]) -> None:
    from localspec.errors import ConfigError

    with pytest.raises(ConfigError, match="progress must be a callable") as info:
        load_model(tiny_paths[0], progress=0.5, **SMALL)
    assert info.value.param == "progress"


# ---------------------------------------------------------------- memory


PAGE = os.sysconf("SC_PAGE_SIZE")
RSS_BOUND = 50 * 2**20  # a cancelled load gives its memory back to within 50 MB (the target)
BIG = dict(n_layer=3, n_embd=1024, n_head=8, n_head_kv=8, n_ff=4096)  # 195 MiB of F32 weights


def rss() -> int:
    """This process's resident memory, bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 195 MiB random llama GGUF, written in a child process (its arrays never in this one's memory)."""
    path = tmp_path_factory.mktemp("big") / "big.gguf"
    code = ("import sys; from localspec.llama.tiny_pairs import write_tiny_model; "
            f"write_tiny_model(sys.argv[1], **{BIG!r})")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=300)
    assert path.stat().st_size > 190 * 2**20
    return path


def cancelled_loads(path: Path, options: ModelOptions, stop_at: float, times: int = 3) -> tuple[int, int]:
    """Load `path` `times` times, each stopped at `stop_at`; (the most RSS grew during a load, the
    most it stayed above the baseline after one), bytes. The baseline follows a full load and
    close, so llama.cpp's one-time set-up is in it."""
    Model(path, options).close()
    gc.collect()
    base = rss()
    peak = after = 0

    def stop(fraction: float) -> bool:
        nonlocal peak
        peak = max(peak, rss() - base)
        return fraction < stop_at

    for _ in range(times):
        with pytest.raises(Cancelled):
            Model(path, options, progress=stop)
        gc.collect()
        after = max(after, rss() - base)
    return peak, after


@pytest.mark.parametrize("load_mode", ["read", "mmap"])
@pytest.mark.parametrize("stop_at", [0.5, 1.0], ids=["half-way", "after-the-context"])
def test_a_cancelled_load_gives_its_memory_back(big_model: Path, load_mode: str, stop_at: float) -> None:
    """Stopped half-way through the weights (llama.cpp frees them) or once the context is made
    (localspec frees the model, the context and the batch), three times over: RSS ends within
    50 MB of where it was, after it grew by at least 90 MB during each load (so the test can tell;
    measured on the host: +115 to +203 MB during, +0 to +8 MB after)."""
    peak, after = cancelled_loads(big_model, ModelOptions(load_mode=load_mode, **SMALL), stop_at)
    assert peak > 90 * 2**20, f"the load took only {peak >> 20} MB: too small to tell"
    assert after < RSS_BOUND, f"{after >> 20} MB stayed after a cancelled load"


def test_the_memory_check_catches_a_load_that_is_not_freed(big_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative controls: a model kept (a load that frees nothing), and a stop after the context
    whose clean-up frees nothing (Model.close made to keep everything), both stay far above the
    bound."""
    options = ModelOptions(**SMALL)
    Model(big_model, options).close()
    gc.collect()
    base = rss()
    kept = Model(big_model, options)
    try:
        assert rss() - base > RSS_BOUND
    finally:
        kept.close()

    held: list[Model] = []
    monkeypatch.setattr(Model, "close", lambda self: held.append(self))
    try:
        peak, after = cancelled_loads(big_model, options, 1.0, times=1)
        assert after > RSS_BOUND, f"only {after >> 20} MB stayed with nothing freed"
    finally:
        monkeypatch.undo()
        for model in held:
            model.close()


# ---------------------------------------------------------------- fetching


class SlowFiles(http.server.SimpleHTTPRequestHandler):
    """Files of a directory, sent in 64 KiB pieces 20 ms apart (3 MB/s: pip, which writes what
    it receives 256 KiB at a time, takes a while over a file of a few MB)."""

    def copyfile(self, source: Any, outputfile: Any) -> None:
        while piece := source.read(65536):
            outputfile.write(piece)
            outputfile.flush()
            time.sleep(0.02)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def slow_index(directory: Path) -> Iterator[str]:
    """An index of wheels for pip (--find-links URL) on 127.0.0.1, until the block ends."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SlowFiles, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_default_pair(quantized_paths: dict[str, tuple[Path, Path]], tiny_paths: tuple[Path, Path], tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ModelSpec, ModelSpec]]:
    """A registry whose default pair is a 5.6 MB tiny target (256 dimensions, F32) and a 0.5 MB
    tiny draft of the same vocabulary, one wheel each, served slowly to pip from 127.0.0.1 into an
    empty cache."""
    import hashlib

    index = tmp_path / "index"
    index.mkdir()
    specs = []
    for role, path in zip(("target", "draft"), (quantized_paths["f32"][0], tiny_paths[1])):
        data = path.read_bytes()
        member = f"lsfake_{role}/data/model.gguf"
        make_wheel(index, f"lsfake-{role}", "1.0", member, data)
        specs.append(ModelSpec(f"fake-{role}", role, f"fake-{role}.gguf", len(data), hashlib.sha256(data).hexdigest(),
                               (Part(f"lsfake-{role}", "1.0", member),)))
    fake = registry.Registry({s.name: s for s in specs},
                             {"fake": registry.PairSpec("fake", specs[0].name, specs[1].name, True)}, "fake")
    monkeypatch.setattr(registry, "load_registry", lambda: fake)
    monkeypatch.setenv("LOCALSPEC_CACHE_DIR", str(tmp_path / "cache"))
    with slow_index(index) as url:
        monkeypatch.setenv("LOCALSPEC_PIP_ARGS", f"--no-index --no-cache-dir --find-links {url}")
        yield specs[0], specs[1]


def test_default_pair_reports_the_downloads_and_both_loads(fake_default_pair: tuple[ModelSpec, ModelSpec],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Neither file cached: the downloads come first (the bytes pip has received, seen while each
    one arrives), then both loads, one fraction 0 → 1 over all of it, each part by its bytes.
    Negative control: a fetch that does not watch pip's bytes shows only each part's end."""
    target, draft = fake_default_pair
    total = 2 * (target.size + draft.size)  # downloaded once, loaded once
    target_fetched = target.size / total

    def run() -> list[float]:
        for spec in (target, draft):
            (registry.cache_dir() / spec.filename).unlink(missing_ok=True)
        seen: list[float] = []
        t, d = default_pair(progress=seen.append, cpu_kernels="plain", **SMALL)
        t.close()
        d.close()
        return seen

    seen = run()
    assert rising_to_one(seen) is None, seen
    assert "fake-target" not in capsys.readouterr().err  # the caller's callback, instead of the bar on stderr
    assert len([f for f in seen if 0.0 < f < target_fetched - 1e-9]) >= 5, seen  # bytes arriving
    assert any(abs(f - 0.5) < 1e-9 for f in seen)  # the downloads end half-way (as many bytes as loaded)

    monkeypatch.setattr(registry, "_tree_bytes", lambda directory: 0)
    blind = run()
    assert not [f for f in blind if 0.0 < f < target_fetched - 1e-9], blind


def test_a_download_stopped_midway_leaves_nothing(fake_default_pair: tuple[ModelSpec, ModelSpec]) -> None:
    """A stop while pip is receiving the first file: pip is killed, Cancelled names the fetch, and
    the cache holds nothing of it (no partial file, no pip download directory)."""
    target, _ = fake_default_pair
    seen: list[float] = []

    def stop(fraction: float) -> bool:
        seen.append(fraction)
        return fraction == 0.0

    started = time.monotonic()
    with pytest.raises(Cancelled, match=f"fetching {target.name} was cancelled"):
        default_pair(progress=stop, **SMALL)
    assert time.monotonic() - started < 10  # not after both downloads and loads
    assert 0.0 < seen[-1] < target.size / (2 * (target.size + fake_default_pair[1].size)) and len(seen) == 2
    assert not (registry.cache_dir() / target.filename).exists()
    assert leftovers(registry.cache_dir(), target) == []


# ---------------------------------------------------------------- the command line's bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_is_drawn_on_a_terminal_only(tiny_paths: tuple[Path, Path]) -> None:
    """On a terminal a load in the block draws its bar (the file's name, up to 100 %) and clears
    it; elsewhere (negative control) nothing is written and no load is watched."""
    terminal = Terminal()
    with render.load_bars(terminal):
        Model(tiny_paths[0], ModelOptions(**SMALL)).close()
    drawn = terminal.getvalue()
    assert f"loading {tiny_paths[0].name}" in drawn and "100%" in drawn, drawn
    assert progress.watched("x") is None  # the watcher went with the block

    plain = io.StringIO()
    with render.load_bars(plain):
        assert progress.watched("x") is None
        Model(tiny_paths[0], ModelOptions(**SMALL)).close()
    assert plain.getvalue() == ""

    terminal = Terminal()
    with render.load_bars(terminal) as bars:
        bars.stop()  # output began: later loads (a lazy draft) draw nothing
        Model(tiny_paths[0], ModelOptions(**SMALL)).close()
    assert "loading" not in terminal.getvalue()


def _stderr_on_a_terminal(argv: list[str]) -> tuple[str, str]:
    """(stdout, what the terminal showed) of `argv` run with stderr on a pseudo-terminal."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
    finally:
        os.close(slave)
    shown = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        assert ready, "no output for 60 s"
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, shown
    return out.decode(), shown.decode(errors="replace")


def test_the_command_line_shows_its_load_on_a_terminal(tiny_paths: tuple[Path, Path]) -> None:
    """`localspec` loading in its own process: with stderr on a terminal the load's bar shows
    there; with stderr a pipe (negative control) it does not; the text is the same."""
    argv = [sys.executable, "-m", "localspec", "-m", str(tiny_paths[0]), "-d", "none", "--raw", "-t", "0",
            "-n", "4", "--ctx-size", "256", "hi"]
    out, shown = _stderr_on_a_terminal(argv)
    assert f"loading {tiny_paths[0].name}" in shown and "100%" in shown, shown
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert piped.returncode == 0 and "loading" not in piped.stderr, piped.stderr
    assert piped.stdout == out
