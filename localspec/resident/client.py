"""A call sent to the resident service (:class:`RemoteCall`): the service of this user and this
localspec is found, or started (once, however many clients arrive at the same time), sent the
resolved call (:class:`localspec.core.calls.Request`) and followed: its events come back as they
happen, Ctrl-C and SIGTERM reach it as a cancellation, and a service that goes away mid-call is
:class:`ServiceLost` (the command line exits 3 with what it had).

Nothing of the calling process goes to the service: the command line has already read the
prompt, stdin and every named file, resolved paths and fetched models. The standard library and
localspec's leaf modules only: a later call's client costs a Python start-up and a few
milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time

TYPE_CHECKING = False  # no typing at run time: the `localspec` client imports this module
if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path
    from typing import Any

from localspec.core.calls import BadEvent, Done, Failed, Request, event_of
from localspec.resident import runtime
from localspec.resident.protocol import ACCEPT, CALL, CANCEL, EVENT, Channel, ProtocolError, loads

ATTEMPTS = 4  # a service may be ending as a call arrives (idle, its code changed): another is started
TERM_GRACE = 2.0  # seconds the service has to end a call after the client's SIGTERM
POLL = 0.2  # seconds between checks for a stop while waiting for the service
ACCEPT_WAIT = 30.0  # seconds a service has to say whether it takes a call (it does at once)


class Unavailable(Exception):
    """No resident service can take the call (why): it runs in the calling process."""


class ServiceLost(Exception):
    """The service ended (killed, crashed) before the call did."""


class RemoteCall:
    """A call the resident service runs. Iterate over :meth:`events`; :meth:`cancel` (safe in a
    signal handler: it only records why) stops it within one step."""

    resident = True

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._reason: str | None = None
        self._sent = False
        self._deadline: float | None = None

    @classmethod
    def start(cls, request: Request) -> RemoteCall:
        """The call, taken by this user's service (started now if none runs); Unavailable when
        none can be had (an unusable runtime directory, a service that keeps refusing)."""
        try:
            where = runtime.directory()
        except OSError as exc:
            raise Unavailable(str(exc)) from None
        name = runtime.service_name()
        path = runtime.socket_path(where, name)
        if not runtime.socket_path_fits(path):
            raise Unavailable(f"the runtime directory {where} is too long a path for a socket")
        call = request.to_json()
        why = "it refused the call"
        for _ in range(ATTEMPTS):
            try:
                channel = runtime.connect(path) or _start_service(where, name, path)
            except OSError as exc:  # the socket's name is taken by something else, the process cannot start
                raise Unavailable(f"the resident service cannot be started: {exc.strerror or exc}") from None
            if channel is None:
                why = "it did not start (its log is in " + str(where) + ")"
                continue
            if not _accepted(channel, call):  # ending (or ended) as the call arrived: the next attempt starts another
                channel.close()
                continue
            return cls(channel)
        raise Unavailable(f"the resident service could not take the call: {why}")

    def cancel(self, reason: str) -> None:
        """Stop the call ("interrupted", "terminated"); sent from events()'s loop."""
        if self._reason is None:
            self._reason = reason
            if reason == "terminated":
                self._deadline = time.monotonic() + TERM_GRACE

    def events(self) -> Iterator[Any]:
        """The call's events as the service sends them, up to its Done or Failed; ServiceLost
        when the service goes away first (or sends what no service of ours sends)."""
        while True:
            if self._reason is not None and not self._sent:
                self._sent = True
                with contextlib.suppress(OSError):
                    self.channel.send(CANCEL, {"reason": self._reason})
            if self._deadline is not None and time.monotonic() > self._deadline:
                yield Done(stopped=self._reason)  # the service did not end the call in time: leave anyway
                return
            try:
                readable, _, _ = select.select([self.channel.sock], [], [], POLL)
            except InterruptedError:
                continue
            if not readable:
                continue
            event = self._next()
            yield event
            if isinstance(event, (Done, Failed)):
                return

    def _next(self) -> Any:
        try:
            frame = self.channel.recv()
        except (OSError, ProtocolError):
            frame = None
        if frame is None:
            raise ServiceLost("the resident service ended before the call was done (killed, or it crashed)")
        kind, payload = frame
        try:
            if kind != EVENT:
                raise BadEvent(f"a {kind!r} frame during a call")
            return event_of(loads(payload))
        except (BadEvent, ProtocolError) as exc:
            raise ServiceLost(f"the resident service sent what no localspec service sends ({exc})") from None

    def abandon(self, code: int) -> None:
        """The user stopped the call before its output: leave now (the service sees the
        connection close and stops the call)."""
        self.close()

    def close(self) -> None:
        self.channel.close()


def _accepted(channel: Channel, call: dict[str, Any]) -> bool:
    """Send the call; whether the service took it (False: it is ending, RETRY, or gone)."""
    try:
        channel.send(CALL, call)
        readable, _, _ = select.select([channel.sock], [], [], ACCEPT_WAIT)
        frame = channel.recv() if readable else None
    except (OSError, ProtocolError):
        return False
    return frame is not None and frame[0] == ACCEPT


def _start_service(where: Path, name: str, path: Path) -> Channel | None:
    """Start the service (unless another client just did), under the spawn lock: the socket
    listens before the lock is released, so every client arriving meanwhile finds it."""
    import secrets
    import subprocess

    with runtime.spawn_lock(where):
        channel = runtime.connect(path)
        if channel is not None:
            return channel
        listener = runtime.listen(path)
        log_path = where / f"{name}-{secrets.token_hex(4)}{runtime.LOG_SUFFIX}"
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            subprocess.Popen([sys.executable, "-m", "localspec.resident.service", "--fd", str(listener.fileno()),
                              "--log", str(log_path)],
                             pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                             start_new_session=True, cwd="/")
        finally:
            os.close(log_fd)
            listener.close()  # the service holds its own copy
        runtime.prune_logs(where, name)
    return runtime.connect(path)
