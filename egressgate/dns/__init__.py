"""egressgate's DNS resolver: only allowlisted names resolve, nothing private comes back, names are budgeted.

Entry point for `egressgate run`: `DnsServer(policies, state, audit, DnsConfig(...))`, then
`await server.start(host, port)` (UDP and TCP on the same port) and `await server.stop()`. See docs/dns.md.
"""

from egressgate.dns.config import DnsConfig, DnsConfigError
from egressgate.dns.metrics import DnsMetrics
from egressgate.dns.server import DnsServer

__all__ = ["DnsConfig", "DnsConfigError", "DnsMetrics", "DnsServer"]
