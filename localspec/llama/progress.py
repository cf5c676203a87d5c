"""A load's progress: one fraction from 0 to 1 for a caller's callback, over a load made of parts
(fetching files, llama.cpp's load of each model's weights, its context), and the caller's word to
stop.

:class:`Progress` holds what was reported: the fraction only rises (a part that starts again, as
a model whose CPU kernel check failed is loaded a second time, takes a share of what is left
instead of going back), and it ends at 1.0. A :class:`Span` is one part's range of it. A
callback that returns False (not merely a falsy value: a callback that returns nothing goes on)
stops the load; one that raises stops it too, and its exception comes back as a
:class:`~localspec.errors.CallbackError` once the load has freed what it took (an exception cannot
cross llama.cpp's C frames: the ctypes trampoline, :meth:`Span.native`, keeps it).

A leaf below the models (at import, the standard library and ``errors`` only: the command line's
client imports it with the registry): the registry's fetch and ``localspec.llama.model`` report
through it, ``localspec.loading`` makes one per load.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from localspec.errors import CallbackError, Cancelled, ConfigError

Callback = Callable[[float], Any]  # a fraction from 0 to 1; returns False to stop the load
# The weights' share of a model's load; creating its context (KV cache, compute buffers) is the rest.
# Measured on the default pair (AMD EPYC, 2 cores, ctx_size 4096): the context takes 4-6 % of the
# load (0.04-0.09 s against 0.6-2.0 s of weights).
WEIGHTS_SHARE = 0.95


class Progress:
    """The fraction of one load reported so far, and whether its caller said stop."""

    def __init__(self, callback: Callback | None) -> None:
        if callback is not None and not callable(callback):
            raise ConfigError(f"progress must be a callable taking the fraction loaded, got {type(callback).__name__}",
                              "progress")
        self._callback = callback
        self.fraction = 0.0  # the highest fraction reported (or about to be)
        self._reported: float | None = None  # None: nothing yet, so 0.0 is still news
        self.stopped = False
        self.error: BaseException | None = None  # what the callback raised

    def whole(self) -> Span:
        return Span(self, 0.0, 1.0)

    def report(self, fraction: float) -> bool:
        """Tell the callback `fraction` (raised to the highest one so far, cut at 1); False once
        the load is to stop. A fraction no higher than the last reported is not repeated."""
        if self.stopped:
            return False
        fraction = min(max(float(fraction), self.fraction), 1.0)
        if self._reported is not None and fraction <= self._reported:
            return True
        self.fraction = self._reported = fraction
        if self._callback is None:
            return True
        try:
            answer = self._callback(fraction)
        except BaseException as exc:  # noqa: BLE001 - kept, raised once the load has freed what it took
            self.error, self.stopped = exc, True
            return False
        if answer is False:
            self.stopped = True
        return not self.stopped

    def check(self, what: str) -> None:
        """After a stop, its error (stop_error); nothing before."""
        if self.stopped:
            raise self.stop_error(what)

    def stop_error(self, what: str) -> BaseException:
        """What a stop raises: Cancelled (the callback returned False) or CallbackError (it raised,
        chained from its exception; a KeyboardInterrupt or SystemExit as it is). `what`: the load."""
        exc = self.error
        if exc is None:
            return Cancelled(f"{what} was cancelled: the progress callback returned False (nothing of it is kept)")
        if not isinstance(exc, Exception):
            return exc
        error = CallbackError(f"{what} was stopped: the progress callback raised {type(exc).__name__}: {exc} "
                              "(nothing of it is kept)")
        error.__cause__ = exc
        return error


@dataclass(frozen=True)
class Span:
    """One part of a load: its fractions 0..1 are the load's `start`..`end`."""

    progress: Progress
    start: float
    end: float

    def report(self, fraction: float) -> bool:
        """Report this part's `fraction` (see Progress.report)."""
        return self.progress.report(self.start + (self.end - self.start) * min(max(fraction, 0.0), 1.0))

    def part(self, share: float) -> Span:
        """The next part: `share` of what is left of this span from where the load is now (so a
        part that runs again after an earlier try continues upwards)."""
        here = min(max(self.progress.fraction, self.start), self.end)
        return Span(self.progress, here, here + (self.end - here) * share)

    def split(self, weights: Sequence[float]) -> list[Span]:
        """Consecutive parts of this span in proportion to `weights` (e.g. bytes); all zero: equal."""
        total = float(sum(weights))
        shares = [w / total for w in weights] if total > 0 else [1.0 / len(weights)] * len(weights)
        out, at = [], self.start
        for i, share in enumerate(shares):
            end = self.end if i == len(shares) - 1 else at + (self.end - self.start) * share
            out.append(Span(self.progress, at, end))
            at = end
        return out

    def native(self, fraction: float, user_data: Any) -> bool:
        """llama.cpp's progress_callback (wrap it in llama_cpp.llama_progress_callback and keep that
        object alive for the whole load): never raises, returns False to cancel the load."""
        return self.report(fraction)

    def check(self, what: str) -> None:
        self.progress.check(what)


def span_of(progress: Callback | Span | None) -> Span | None:
    """A caller's progress (a callback, a part of a larger load, or None: nothing to report) as a span."""
    if isinstance(progress, Span):
        return progress
    if progress is not None:
        return Progress(progress).whole()
    return None


def reach(span: Span | None, fraction: float, what: str) -> None:
    """Report `fraction` of `span` (None: nothing to report); Cancelled or CallbackError when the
    caller says stop there."""
    if span is not None and not span.report(fraction):
        span.check(what)


def load_weights(span: Span | None, params: Any, load: Callable[[], Any], what: str) -> Any:
    """llama.cpp's load of a model's weights (`load`: llama_model_load_from_file with `params`), its
    progress reported as the next WEIGHTS_SHARE of `span` (a second load, after a failed kernel
    check, continues from where the first one ended). A stop: llama.cpp frees what it loaded and
    returns NULL (a model it returns all the same is freed here), then Cancelled or CallbackError."""
    import llama_cpp as lc  # here: the registry's fetch reports through this module without llama.cpp

    if span is None:
        return load()
    weights = span.part(WEIGHTS_SHARE)
    reporter = lc.llama_progress_callback(weights.native)  # alive for the whole load
    params.progress_callback = reporter
    model = load()
    del reporter
    if weights.progress.stopped:
        if model:
            lc.llama_model_free(model)
        weights.check(what)
    return model


# ---------------------------------------------------------------- the command line's bar


_watch_lock = threading.Lock()
Watcher = Callable[[str], "Callback | None"]  # a load's file name -> its callback (None: not this one)
_watcher: Watcher | None = None


@contextlib.contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Within the block, a model loaded without a progress callback of its own reports to
    watcher(its file name) (the command line's progress bar; loads in any thread, as the
    command's call runs in a worker)."""
    global _watcher
    with _watch_lock:
        previous, _watcher = _watcher, watcher
    try:
        yield
    finally:
        with _watch_lock:
            _watcher = previous


def watched(name: str) -> Span | None:
    """The span a load of `name` without a callback reports to: the watcher's, or None."""
    with _watch_lock:
        watcher = _watcher
    callback = watcher(name) if watcher is not None else None
    return Progress(callback).whole() if callback is not None else None
