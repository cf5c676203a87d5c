"""RPC server addresses ("host:port[,host:port...]", ``--rpc``), parsed and checked. A leaf: the
standard library and :mod:`localspec.settings.validation` only."""

from __future__ import annotations

import re
from collections.abc import Sequence

from localspec.settings.validation import require, show

_ENDPOINT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-_]+):(\d{1,5})$")
RPC_PORT = 50052  # llama.cpp's rpc-server default


def parse_endpoints(value: str | Sequence[str] | None, param: str = "rpc") -> tuple[str, ...]:
    """RPC servers as "host:port[,host:port...]" (or a list of them); ConfigError names a bad one."""
    if value is None or value == "" or value == ():
        return ()
    require(isinstance(value, (str, list, tuple)), param,
            f"{param} must be \"HOST:PORT[,HOST:PORT...]\" or a list of such strings, got {show(value)}")
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in (str(i).strip() for i in items):
        m = _ENDPOINT.match(item) if len(item) <= 300 else None
        require(m is not None and 1 <= int(m.group(2)) <= 65535, param,
                f"{show(item)} is not an RPC server address; use HOST:PORT, e.g. 192.168.1.20:{RPC_PORT} "
                "(several: comma-separated)")
        out.append(item)
    return tuple(dict.fromkeys(out))
