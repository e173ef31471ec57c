"""Headers that must never go upstream: proxy credentials and hop-by-hop headers.

`Proxy-Authorization` carries the sandbox's gateway token; forwarding it would hand it to the
destination. Hop-by-hop headers (RFC 9110 7.6.1) belong to the client-gateway hop, and headers named in
`Connection` are hop-by-hop by declaration (a classic way to make a proxy drop a header the upstream
relies on, or to smuggle an `Upgrade: h2c`). Transfer-Encoding stays: mitmproxy re-frames the body from
it. `Upgrade` survives only as a websocket upgrade.
"""

from __future__ import annotations

from mitmproxy import http

ALWAYS_STRIP = ("proxy-authorization", "proxy-connection", "proxy-authenticate", "keep-alive", "te", "trailer")
# Connection tokens that are options, not header names.
_KEEP_TOKENS = {"close", "upgrade"}


def strip_hop_by_hop(request: http.Request) -> None:
    headers = request.headers
    named: list[str] = []
    for value in headers.get_all("connection"):
        named.extend(tok.strip().lower() for tok in value.split(",") if tok.strip())
    for name in ALWAYS_STRIP:
        if name in headers:
            del headers[name]
    websocket = headers.get("upgrade", "").strip().lower() == "websocket" and "upgrade" in named
    if not websocket and "upgrade" in headers:
        del headers["upgrade"]
    for name in named:
        if name in _KEEP_TOKENS or name in ("host", "content-length", "transfer-encoding"):
            continue
        if name in headers:
            del headers[name]
    if "connection" in headers:
        kept = [tok for tok in named if tok == "close" or (tok == "upgrade" and websocket)]
        if kept:
            headers["connection"] = ", ".join(dict.fromkeys(kept))
        else:
            del headers["connection"]


class Sanitize:
    """Addon: strip before the decision, so byte counting and the audit see what is actually sent."""

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        strip_hop_by_hop(flow.request)
