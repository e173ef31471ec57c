"""Headers that must never go upstream: proxy credentials and hop-by-hop headers (the rules; the Sanitize
addon applies them before the decision, the upstream side of the HTTP layers applies the te rule again).

`Proxy-Authorization` carries the sandbox's gateway token; forwarding it would hand it to the
destination. Hop-by-hop headers (RFC 9110 7.6.1) belong to the client-gateway hop, and headers named in
`Connection` are hop-by-hop by declaration (a classic way to make a proxy drop a header the upstream
relies on, or to smuggle an `Upgrade: h2c`). Transfer-Encoding stays: mitmproxy re-frames the body from
it. `Upgrade` survives only as a websocket upgrade.

`TE` is hop-by-hop too, with one exception that gRPC depends on: on HTTP/2, `te: trailers` is the only
value RFC 9113 (8.2.2) allows, and grpcio servers reset a call without it (the client saw `UNAVAILABLE
... 502`). So an HTTP/2 request whose te fields together say exactly `trailers` (case-insensitive, any
whitespace, repeated) keeps ONE `te: trailers`; every other te (a coding such as `gzip`, `trailers, gzip`,
parameters, te on HTTP/1 where it is strictly per-hop) is stripped as before. Which protocol the upstream
speaks is only known when the request is sent (mitmproxy can translate between versions), so the
upstream side applies the same rule once more, for the version it really speaks (`te_for_upstream`,
called by GatewayHttp1Client and GatewayHttp2Client): HTTP/1 upstreams never get te, HTTP/2 upstreams
never get anything but `te: trailers` (a coding there is a protocol error the h2 library would not catch:
mitmproxy sends with `validate_outbound_headers=False`).
"""

from __future__ import annotations

import dataclasses

from mitmproxy import http
from mitmproxy.proxy.layers.http._events import RequestHeaders

ALWAYS_STRIP = (b"proxy-authorization", b"proxy-connection", b"proxy-authenticate", b"keep-alive", b"te", b"trailer")
# Connection tokens that are options, not header names.
_KEEP_TOKENS = {"close", "upgrade"}
_NEVER_NAMED = {"close", "upgrade", "host", "content-length", "transfer-encoding"}
TE_TRAILERS = (b"te", b"trailers")


def only_trailers(values: list[bytes]) -> bool:
    """Whether te field values, taken together as one list (RFC 9110 5.3), say exactly `trailers`:
    every non-empty element is the token `trailers`, case-insensitive, whitespace around it ignored. A
    parameter (`trailers;q=1`) or any coding makes it something else."""
    seen = False
    for value in values:
        for element in value.split(b","):
            token = element.strip(b" \t").lower()
            if not token:
                continue  # empty list elements are allowed and ignored (RFC 9110 5.6.1)
            if token != b"trailers":
                return False
            seen = True
    return seen


def _rebuild_te(fields: tuple[tuple[bytes, bytes], ...], keep: bool) -> tuple[tuple[bytes, bytes], ...]:
    """`fields` with every te field dropped, or replaced by one `te: trailers` where the first one was."""
    out: list[tuple[bytes, bytes]] = []
    placed = False
    for name, value in fields:
        if name.lower() == b"te":
            if keep and not placed:
                out.append(TE_TRAILERS)
                placed = True
            continue
        out.append((name, value))
    return tuple(out)


def te_for_upstream(event: RequestHeaders, http2: bool) -> RequestHeaders:
    """The request headers event to send on an upstream that speaks HTTP/2 (`http2`) or HTTP/1: te
    only as a single `te: trailers`, only on HTTP/2. The flow's request is not touched (it may be a
    translation of the client's version): a copy goes out when te must change, else the event as is."""
    fields = event.request.data.headers.fields
    values = [value for name, value in fields if name.lower() == b"te"]
    if not values:
        return event
    keep = http2 and only_trailers(values)
    if keep and values == [b"trailers"] and TE_TRAILERS in fields:
        return event  # already exactly what may go out
    request = event.request.copy()
    request.data.headers.fields = _rebuild_te(fields, keep)
    return dataclasses.replace(event, request=request)


def strip_hop_by_hop(request: http.Request) -> None:
    """One pass over the raw header fields (hot path: every request; mitmproxy's per-name lookups
    re-encode and re-lower each name), then one rebuild only when something goes. Header names are
    ASCII tokens here (validate_inbound_headers), so bytes.lower() is the case-insensitive compare."""
    fields = request.data.headers.fields
    named: list[str] = []
    upgrades: list[bytes] = []
    te_values: list[bytes] = []
    for name, value in fields:
        lname = name.lower()
        if lname == b"connection":
            text = value.decode("utf-8", "surrogateescape")
            named.extend(tok.strip().lower() for tok in text.split(",") if tok.strip())
        elif lname == b"upgrade":
            upgrades.append(value)
        elif lname == b"te":
            te_values.append(value)
    websocket = (b", ".join(upgrades).decode("utf-8", "surrogateescape").strip().lower() == "websocket"
                 and "upgrade" in named)
    drop = set(ALWAYS_STRIP)
    if not websocket:
        drop.add(b"upgrade")
    drop.update(tok.encode("utf-8", "surrogateescape") for tok in named if tok not in _NEVER_NAMED)
    # te: trailers survives only on HTTP/2 and only if no Connection field names te (impossible on a
    # valid HTTP/2 request: Connection itself is forbidden there, RFC 9113 8.2.2)
    keep_te = (bool(te_values) and request.data.http_version.startswith(b"HTTP/2") and "te" not in named
               and only_trailers(te_values))
    kept_tokens = [tok for tok in named if tok == "close" or (tok == "upgrade" and websocket)]
    connection = ", ".join(dict.fromkeys(kept_tokens)).encode() if kept_tokens else None
    out: list[tuple[bytes, bytes]] = []
    changed = False
    placed = False
    te_placed = False
    for name, value in fields:
        lname = name.lower()
        if lname == b"connection":
            changed = True
            if connection is not None and not placed:
                out.append((name, connection))  # one Connection, where the first one was
                placed = True
            continue
        if lname == b"te" and keep_te and not te_placed:
            te_placed = True
            if (name, value) != TE_TRAILERS:
                changed = True
            out.append(TE_TRAILERS)  # one te: trailers, where the first te was
            continue
        if lname in drop:
            changed = True
            continue
        out.append((name, value))
    if changed:
        request.data.headers.fields = tuple(out)
