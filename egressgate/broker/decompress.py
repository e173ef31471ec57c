"""Incremental decoding of compressed response bodies, so the scrubber sees plaintext.

A secret inside a gzip stream is invisible to byte matching. The gateway asks for
`Accept-Encoding: identity` on credentialed requests, but an upstream may compress anyway; then the body
is decoded here chunk by chunk and forwarded *decoded* (the caller drops Content-Encoding and
Content-Length), or, for an encoding we cannot decode, `UnsupportedEncoding` tells the caller to refuse
the response (fail closed; never forward bytes we could not inspect).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from egressgate.broker.redact import Scrubber

try:
    import brotli  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - optional
    brotli = None
try:
    from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14
except ImportError:  # pragma: no cover - depends on the interpreter
    try:
        from backports import zstd  # type: ignore[import-not-found,no-redef]
    except ImportError:
        zstd = None

Codec = Callable[[bytes], bytes]


class UnsupportedEncoding(ValueError):
    """Content-Encoding we cannot decode: refuse the response (the body cannot be scrubbed)."""

    def __init__(self, encoding: str) -> None:
        super().__init__(f"cannot decode Content-Encoding {encoding!r}; response refused")
        self.encoding = encoding


class DecodeError(ValueError):
    """Corrupt compressed data, or more output than allowed (decompression bomb)."""


def supported() -> tuple[str, ...]:
    names = ["gzip", "x-gzip", "deflate"]
    if brotli is not None:
        names.append("br")
    if zstd is not None:
        names.append("zstd")
    return tuple(names)


class _Zlib:
    """gzip (multi-member) and deflate (zlib-wrapped or, as some servers send it, raw)."""

    def __init__(self, gzip: bool) -> None:
        self.gzip = gzip
        self.obj: zlib._Decompress | None = zlib.decompressobj(31) if gzip else None
        self.pending = b""

    def __call__(self, chunk: bytes) -> bytes:
        if not chunk:
            return self.obj.flush() if self.obj is not None else b""
        if self.obj is None:  # deflate: sniff the zlib header (RFC 1950) on the first two bytes
            self.pending += chunk
            if len(self.pending) < 2:
                return b""
            cmf, flg = self.pending[0], self.pending[1]
            wrapped = cmf & 0x0F == 8 and (cmf * 256 + flg) % 31 == 0
            self.obj = zlib.decompressobj(15 if wrapped else -15)
            chunk, self.pending = self.pending, b""
        out = []
        try:
            while chunk:
                out.append(self.obj.decompress(chunk))
                if self.obj.eof and self.gzip and self.obj.unused_data:
                    chunk = self.obj.unused_data
                    self.obj = zlib.decompressobj(31)
                else:
                    chunk = b""
        except zlib.error as exc:
            raise DecodeError(f"corrupt compressed body: {exc}") from None
        return b"".join(out)


class _Brotli:
    def __init__(self) -> None:
        self.obj = brotli.Decompressor()

    def __call__(self, chunk: bytes) -> bytes:
        if not chunk:
            return b""
        try:
            return self.obj.process(chunk)
        except brotli.error as exc:
            raise DecodeError(f"corrupt brotli body: {exc}") from None


class _Zstd:
    def __init__(self) -> None:
        self.obj = zstd.ZstdDecompressor()

    def __call__(self, chunk: bytes) -> bytes:
        out = []
        try:
            while chunk:
                out.append(self.obj.decompress(chunk))
                if self.obj.eof:  # a new frame may follow
                    chunk = self.obj.unused_data
                    self.obj = zstd.ZstdDecompressor()
                else:
                    chunk = b""
        except zstd.ZstdError as exc:
            raise DecodeError(f"corrupt zstd body: {exc}") from None
        return b"".join(out)


def _one(name: str) -> Codec:
    if name in ("gzip", "x-gzip"):
        return _Zlib(gzip=True)
    if name == "deflate":
        return _Zlib(gzip=False)
    if name == "br" and brotli is not None:
        return _Brotli()
    if name == "zstd" and zstd is not None:
        return _Zstd()
    raise UnsupportedEncoding(name)


def decoder(content_encoding: str | None, max_output: int | None = None) -> Codec:
    """A streaming decoder for a Content-Encoding header value (codings applied in listed order are
    undone in reverse). Call with each chunk, then b"" to flush. Raises UnsupportedEncoding up front."""
    names = [n.strip().lower() for n in (content_encoding or "").split(",") if n.strip()]
    names = [n for n in names if n != "identity"]
    stages = [_one(n) for n in reversed(names)]
    produced = 0

    def run(chunk: bytes) -> bytes:
        nonlocal produced
        final = chunk == b""
        data = chunk
        for stage in stages:
            # b"" means "flush" to a stage: only the final call may send it
            data = (stage(data) if data else b"") + (stage(b"") if final else b"")
        produced += len(data)
        if max_output is not None and produced > max_output:
            raise DecodeError(f"decoded body exceeds {max_output} bytes")
        return data

    return run


def scrubbing_stream(content_encoding: str | None, scrubber: Scrubber, max_output: int | None = None) -> Codec:
    """`flow.response.stream` callable: decode, then scrub. Output is the *decoded* body: the caller
    must remove Content-Encoding and Content-Length from the response headers."""
    decode = decoder(content_encoding, max_output)
    scrub = scrubber.stream()

    def run(chunk: bytes) -> bytes:
        if chunk == b"":
            return scrub(decode(b"")) + scrub(b"")
        plain = decode(chunk)
        return scrub(plain) if plain else b""

    return run
