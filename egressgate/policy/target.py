"""Parse the textual targets operators type: `'POST https://host/path?q'`, `'CONNECT host:443'`,
`'DNS AAAA host'`, into canonical `Facts`. Used by `policy explain`, `policy test` and `audit hash`, so the
CLI decides exactly what the gateway would for the same request.
"""

from __future__ import annotations

from dataclasses import dataclass

from egressgate.policy.canon import (
    CanonError,
    canon_host,
    canon_method,
    canon_path,
    parse_ip_literal,
    split_host_port,
    split_path_query,
)
from egressgate.policy.facts import Facts, IPAddress, Operation
from egressgate.policy.opclass import classify

DEFAULT_PORT = {"https": 443, "http": 80}


@dataclass(frozen=True, slots=True)
class Url:
    scheme: str
    host: str  # canonical
    port: int
    path: str  # canonical, no query
    query: str | None  # raw, as written


def parse_url(url: str) -> Url:
    """Absolute http(s) URL -> canonical parts. Userinfo and fragments are refused (CanonError)."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in DEFAULT_PORT:
        raise CanonError("bad_url", f"expected an absolute http:// or https:// URL, got {url!r}")
    end = len(rest)
    for stop in "/?#":
        found = rest.find(stop)
        if found != -1:
            end = min(end, found)
    authority, remainder = rest[:end], rest[end:]
    if "@" in authority:
        raise CanonError("userinfo", "credentials in URLs (user@host) are refused")
    if "#" in remainder:
        raise CanonError("fragment", "URL fragments are never sent to servers; remove '#...'")
    host, port = split_host_port(authority, DEFAULT_PORT[scheme])
    raw_path, query = split_path_query(remainder or "/")
    if not raw_path:
        raw_path = "/"
    return Url(scheme, host, port, canon_path(raw_path), query)


def parse_target(text: str, addresses: tuple[IPAddress, ...] = (), content_type: str | None = None,
                 accept: str | None = None) -> Facts:
    """'METHOD URL' | 'CONNECT host:port' | 'DNS QTYPE name' -> Facts. An HTTP request is classified by
    protocol (package install, publish: policy/opclass.py) exactly as the gateway does, from its method,
    path and query and the given Content-Type / Accept header values."""
    parts = text.split()
    if len(parts) == 3 and parts[0].upper() == "DNS":
        return Facts(Operation.DNS_QUERY, canon_host(parts[2]), scheme="dns", qtype=parts[1].upper())
    if len(parts) != 2:
        raise CanonError("bad_target", f"expected 'METHOD URL', 'CONNECT host:port' or 'DNS TYPE name': {text!r}")
    method, rest = parts
    if method.upper() == "CONNECT":
        host, port = split_host_port(rest, None)
        return Facts(Operation.CONNECT, host, port, addresses=addresses)
    url = parse_url(rest)
    literal = parse_ip_literal(url.host)
    method = canon_method(method)
    op = classify(method, url.path, url.query, content_type, accept)
    return Facts(
        Operation.HTTP_REQUEST,
        url.host,
        url.port,
        scheme=url.scheme,
        method=method,
        path=url.path,
        query=url.query or None,
        addresses=addresses or ((literal,) if literal is not None else ()),
        op_class=op[0] if op else None,
        op_protocol=op[1] if op else None,
    )
