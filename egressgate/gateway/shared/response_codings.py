"""Which codings a response body is under, as the client would undo them; or why it cannot be inspected.

Two headers code a body. Content-Encoding (every field, in order) is the representation; a
Transfer-Encoding (HTTP/1.1 only) is applied on top of it, and mitmproxy 12 undoes only its final
`chunked`: for `gzip, chunked`, `gzip`, `deflate`, `compress` (read until close) it hands the hooks the
still-compressed bytes and forwards the header. Scrubbing by Content-Encoding alone therefore let a
`Transfer-Encoding: gzip` echo of the injected credential through (issue 9). On a credentialed route
the body is decoded in the order `Content-Encoding…, Transfer-Encoding…` was applied, or refused.

mitmproxy itself already rejects (502, before any hook) a Transfer-Encoding outside
{chunked, gzip, deflate, compress, identity}[, chunked], several Transfer-Encoding fields, one with a
Content-Length, and one on a 1xx/204 response; h2 rejects it on HTTP/2. The checks here do not rely
on that: they are the rule, stated once, for what the scrubber can see.
"""

from __future__ import annotations

from mitmproxy import http

from egressgate.broker.decompress import UnsupportedEncoding, coding_names, decoder


class Uninspectable(ValueError):
    """The response's body or headers cannot be scrubbed as the client would read them: refuse it.
    `reason` is the stable code in the refusal body and the audit record."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def body_codings(resp: http.Response) -> list[str]:
    """Every coding on the body, in the order applied (decode in reverse); [] for plain bytes.
    Raises Uninspectable for framing no HTTP/1.1 or HTTP/2 client reads unambiguously, or a coding
    that cannot be decoded."""
    te_fields = resp.headers.get_all("transfer-encoding")
    transfer: list[str] = []
    if te_fields:
        if resp.is_http2 or resp.is_http3:
            raise Uninspectable("invalid_framing", "The upstream sent Transfer-Encoding over HTTP/2, which "
                                "HTTP/2 forbids; the response was refused.")
        transfer = [n for n in (v.strip(" \t").lower() for v in ",".join(te_fields).split(",")) if n]
        if transfer and transfer[-1] == "chunked":
            transfer.pop()  # mitmproxy de-chunked the body already
        if "chunked" in transfer:  # twice, or not last: the length is ambiguous
            raise Uninspectable("invalid_framing", "The upstream's Transfer-Encoding framing is ambiguous; "
                                "the response was refused.")
    names = coding_names(resp.headers.get_all("content-encoding")) + coding_names(transfer)
    try:
        decoder(names)  # validates names and depth up front (cheap: no data yet)
    except UnsupportedEncoding:
        raise Uninspectable("unsupported_coding", "The upstream sent the response in a content or transfer "
                            "coding the gateway cannot decode and inspect, so it was refused; retry with "
                            "uncompressed responses (Accept-Encoding: identity).") from None
    return names


def folded_headers(resp: http.Response) -> bool:
    """mitmproxy keeps an obsolete line fold (RFC 9112 5.2) inside the value (`a\\r\\n b`) and
    forwards it: a secret split by a fold is invisible to the scrubber, yet the client unfolds it.
    RFC 9112 lets a proxy answer such a response with 502; a credentialed route does."""
    return any(b"\n" in value or b"\r" in value for _, value in resp.headers.fields)


def folded() -> Uninspectable:
    return Uninspectable("folded_header", "The upstream's response headers use obsolete line folding, which "
                         "the gateway cannot inspect on a route carrying a credential; the response was refused.")
