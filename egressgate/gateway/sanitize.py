"""Headers that must never go upstream: proxy credentials and hop-by-hop headers.

`Proxy-Authorization` carries the sandbox's gateway token; forwarding it would hand it to the
destination. Hop-by-hop headers (RFC 9110 7.6.1) belong to the client-gateway hop, and headers named in
`Connection` are hop-by-hop by declaration (a classic way to make a proxy drop a header the upstream
relies on, or to smuggle an `Upgrade: h2c`). Transfer-Encoding stays: mitmproxy re-frames the body from
it. `Upgrade` survives only as a websocket upgrade.
"""

from __future__ import annotations

from mitmproxy import http

ALWAYS_STRIP = (b"proxy-authorization", b"proxy-connection", b"proxy-authenticate", b"keep-alive", b"te", b"trailer")
# Connection tokens that are options, not header names.
_KEEP_TOKENS = {"close", "upgrade"}
_NEVER_NAMED = {"close", "upgrade", "host", "content-length", "transfer-encoding"}


def strip_hop_by_hop(request: http.Request) -> None:
    """One pass over the raw header fields (hot path: every request; mitmproxy's per-name lookups
    re-encode and re-lower each name), then one rebuild only when something goes. Header names are
    ASCII tokens here (validate_inbound_headers), so bytes.lower() is the case-insensitive compare."""
    fields = request.data.headers.fields
    named: list[str] = []
    upgrades: list[bytes] = []
    for name, value in fields:
        lname = name.lower()
        if lname == b"connection":
            text = value.decode("utf-8", "surrogateescape")
            named.extend(tok.strip().lower() for tok in text.split(",") if tok.strip())
        elif lname == b"upgrade":
            upgrades.append(value)
    websocket = (b", ".join(upgrades).decode("utf-8", "surrogateescape").strip().lower() == "websocket"
                 and "upgrade" in named)
    drop = set(ALWAYS_STRIP)
    if not websocket:
        drop.add(b"upgrade")
    drop.update(tok.encode("utf-8", "surrogateescape") for tok in named if tok not in _NEVER_NAMED)
    kept_tokens = [tok for tok in named if tok == "close" or (tok == "upgrade" and websocket)]
    connection = ", ".join(dict.fromkeys(kept_tokens)).encode() if kept_tokens else None
    out: list[tuple[bytes, bytes]] = []
    changed = False
    placed = False
    for name, value in fields:
        lname = name.lower()
        if lname == b"connection":
            changed = True
            if connection is not None and not placed:
                out.append((name, connection))  # one Connection, where the first one was
                placed = True
            continue
        if lname in drop:
            changed = True
            continue
        out.append((name, value))
    if changed:
        request.data.headers.fields = tuple(out)


class Sanitize:
    """Addon: strip before the decision, so byte counting and the audit see what is actually sent."""

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        strip_hop_by_hop(flow.request)
