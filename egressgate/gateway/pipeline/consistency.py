"""Every name for the destination must be the same name: CONNECT target, TLS SNI, Host/:authority and
the absolute-form URI.

Domain fronting (CONNECT to an allowed name, another SNI or Host inside) was the one real escape of a
production agent firewall, and Host spoofing made a peer inject credentials for the wrong server. The
gateway decides and dials by the CONNECT target (or the absolute URI) only; this addon refuses any
request whose other names disagree with it, so a rule, a pinned address and an injected credential
can never be bound to a different host than the one the request actually reaches. Userinfo in any
authority is refused outright (it has no legitimate use through a proxy and confuses parsers).
"""

from __future__ import annotations

import logging

from mitmproxy import http, tls

from egressgate.gateway.shared.context import ConnState, FlowState, Runtime, ensure_flow_state
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.policy.canon import CanonError, canon_host, split_host_port
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)

DEFAULT_PORTS = {"http": 80, "https": 443}


def names_target(raw: str, host: str, port: int) -> bool:
    """True when authority `raw` names (host, port). A missing port means the target's port: clients
    commonly omit it, and the gateway dials the target's port whatever the header says."""
    if "@" in raw:
        return False
    try:
        got_host, got_port = split_host_port(raw, port)
    except ValueError:  # CanonError is a ValueError
        return False
    return got_host == host and got_port == port


def check_tunnel_request(conn: ConnState, request: http.Request) -> Decision | None:
    """Checks for one request inside a CONNECT tunnel; None when consistent."""
    assert conn.tunnel_host is not None and conn.tunnel_port is not None
    host, port = conn.tunnel_host, conn.tunnel_port
    if conn.sni_mismatch is not None:
        return gateway_deny(
            Reason.HOST_MISMATCH,
            f"The TLS SNI does not match the CONNECT target {host}:{port}; connect to the host you "
            f"want to reach directly.",
        )
    hosts = request.headers.get_all("host")
    if len(hosts) > 1:
        return gateway_deny(Reason.INVALID_REQUEST, "Send exactly one Host header.")
    names = [*hosts]
    if request.authority:
        names.append(request.authority)  # h2 :authority or an absolute-form target
    if not names:
        return gateway_deny(Reason.INVALID_REQUEST, f"Send a Host header naming {host}.")
    for raw in names:
        if "@" in raw:
            return gateway_deny(Reason.INVALID_REQUEST, "User information in URLs is not allowed.")
        if not names_target(raw, host, port):
            return gateway_deny(
                Reason.HOST_MISMATCH,
                f"This tunnel was opened to {host}:{port}; the Host and :authority must name it too. "
                f"Open a new CONNECT for another host.",
            )
    return None


def check_proxy_request(request: http.Request) -> tuple[Decision | None, str, int]:
    """Checks for an absolute-form (plain proxy) request: Host must agree with the URI.

    mitmproxy already parsed the URI into request.host/port (rejecting userinfo); the Host header is
    the attacker-controlled second opinion that must not disagree.
    """
    try:
        host = canon_host(request.host)
    except CanonError:
        return gateway_deny(Reason.INVALID_REQUEST, "The request target host is not valid."), "", 0
    port = request.port
    hosts = request.headers.get_all("host")
    if len(hosts) > 1:
        return gateway_deny(Reason.INVALID_REQUEST, "Send exactly one Host header."), host, port
    for raw in hosts:
        if "@" in raw:
            return gateway_deny(Reason.INVALID_REQUEST, "User information in URLs is not allowed."), host, port
        if not names_target(raw, host, port):
            return (
                gateway_deny(
                    Reason.HOST_MISMATCH,
                    f"The Host header must name the request URI's host {host}:{port}.",
                ),
                host,
                port,
            )
    return None, host, port


class Consistency:
    """Addon: SNI verdict per tunnel, Host/:authority/URI agreement per request."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        conn = self.rt.conns.get(data.context.client.id)
        if conn is None or conn.tunnel_host is None:
            return
        sni = data.client_hello.sni
        if sni is None:
            return  # server_connect already set the upstream SNI to the CONNECT name
        try:
            same = canon_host(sni) == conn.tunnel_host
        except CanonError:
            same = False
        if not same:
            conn.sni_mismatch = sni
            # Do not open upstream TLS for a fronting attempt; every request will get 421.
            data.establish_server_tls_first = False
            logger.info("SNI %r does not match CONNECT target %s", sni, conn.tunnel_host)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        fs: FlowState = ensure_flow_state(flow)
        if fs.decision is not None or flow.response is not None:
            return
        conn = self.rt.conn(flow.client_conn.id)
        if conn.tunnel_host is not None:
            fs.host, fs.port = conn.tunnel_host, conn.tunnel_port
            fs.decision = check_tunnel_request(conn, flow.request)
        else:
            fs.decision, fs.host, fs.port = check_proxy_request(flow.request)
