"""Who a connection is, as every identifying path needs it: the client's source address in canonical
text, the per-sandbox connection limit, and the identity answers other stages repeat (the explicit
proxy's 407 challenge, the transparent listener's "not a proxy" and "unknown source"). identity.py
(explicit proxy) and transparent_decide.py (transparent listener) both use them; record.py tells a
challenge from a denial by `CHALLENGE`.
"""

from __future__ import annotations

import ipaddress

from mitmproxy import connection

from egressgate.gateway.shared.context import Runtime
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.policy.canon import ip_text
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Reason
from egressgate.state.base import SandboxRecord

# The detail of a 407 to a request that carried no Proxy-Authorization at all: clients (git, pip, curl with
# --proxy-anyauth) first ask without credentials and answer the challenge. It is audited with decision
# `challenge`, not `deny` (record.py): a refusal the client then answers is not a denial, and metrics and
# alerts on denials stay honest. Wrong, malformed or revoked credentials are denials.
CHALLENGE = "challenge"
NOT_A_PROXY = ("This connection was redirected to the gateway transparently: send requests to the "
               "destination itself (origin-form, with its Host), not CONNECT or absolute-form proxy requests.")
UNKNOWN_SOURCE = ("This source address is not registered to any sandbox; start the workload with "
                  "`egressgate sandbox run` (or admit it with `sandbox admit --address`).")




def source_text(client: connection.Client) -> str | None:
    """The client's source address in the canonical text admission stores (`ip_text`)."""
    if not client.peername:
        return None
    try:
        address = ipaddress.ip_address(str(client.peername[0]).split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack listener reports IPv4 clients as ::ffff:a.b.c.d
    return ip_text(address)


def connection_limit(rt: Runtime, record: SandboxRecord) -> Decision | None:
    """Concurrent connections per sandbox are bounded (limits.max_connections_per_sandbox): one sandbox
    must not exhaust the gateway's sockets and memory for every other sandbox. The refusal is the
    request's decision (429 + Connection: close), audited like any deny."""
    limit = rt.config.limits.max_connections_per_sandbox
    if len(rt.by_sandbox.get(record.id, ())) < limit:
        return None
    return gateway_deny(
        Reason.CONNECTION_LIMIT,
        f"This sandbox already has {limit} open connections through the gateway "
        f"(limits.max_connections_per_sandbox); close or reuse one, then retry.",
        detail="max_connections_per_sandbox")
