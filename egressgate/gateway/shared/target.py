"""What a flow asked for, as the audit record names it: the raw target as sent and its canonical parts.

The decision addon fills these while deciding. A flow that an earlier check already refused (unknown
identity, revoked sandbox, an addon crash) never gets that far, yet its record must still say what was
asked for, or an auditor cannot tell a probe of an internal host from a typo: `note_target` fills the same
fields with the same canonicalizers (policy/canon.py), best effort. A part that does not canonicalize is
left empty, never guessed; the raw text stays in `target_as_sent` (attribute `egressgate.target.as_sent`).
Headers are never read here: Proxy-Authorization (the sandbox's token) must not reach a record.
"""

from __future__ import annotations

import contextlib

from mitmproxy import http

from egressgate.gateway.shared.context import FlowState, Runtime
from egressgate.policy.canon import CanonError, canon_host, canon_method, canon_path, split_host_port, split_path_query


def as_sent(request: http.Request) -> str:
    """The target exactly as the sandbox wrote it: `host:port` of a CONNECT, `METHOD authority/path` else."""
    if request.method == "CONNECT":
        return request.authority or f"{request.host}:{request.port}"
    return f"{request.method} {request.authority or request.host_header or ''}{request.path}"


def note_target(rt: Runtime, flow: http.HTTPFlow, fs: FlowState) -> None:
    """Fill the target fields the decision addon did not (it stops at the first deny); never overwrites."""
    req = flow.request
    if fs.target_as_sent is None:
        fs.target_as_sent = as_sent(req)
    if req.method == "CONNECT":
        if fs.host is None:
            with contextlib.suppress(CanonError):
                fs.host, fs.port = split_host_port(as_sent(req), req.port)
        return
    conn = rt.conns.get(flow.client_conn.id)
    tunnel = conn is not None and conn.tunnel_host is not None
    if fs.host is None:
        if conn is not None and conn.tunnel_host is not None:
            fs.host, fs.port = conn.tunnel_host, conn.tunnel_port
        else:
            with contextlib.suppress(CanonError):
                fs.host, fs.port = canon_host(req.host), req.port
    if fs.scheme is None:
        fs.scheme = ("https" if flow.client_conn.tls else "http") if tunnel else req.scheme
    if fs.method is None:
        with contextlib.suppress(CanonError):
            fs.method = canon_method(req.method)
    if fs.path is None:
        try:
            raw_path, query = split_path_query(req.path)
            fs.path = canon_path(raw_path)
            fs.query = query or None
        except CanonError:
            pass
