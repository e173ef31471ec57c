"""A raw TLS upstream for coding tests: it answers with exactly the bytes a case names (any
Transfer-Encoding / Content-Encoding, folded headers, duplicate framing headers), which aiohttp will not
send. It echoes the credential it received (`Authorization: Bearer ...`, or `X-Echo` on routes that
carry none, for the positive controls) compressed in the case's codings, and records what it sent.

Also an HTTP/2 variant that sends a `transfer-encoding` header (forbidden in HTTP/2, RFC 9113 8.2.2).
`leak_in` is the leak detector: independent of egressgate's decoder, it tries every coding on the bytes
the client received, so a test using it can fail.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import ssl
import zlib
from dataclasses import dataclass, field

import brotli
from backports import zstd

from tests.support.h2server import serve_h2_events
from tests.support.loopback import read_request_head


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


ENCODERS = {
    "gzip": gzip.compress, "zlib": zlib.compress, "rawdeflate": _raw_deflate, "br": brotli.compress,
    "zstd": zstd.compress, "identity": lambda b: b,
    "lzw": lambda b: b"\x1f\x9d\x90" + b,  # `compress` is not decodable by anyone here: sent as is
}


@dataclass(frozen=True)
class Case:
    """`codings`: encoders applied in order (first applied first); `headers` are sent verbatim;
    framing: chunked (TE has chunked), close (read until close) or length (Content-Length)."""

    headers: tuple[tuple[str, str], ...]
    codings: tuple[str, ...]
    framing: str


def _te(value: str, *codings: str, ce: tuple[tuple[str, str], ...] = ()) -> Case:
    framing = "chunked" if value.lower().replace(" ", "").endswith("chunked") else "close"
    return Case((*ce, ("Transfer-Encoding", value)), codings, framing)


def _ce(values: tuple[str, ...], *codings: str, framing: str = "length") -> Case:
    headers = tuple(("Content-Encoding", v) for v in values)
    if framing == "chunked":
        headers += (("Transfer-Encoding", "chunked"),)
    return Case(headers, codings, framing)


# what the credentialed route must decode (the sandbox gets the scrubbed plaintext)
DECODED: dict[str, Case] = {
    "te-gzip-chunked": _te("gzip, chunked", "gzip"),
    "te-gzip-chunked-tight": _te("gzip,chunked", "gzip"),
    "te-gzip-chunked-case": _te("GZip ,  Chunked", "gzip"),
    "te-gzip-close": _te("gzip", "gzip"),
    "te-deflate-close": _te("deflate", "zlib"),
    "te-deflate-raw-chunked": _te("deflate, chunked", "rawdeflate"),
    "te-identity-close": _te("identity", "identity"),
    "te-gzip-over-ce-br": _te("gzip, chunked", "br", "gzip", ce=(("Content-Encoding", "br"),)),
    "te-deflate-over-ce-gzip-gzip": _te("deflate", "gzip", "gzip", "zlib",
                                        ce=(("Content-Encoding", "gzip, gzip"),)),
    "ce-gzip": _ce(("gzip",), "gzip"),
    "ce-x-gzip": _ce(("x-gzip",), "gzip"),
    "ce-upper": _ce(("GZIP",), "gzip"),
    "ce-deflate-zlib": _ce(("deflate",), "zlib"),
    "ce-deflate-raw": _ce(("deflate",), "rawdeflate"),
    "ce-br": _ce(("br",), "br"),
    "ce-zstd": _ce(("zstd",), "zstd"),
    "ce-gzip-gzip": _ce(("gzip, gzip",), "gzip", "gzip"),
    "ce-gzip-br": _ce(("gzip,br",), "gzip", "br"),
    "ce-two-fields": _ce(("gzip", "br"), "gzip", "br"),
    "ce-identity": _ce(("identity",), "identity"),
    "ce-identity-gzip": _ce(("identity, gzip",), "gzip"),
    "ce-gzip-chunked": _ce(("gzip",), "gzip", framing="chunked"),
    "ce-zstd-chunked": _ce(("zstd",), "zstd", framing="chunked"),
    "ce-br-gzip-chunked": _ce(("br, gzip",), "br", "gzip", framing="chunked"),
}

# what the credentialed route must refuse: egressgate cannot decode it (502 upstream_response_refused)
REFUSED: dict[str, Case] = {
    "te-compress-chunked": _te("compress, chunked", "lzw"),
    "te-compress-close": _te("compress", "lzw"),
    "ce-compress": _ce(("compress",), "lzw"),
    "ce-unknown": _ce(("x-secret-sauce",), "gzip"),
    "ce-gzip-unknown": _ce(("gzip, x-secret-sauce",), "gzip"),
    "ce-unknown-chunked": _ce(("snappy",), "gzip", framing="chunked"),
    "ce-too-deep": _ce(("gzip, gzip, gzip, gzip, gzip, gzip, gzip, gzip, gzip",), *["gzip"] * 9),
}

# what mitmproxy itself refuses before any hook (a 502 the client sees; kept as regression tests)
MITM_REFUSED: dict[str, Case] = {
    "te-unknown": _te("br, chunked", "br"),
    "te-dup": Case((("Transfer-Encoding", "gzip"), ("Transfer-Encoding", "chunked")), ("gzip",), "chunked"),
    "te-and-length": Case((("Transfer-Encoding", "gzip, chunked"), ("Content-Length", "10")), ("gzip",),
                          "chunked"),
}

CASES = {**DECODED, **REFUSED, **MITM_REFUSED}

# heads mitmproxy rejects, echoing the credential in the rejected part: mitmproxy quotes that part in
# its error (the 502 page and flow.error, which the audit records)
MALFORMED = {
    "bad-te": lambda s: f"HTTP/1.1 200 OK\r\nTransfer-Encoding: x-{s}, chunked\r\n\r\n0\r\n\r\n",
    "bad-length": lambda s: f"HTTP/1.1 200 OK\r\nContent-Length: 1{s}\r\n\r\n",
    "bad-line": lambda s: f"HTTP/1.1 200 OK\r\nX-Echo {s}\r\nContent-Length: 0\r\n\r\n",
    "bad-status": lambda s: f"HTTP/1.1 200{s} OK\r\nContent-Length: 0\r\n\r\n",
    "bad-name": lambda s: f"HTTP/1.1 200 OK\r\nX-{s}(: 1\r\nContent-Length: 0\r\n\r\n",
    "bad-te-dup": lambda s: f"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: {s}\r\n\r\n",
    "bad-version": lambda s: f"HTTP/1.{s} 200 OK\r\nContent-Length: 0\r\n\r\n",
    "cut-head": lambda s: f"HTTP/1.1 200 OK\r\nX-Echo: {s}\r\n",
}


def payload(secret: str) -> bytes:
    """The plaintext an echoing upstream sends: the secret raw and base64'd between filler."""
    return b"x" * 300 + b"[" + secret.encode() + b"]" + base64.b64encode(secret.encode()) + b"y" * 300


def chunked(body: bytes, step: int = 37) -> bytes:
    out = [b"%x\r\n%s\r\n" % (len(body[i:i + step]), body[i:i + step]) for i in range(0, len(body), step)]
    return b"".join(out) + b"0\r\n\r\n"


def response_bytes(case: Case, secret: str, head: bool = False, status: str = "200 OK",
                   extra: tuple[tuple[str, str], ...] = (), plain: bytes | None = None) -> bytes:
    body = payload(secret) if plain is None else plain
    for name in case.codings:
        body = ENCODERS[name](body)
    headers = [("Content-Type", "text/plain"), *extra, *case.headers]
    if case.framing == "length":
        headers.append(("Content-Length", str(len(body))))
    elif case.framing == "chunked":
        body = chunked(body)
    if case.framing == "close" or head:
        headers.append(("Connection", "close"))
    blob = f"HTTP/1.1 {status}\r\n".encode() + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers) + b"\r\n"
    return blob if head else blob + body


@dataclass
class Sent:
    path: str
    secret: str
    data: bytes


@dataclass
class RawUpstream:
    port: int = 0
    h2_port: int = 0
    sent: list[Sent] = field(default_factory=list)
    server: asyncio.AbstractServer | None = None
    h2_server: asyncio.AbstractServer | None = None

    async def start(self, ctx: ssl.SSLContext, h2ctx: ssl.SSLContext) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=ctx)
        self.port = self.server.sockets[0].getsockname()[1]
        self.h2_server = await asyncio.start_server(self._serve_h2, "127.0.0.1", 0, ssl=h2ctx)
        self.h2_port = self.h2_server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for server in (self.server, self.h2_server):
            if server is not None:
                server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                req = await read_request_head(reader)
                if req is None:
                    return
                method, path, hdrs = req.method, req.path, req.headers
                auth = hdrs.get("authorization", "")
                secret = auth[7:] if auth.startswith("Bearer ") else hdrs.get("x-echo", "")
                name = path.rsplit("/", 1)[-1].split("?", 1)[0]
                data = self._answer(name, secret, method == "HEAD")
                self.sent.append(Sent(path, secret, data))
                writer.write(data)
                await writer.drain()
                if name in MALFORMED or b"Connection: close" in data.split(b"\r\n\r\n", 1)[0]:
                    return
        finally:
            writer.close()

    @staticmethod
    def _answer(name: str, secret: str, head: bool) -> bytes:
        if name in MALFORMED:  # a head mitmproxy cannot parse, with the echo inside it
            return MALFORMED[name](secret).encode()
        if name == "fold":  # the echo split by an obsolete line fold (RFC 9112 5.2)
            half = len(secret) // 2
            extra = (("X-Echo", f"{secret[:half]}\r\n {secret[half:]}"),)
            return response_bytes(_ce(("identity",), "identity"), "-", extra=extra)
        if name == "bomb":  # 20 KB on the wire (buffered), 20 MiB decoded: over the 16 MiB buffered cap
            return response_bytes(_ce(("gzip",), "gzip"), secret, plain=payload(secret) + b"\0" * (20 << 20))
        if name == "corrupt-chunked":  # a clean gzip member, then one whose deflate data is garbage
            second = gzip.compress(payload(secret))
            bad = gzip.compress(b"x" * 300) + second[:10] + b"\xff" * 64 + second[10:]  # 0xff: invalid block
            return response_bytes(_ce(("gzip",), "identity", framing="chunked"), secret, plain=bad)
        if name == "no-content":
            return response_bytes(_te("gzip, chunked", "gzip"), secret, head=True, status="204 No Content")
        if name == "not-modified":
            return response_bytes(_te("gzip, chunked", "gzip"), secret, head=True, status="304 Not Modified")
        return response_bytes(CASES[name], secret, head=head)

    async def _serve_h2(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """HTTP/2: /te-gzip sends `transfer-encoding: gzip` and a gzip body; /ce-gzip-br the same body
        under `content-encoding: gzip, br` (that one is legal and must be decoded)."""
        import h2.config
        import h2.events

        reqs: dict[int, dict] = {}

        async def on_event(conn, event) -> bool:
            if isinstance(event, h2.events.RequestReceived):
                reqs[event.stream_id] = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h2.events.StreamEnded):
                req = reqs.pop(event.stream_id, {})
                auth = req.get("authorization", "")
                secret = auth[7:] if auth.startswith("Bearer ") else req.get("x-echo", "")
                path = req.get(":path", "")
                body = payload(secret)
                headers = [(":status", "200"), ("content-type", "text/plain")]
                if path.endswith("/te-gzip"):
                    body = gzip.compress(body)
                    headers.append(("transfer-encoding", "gzip"))
                else:
                    body = brotli.compress(gzip.compress(body))
                    headers.append(("content-encoding", "gzip, br"))
                self.sent.append(Sent(path, secret, body))
                conn.send_headers(event.stream_id, headers)
                conn.send_data(event.stream_id, body, end_stream=True)
            return False

        config = h2.config.H2Configuration(client_side=False, validate_outbound_headers=False,
                                           normalize_outbound_headers=False)
        await serve_h2_events(reader, writer, on_event, config)


# ----------------------------------------------------------------------------------- leak detector
def _partial(make, data: bytes) -> bytes:
    """Decode as far as the data allows (a truncated or trailing-garbage stream still shows a leak)."""
    out = []
    with contextlib.suppress(Exception):  # a detector: any failure just ends this attempt
        obj = make()
        for i in range(0, len(data), 64):
            out.append(obj(data[i:i + 64]))
    return b"".join(out)


def _decoders():
    def z(wbits):
        return lambda: zlib.decompressobj(wbits).decompress

    def br():
        return brotli.Decompressor().process

    def zs():
        return zstd.ZstdDecompressor().decompress

    return [z(31), z(15), z(-15), br, zs]


def dechunk(data: bytes) -> bytes:
    out, pos = [], 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return b"".join(out)
        try:
            size = int(data[pos:end].split(b";")[0], 16)
        except ValueError:
            return b"".join(out)
        if size == 0:
            return b"".join(out)
        out.append(data[end + 2:end + 2 + size])
        pos = end + 2 + size + 2


def plaintexts(blob: bytes, depth: int = 10) -> list[bytes]:
    """`blob` and everything any chain of codings (chunked framing included) decodes it to."""
    seen, frontier = [blob], [blob]
    for _ in range(depth):
        nxt = []
        for data in frontier:
            starts = {0, data.find(b"\r\n\r\n") + 4} - {3}
            for start in starts:
                part = data[start:]
                for cand in [dechunk(part)] + [_partial(make, part) for make in _decoders()]:
                    if len(cand) >= 8 and cand not in seen:
                        seen.append(cand)
                        nxt.append(cand)
        frontier = nxt
    return seen


def leak_in(blob: bytes, secret: str) -> bool:
    forms = [secret.encode(), base64.b64encode(secret.encode()).rstrip(b"=")]
    return any(f in p for p in plaintexts(blob) for f in forms)
