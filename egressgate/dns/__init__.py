"""egressgate's DNS resolver: only allowlisted names resolve, nothing private comes back, names are budgeted.

Entry point for `egressgate run`: `DnsServer(policies, state, audit, DnsConfig(...))`, then
`await server.start(host, port)` (UDP and TCP on the same port) and `await server.stop()`. See docs/dns.md.

The names below load on first use (PEP 562): `egressgate.config` imports `egressgate.dns.config`, and
importing this package must not pull in the whole resolver and dnslib for every CLI call that reads a
config file (~0.07 CPU-s each; the test suite makes hundreds).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"DnsConfig": "config", "DnsConfigError": "config", "DnsMetrics": "metrics", "DnsServer": "server"}

__all__ = ["DnsConfig", "DnsConfigError", "DnsMetrics", "DnsServer"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
