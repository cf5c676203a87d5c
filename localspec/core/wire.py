"""What one process reads from another over the resident socket, validated in one place, by
pydantic from the protocol's own dataclasses (as the server's schemas validate HTTP requests):

* a call (:func:`parse_request`): the service reads it from any program of its user that can
  reach its socket, so every field is checked (types without conversion, no unknown field, every
  float finite, an absolute model path without NUL) and another version is refused by name;
* a cancel and a stop (:func:`parse_cancel`, :func:`parse_stop`): what else the service reads;
* a status and the pairs a stop unloaded (:func:`parse_status`, :func:`parse_stopped`): ``ps`` and
  ``stop`` ask every service of their user, whatever localspec runs it.

A call's events are the one thing not read here: a client takes them from the service of its own
install and version, started from the same code (:func:`localspec.core.calls.event_of`).

The types' pydantic configuration is :data:`localspec.settings.validation.WIRE_CONFIG`. pydantic
is imported when the first value is read: the ``localspec`` client never reads one.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from localspec.core.calls import VERSION, Request
from localspec.core.cancel import Stop
from localspec.core.status import CoreStatus, PairStatus
from localspec.errors import RequestError
from localspec.settings.validation import WIRE_CONFIG


@dataclass(frozen=True)
class CancelFrame:
    """A client's CANCEL: why its user stopped the call."""

    __pydantic_config__ = WIRE_CONFIG

    reason: Stop


@dataclass(frozen=True)
class StopFrame:
    """A STOP: the targets whose pairs to unload (None: all, and the service ends)."""

    __pydantic_config__ = WIRE_CONFIG

    targets: list[str] | None = None


@dataclass(frozen=True)
class StopAnswer:
    """The service's answer to a STOP: the pairs it unloaded, and why it ends (None: it goes on)."""

    __pydantic_config__ = WIRE_CONFIG

    stopped: tuple[PairStatus, ...]
    ending: str | None = None


class Malformed(ValueError):
    """A value that is not what its frame carries (the message says which field and why)."""


@functools.cache
def _adapter(cls: type) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def _parse(cls: type, payload: bytes | str | dict[str, Any]) -> Any:
    """`payload` (JSON, or the object it holds) as a `cls`; Malformed saying which field is wrong
    and why otherwise."""
    from pydantic import ValidationError

    text = payload if isinstance(payload, (bytes, str)) else json.dumps(payload)
    try:
        try:
            return _adapter(cls).validate_json(text)
        except ValidationError as exc:
            if exc.errors()[0].get("type") != "json_invalid":
                raise
        return _with_surrogates(cls, text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "the value"
        raise Malformed(f"{where}: {first.get('msg', 'invalid')}") from None
    except (ValueError, TypeError) as exc:  # a dataclass's own check (ModelOptions', ModelFile's)
        raise Malformed(str(exc)) from None
    except RecursionError:
        raise Malformed("it nests deeper than Python's recursion limit") from None


def _with_surrogates(cls: type, text: bytes | str) -> Any:
    """JSON that pydantic's parser refuses but Python's reads: a path that is not UTF-8 travels as
    the surrogate escapes of os.fsdecode, which pydantic's parser (jiter) does not take. Every
    check runs on a copy of the value whose lone surrogates are replaced; the value itself, which
    passed them, is then built as it is (no conversion: the strict check found nothing to convert)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # also bytes that are not UTF-8
        raise Malformed(f"not JSON ({exc})") from None
    _adapter(cls).validate_json(json.dumps(_replaced(data), ensure_ascii=True))
    return _adapter(cls).validate_python(data, strict=False)


def _replaced(value: Any) -> Any:
    """`value` with every lone surrogate of its strings (keys too) replaced by "?"."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, list):
        return [_replaced(v) for v in value]
    if isinstance(value, dict):
        return {_replaced(k): _replaced(v) for k, v in value.items()}
    return value


def parse_request(payload: bytes) -> Request:
    """A client's call; RequestError saying what is wrong otherwise (a call of another version is
    refused by its version, whatever its fields)."""
    try:
        request = _parse(Request, payload)
    except Malformed as exc:
        _check_version(_version(payload))
        raise RequestError(f"a malformed call: {exc}") from None
    _check_version(request.version)
    return request


def _version(payload: bytes) -> Any:
    """The version a call says it is (VERSION where it says none, or is no JSON object)."""
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):
        return VERSION
    return data.get("version", VERSION) if isinstance(data, dict) else VERSION


def _check_version(version: Any) -> None:
    if version != VERSION:
        raise RequestError(f"this localspec reads version {VERSION} of calls, this one is version {version!r}: "
                           "run the same localspec on both sides")


def parse_cancel(payload: bytes) -> Stop:
    """Why a client stops its call ("interrupted" where it does not say so as a client of ours does)."""
    try:
        return _parse(CancelFrame, payload).reason
    except Malformed:
        return "interrupted"


def parse_stop(payload: bytes) -> list[str] | None:
    """The targets a STOP names (None: all); Malformed otherwise."""
    return _parse(StopFrame, payload).targets


def parse_status(payload: bytes | dict[str, Any]) -> CoreStatus:
    """A service's status; Malformed otherwise."""
    return _parse(CoreStatus, payload)


def parse_stopped(payload: bytes | dict[str, Any]) -> list[PairStatus]:
    """The pairs a service says a STOP unloaded; Malformed otherwise."""
    return list(_parse(StopAnswer, payload).stopped)

