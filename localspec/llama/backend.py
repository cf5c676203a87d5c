"""llama.cpp's process-wide set-up: the backends initialised once, and its log routed to logging.

llama.cpp writes its log through one callback per process. localspec's callback sends the lines
to the ``logging`` module at debug level (shown with ``LOCALSPEC_LLAMA_LOG=1`` and ``-vv``) and,
while a model loads, keeps them for the loader (:func:`capture_log`: which buffer types the
weights went to).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator

import llama_cpp as lc

from localspec.errors import ConfigError
from localspec.settings import environment

log = logging.getLogger(__name__)
LOG_ENV = "LOCALSPEC_LLAMA_LOG"  # a boolean: llama.cpp's lines at debug level

_init_lock = threading.Lock()
_ready = False
_callback = None  # keeps the ctypes callback alive
_capture_lock = threading.RLock()  # one thread's captures at a time, so their lines are its own
_captures: list[list[str]] = []  # the captures under way (nested ones in one thread: each gets every line)


def _log_line(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    line = text.decode("utf-8", "replace")
    for lines in _captures:
        lines.append(line)
    if _log_wanted():
        log.debug("llama.cpp: %s", line.rstrip())


def _log_wanted() -> bool:
    """$LOCALSPEC_LLAMA_LOG, read for each line (a callback must not raise: init() refused a bad
    value before llama.cpp could log)."""
    try:
        return bool(environment.get(LOG_ENV))
    except ConfigError:
        return False


def init() -> None:
    """Initialise llama.cpp once and route its log lines to logging (debug); ConfigError naming
    $LOCALSPEC_LLAMA_LOG when its value is not a boolean."""
    global _ready, _callback
    environment.get(LOG_ENV)
    with _init_lock:
        if _ready:
            return
        _callback = lc.llama_log_callback(_log_line)
        lc.llama_log_set(_callback, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _ready = True


@contextlib.contextmanager
def capture_log() -> Iterator[list[str]]:
    """llama.cpp's log lines while the block runs. Blocks of different threads run one at a time;
    a block within another (a load inside a measurement of it) gets its lines, and so does the outer."""
    init()
    with _capture_lock:
        lines: list[str] = []
        _captures.append(lines)
        try:
            yield lines
        finally:
            del _captures[next(i for i, other in enumerate(_captures) if other is lines)]
