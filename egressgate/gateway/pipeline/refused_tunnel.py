"""A refused CONNECT the agent can read: the tunnel is accepted, nothing is ever forwarded through it, and
every request inside it is answered with the CONNECT's deny over the gateway's own TLS.

Why: curl, requests, httpx, git, pip and wget show nothing of a refused CONNECT's body ("CONNECT tunnel
failed, response 403"), so the agent never learns the reason, the rule or the approval id to ask for, and
retries around the proxy. With `deny.connect_in_tunnel` (gateway config, on by default) a CONNECT refused
by the policy or an address check is answered `200` instead (with the deny headers), and then:

* **no upstream connection, ever**: the CONNECT's response is set in the `http_connect` hook, so
  mitmproxy's eager strategy opens nothing; the tunnel is never bound (`tunnel_host` stays None), so
  pinning.py has no approved destination for it and refuses any server connection; the client handshake
  never waits for a server handshake (`establish_server_tls_first = False`);
* **TLS** is intercepted with a leaf of the gateway CA for the requested name (mitmproxy's certificate for
  the CONNECT host, and the SNI the client sent: whatever name it presents, nothing leaves), then HTTP/1
  or HTTP/2 (every stream);
* **every request** inside is answered by enforce.py with the CONNECT's decision under the CONNECT's
  request id (identity.py sets it before any other stage, refused_layers.answer; NextLayer picks the layers
  with refused_layers.inner_layer): the body, the headers and the audit record the agent can look up are
  the same. HTTP/1 answers close the connection (`Connection: close`);
* **one audit record**: the CONNECT's deny. The answers inside write no record of their own (nothing was
  decided anew and nothing went anywhere), so one refused attempt is one deny in the trail and in metrics;
* **other bytes** (not TLS, not HTTP, or not HTTP inside the TLS) get the raw deny bytes and the close.

Not delivered in a tunnel (the CONNECT itself is answered, with the same headers and a reason phrase that
names the reason): identity refusals (407 is a challenge the client must answer, and an unidentified
client gets no TLS handshake from us), the connection limit (accepting would hold the connection the limit
refuses), an unparseable target (no name to issue a leaf for), and the gateway's own failures (audit,
state, policy, internal: a degraded gateway takes on no handshakes).
"""

from __future__ import annotations

import time

from mitmproxy import http
from mitmproxy import tls as mitm_tls

from egressgate.gateway.shared.context import ConnState, FlowState, Runtime, flow_state
from egressgate.gateway.shared.deny import deny_headers
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Reason

# Refusals that come from the policy or the address checks: what the agent can act on (ask for approval,
# use another host, stop). A reason not listed keeps the refusal on the CONNECT (fail closed).
DELIVERED_IN_TUNNEL = frozenset(
    {
        Reason.HOST_NOT_ALLOWED,
        Reason.SCHEME_NOT_ALLOWED,
        Reason.PORT_NOT_ALLOWED,
        Reason.DENIED_BY_RULE,
        Reason.CONDITION_FAILED,
        Reason.BUDGET_EXCEEDED,
        Reason.APPROVAL_REQUIRED,
        Reason.ADDRESS_FORBIDDEN,
        Reason.METADATA_ENDPOINT,
        Reason.SELF_CONNECTION,
        Reason.UPSTREAM_UNRESOLVABLE,
    }
)


def deliverable(decision: Decision | None, fs: FlowState, conn: ConnState) -> bool:
    """True when this refused CONNECT is answered inside an accepted tunnel (pure)."""
    return (
        decision is not None
        and not decision.allowed
        and decision.reason in DELIVERED_IN_TUNNEL
        and fs.audited
        and fs.host is not None
        and fs.port is not None
        and conn.sandbox_id is not None
        and fs.sandbox_id == conn.sandbox_id
        and not conn.transparent
        and conn.tunnel_host is None
        and conn.refusal is None
    )


def accepted(decision: Decision, request_id: str, http_version: str) -> http.Response:
    """The `200` that opens a refused tunnel. It carries the deny headers already (`curl -v` shows them);
    no Content-Length or Transfer-Encoding (RFC 9110 forbids them on a 2xx to CONNECT)."""
    now = time.time()
    fields = [(k.encode(), v.encode()) for k, v in deny_headers(decision, request_id).items()]
    return http.Response(http_version, 200, b"Connection established", http.Headers(fields), b"", None, now, now)


class RefusedTunnel:
    """Addon (after Enforce): turns an eligible refused CONNECT into an accepted, never-forwarding tunnel."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def http_connect(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        conn = self.rt.conns.get(flow.client_conn.id)
        if not self.rt.config.deny.connect_in_tunnel or fs is None or conn is None or flow.response is None:
            return
        if not deliverable(fs.decision, fs, conn):
            return
        assert fs.decision is not None and fs.host is not None and fs.port is not None
        conn.refusal, conn.refusal_id, conn.refused_target = fs.decision, fs.request_id, (fs.host, fs.port)
        flow.response = accepted(fs.decision, fs.request_id, flow.request.http_version)

    def tls_clienthello(self, data: mitm_tls.ClientHelloData) -> None:
        """The gateway's leaf, without a server handshake first (there is no server)."""
        conn = self.rt.conns.get(data.context.client.id)
        if conn is not None and conn.refused_target is not None:
            data.establish_server_tls_first = False
