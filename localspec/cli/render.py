"""What a call's events look like to its user: text on stdout as it comes (accepted drafts in
another colour with --show-drafts), notes on stderr, and the stops: Ctrl-C and SIGTERM end a
call in every state, the text generated so far kept (:func:`stopping`).

The same for a call in this process and one in the resident service: the command line prints
the events, wherever they were made.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any

import click

from localspec.errors import EXIT_INTERRUPTED, EXIT_TERMINATED

DRAFTED_COLOUR = "cyan"  # text that came from an accepted draft (--show-drafts, chat's /drafts)
EXIT_SERVICE_LOST = 3  # the service ended before the call did (as a lost RPC server: localspec.errors)
SERVICE_LOST = ("the resident service ended before the call was done (killed, or it crashed); what it generated "
                "is above. The next call starts a new one; --keep-alive 0 runs in this process.")


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, service managers): handled as Ctrl-C is, so the text generated so far
    (with --json, the JSON object) still comes out."""


def exit_status(stop: BaseException | str | None) -> int:
    """130 for Ctrl-C, 143 for SIGTERM (a stop, or its reason)."""
    terminated = isinstance(stop, Terminated) or stop == "terminated"
    return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED


def stop_word(stop: BaseException | str | None) -> str:
    return "terminated" if exit_status(stop) == EXIT_TERMINATED else "interrupted"


def _raise(signum: int, frame: Any) -> None:
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Within the block, Ctrl-C raises KeyboardInterrupt and SIGTERM Terminated in the main
    thread, whatever dispositions the process inherited (a script's background job starts it
    with SIGINT ignored). Elsewhere (a thread): unchanged."""
    with _handling(_raise):
        yield


@contextlib.contextmanager
def _handling(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Within the block, `handler` takes SIGINT and SIGTERM (in the main thread; elsewhere
    signals cannot be handled and nothing changes); the previous handlers after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@contextlib.contextmanager
def stopping(call: Any, output_started: Callable[[], bool], leave: bool = True) -> Iterator[None]:
    """While `call` runs: Ctrl-C or SIGTERM stops it (its cancel). Once it has output, the call
    ends within one step and says so (its Done has `stopped`); before (waiting, loading,
    prefilling) and at a second signal, the signal is raised here, for the command to leave at
    once; unless not `leave` (a chat's reply: the chat goes on after it)."""
    signals = 0

    def handler(signum: int, frame: Any) -> None:
        nonlocal signals
        signals += 1
        call.cancel("terminated" if signum == signal.SIGTERM else "interrupted")
        if leave and (signals > 1 or not output_started()):
            _raise(signum, frame)

    with _handling(handler):
        yield


def write_text(text: str, drafted: bool, colour: bool) -> None:
    """A piece of generated text on stdout, now (a closed pipe ends the command as it would a
    process of its own: the call stops)."""
    click.echo(click.style(text, fg=DRAFTED_COLOUR) if colour and drafted else text, nl=False)
    sys.stdout.flush()


def colours(wanted: bool) -> bool:
    """Whether drafted text is coloured: asked for, and stdout is a terminal."""
    try:
        return wanted and sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def service_lost() -> int:
    click.echo("\nlocalspec: " + SERVICE_LOST, err=True)
    return EXIT_SERVICE_LOST


def stays_loaded(name: str, keep_alive: float) -> None:
    """The first call that loads a pair in the service says how long it stays."""
    from localspec.core.status import display_name
    from localspec.settings.environment import format_duration

    click.echo(f"localspec: {display_name(name)} stays loaded for {format_duration(keep_alive)} after each call, so the "
               "next one starts at once (localspec ps lists it, localspec stop ends it; --keep-alive 0 or "
               "LOCALSPEC_KEEP_ALIVE=0 runs without)", err=True)


class LoadBars:
    """The bars of the models a call loads in this process before its first output, on stderr when
    it is a terminal (the watcher of localspec.llama.progress.watching: a load in the call's worker
    thread draws one). :meth:`stop` clears them for good: output begins, or the command ends (an
    error's message then starts on a clean line)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._bars: list[Any] = []
        self._lock = threading.Lock()
        self._stopped = False

    def __call__(self, name: str) -> Callable[[float], bool] | None:
        from tqdm import tqdm

        with self._lock:
            if self._stopped:
                return None
            bar = tqdm(total=100, desc=f"loading {name}", unit="%", file=self.stream, leave=False,
                       **_screen(self.stream), bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")
            self._bars.append(bar)

        def report(fraction: float) -> bool:
            with self._lock:
                if not bar.disable:
                    bar.update(round(100 * fraction) - bar.n)
                    if fraction >= 1.0:  # shown done, then cleared
                        bar.refresh()
                        bar.close()
            return True

        return report

    def note(self, text: str) -> None:
        """A line on stderr, above the bars being drawn (they are drawn again below it)."""
        with self._lock:
            if any(not bar.disable for bar in self._bars):
                self._bars[0].write(text, file=self.stream)
                return
        click.echo(text, err=True)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for bar in self._bars:
                bar.close()
            self._bars.clear()


def _screen(stream: IO[str]) -> dict[str, int]:
    """The terminal's size for tqdm; 80 × 24 where it says none (a pseudo-terminal whose size nobody
    set reports 0 × 0, in which tqdm draws nothing)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return {"ncols": 80, "nrows": 24}
    return {"ncols": size.columns or 80, "nrows": size.lines or 24}


@contextlib.contextmanager
def load_bars(stream: IO[str] | None = None) -> Iterator[LoadBars]:
    """Within the block, a model this process loads shows its bar (see LoadBars) when `stream`
    (stderr) is a terminal; the bars are cleared when it ends. Without a terminal: nothing."""
    stream = stream or sys.stderr
    bars = LoadBars(stream)
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):
        terminal = False
    if not terminal:
        bars.stop()
        yield bars
        return
    from localspec.llama.progress import watching

    try:
        with watching(bars):
            yield bars
    finally:
        bars.stop()
