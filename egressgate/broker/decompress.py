"""Incremental decoding of compressed response bodies, so the scrubber sees plaintext.

A secret inside a gzip stream is invisible to byte matching. The gateway asks for
`Accept-Encoding: identity` on credentialed requests, but an upstream may compress anyway (as a
Content-Encoding or as a Transfer-Encoding such as `gzip, chunked`); then the body is decoded here chunk
by chunk and forwarded *decoded* (the caller fixes the framing headers), or, for a coding we cannot
decode, `UnsupportedEncoding` tells the caller to refuse the response (fail closed; never forward bytes
we could not inspect).

Decompression bombs: every stage is driven with an output cap (zlib/zstd `max_length`, brotli
`output_buffer_limit`), so no stage ever materialises more than its cap: each stage may produce at most
`max_output` bytes over the whole body and at most `max_step` bytes per input chunk. The per-stage
bound matters for nested codings (`gzip, gzip`): the inner stage of a nested bomb multiplies the outer
one's expansion, and a check on the final output alone would come after the memory was spent.

A body that ends inside a compressed stream (truncated, or garbage the decoder kept waiting on) is a
DecodeError too: what was forwarded was still decoded and scrubbed, but the client must not take a
cut body for a complete one.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

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
MAX_CODINGS = 4  # stacked codings decoded at most (no real server stacks more; each one costs a pass)
MAX_STEP = 128 << 20  # bytes one stage may produce from one input chunk (a 64 KiB deflate read is <= 66 MB)


class UnsupportedEncoding(ValueError):
    """A coding we cannot decode (or too many of them): refuse the response (the body cannot be scrubbed)."""

    def __init__(self, encoding: str) -> None:
        super().__init__(f"cannot decode coding {encoding!r}; response refused")
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
        self.started = False

    def __call__(self, data: bytes, room: int) -> bytes:
        """Decode `data` (b"": the end), producing at most `room + 1` bytes (more than `room` = bomb)."""
        if not data:
            if self.obj is None:
                if self.pending:
                    raise DecodeError("truncated deflate body")
                return b""
            tail = self.obj.flush()
            if self.started and not self.obj.eof:
                raise DecodeError("truncated compressed body")
            return tail
        self.started = True
        if self.obj is None:  # deflate: sniff the zlib header (RFC 1950) on the first two bytes
            self.pending += data
            if len(self.pending) < 2:
                return b""
            cmf, flg = self.pending[0], self.pending[1]
            wrapped = cmf & 0x0F == 8 and (cmf * 256 + flg) % 31 == 0
            self.obj = zlib.decompressobj(15 if wrapped else -15)
            data, self.pending = self.pending, b""
        out = bytearray()
        try:
            while data and len(out) <= room:
                out += self.obj.decompress(data, room + 1 - len(out))  # max_length >= 1: never "unlimited"
                if self.obj.unconsumed_tail:
                    data = self.obj.unconsumed_tail
                elif self.obj.eof and self.gzip and self.obj.unused_data:  # the next gzip member
                    data = self.obj.unused_data
                    self.obj = zlib.decompressobj(31)
                else:
                    data = b""
        except zlib.error as exc:
            raise DecodeError(f"corrupt compressed body: {exc}") from None
        return bytes(out)


class _Brotli:
    def __init__(self) -> None:
        self.obj = brotli.Decompressor()
        self.started = False

    def __call__(self, data: bytes, room: int) -> bytes:
        out = bytearray()
        try:
            if data:
                self.started = True
                out += self.obj.process(data, output_buffer_limit=room + 1)
            while len(out) <= room and not self.obj.can_accept_more_data():  # output still pending
                out += self.obj.process(b"", output_buffer_limit=room + 1 - len(out))
        except brotli.error as exc:
            raise DecodeError(f"corrupt brotli body: {exc}") from None
        if not data and self.started and len(out) <= room and not self.obj.is_finished():
            raise DecodeError("truncated brotli body")
        return bytes(out)


class _Zstd:
    def __init__(self) -> None:
        self.obj = zstd.ZstdDecompressor()
        self.fresh = True  # at a frame boundary: the body may end here

    def __call__(self, data: bytes, room: int) -> bytes:
        final = not data
        out = bytearray()
        try:
            while len(out) <= room:
                self.fresh = self.fresh and not data
                out += self.obj.decompress(data, room + 1 - len(out))
                data = b""
                if self.obj.eof:  # a new frame may follow
                    data = self.obj.unused_data
                    self.obj, self.fresh = zstd.ZstdDecompressor(), True
                    if not data:
                        break
                elif self.obj.needs_input:
                    break
        except zstd.ZstdError as exc:
            raise DecodeError(f"corrupt zstd body: {exc}") from None
        if final and not self.fresh and len(out) <= room:
            raise DecodeError("truncated zstd body")
        return bytes(out)


def _one(name: str) -> Callable[[bytes, int], bytes]:
    if name in ("gzip", "x-gzip"):
        return _Zlib(gzip=True)
    if name == "deflate":
        return _Zlib(gzip=False)
    if name == "br" and brotli is not None:
        return _Brotli()
    if name == "zstd" and zstd is not None:
        return _Zstd()
    raise UnsupportedEncoding(name)


def coding_names(value: str | Iterable[str] | None) -> list[str]:
    """The codings a header value (or several field values) lists, in the order they were applied:
    lower-cased, whitespace and empty list members dropped, `identity` (no coding) removed."""
    if value is None:
        return []
    joined = value if isinstance(value, str) else ",".join(value)
    names = [n.strip(" \t").lower() for n in joined.split(",")]
    return [n for n in names if n and n != "identity"]


def decoder(content_encoding: str | Iterable[str] | None, max_output: int | None = None,
            max_step: int = MAX_STEP) -> Codec:
    """A streaming decoder for a list of codings (a Content-Encoding value, or the names in the order
    they were applied): undone in reverse. Call with each chunk, then b"" to flush. Raises
    UnsupportedEncoding up front; DecodeError when data is corrupt or a stage would produce more than
    `max_output` bytes in all or `max_step` bytes from one chunk (checked as it decodes, not after)."""
    names = coding_names(content_encoding)
    if len(names) > MAX_CODINGS:
        raise UnsupportedEncoding(", ".join(names))
    stages = [_one(n) for n in reversed(names)]
    produced = [0] * len(stages)
    total = max_output if max_output is not None else float("inf")

    def step(i: int, data: bytes) -> bytes:
        room = int(min(max_step, total - produced[i]))
        out = stages[i](data, room)
        produced[i] += len(out)
        if len(out) > room:
            if produced[i] > total:
                raise DecodeError(f"decoded body exceeds {max_output} bytes")
            raise DecodeError(f"one chunk decoded to more than {max_step} bytes")
        return out

    def run(chunk: bytes) -> bytes:
        final = chunk == b""
        data = chunk
        for i in range(len(stages)):
            # b"" means "flush" to a stage: only the final call may send it
            data = (step(i, data) if data else b"") + (step(i, b"") if final else b"")
        return data

    return run


def scrubbing_stream(content_encoding: str | Iterable[str] | None, scrubber: Scrubber,
                     max_output: int | None = None) -> Codec:
    """`flow.response.stream` callable: decode, then scrub. Output is the *decoded* body: the caller
    must remove Content-Encoding and Content-Length (and a coded Transfer-Encoding) from the headers."""
    decode = decoder(content_encoding, max_output)
    scrub = scrubber.stream()

    def run(chunk: bytes) -> bytes:
        if chunk == b"":
            return scrub(decode(b"")) + scrub(b"")
        plain = decode(chunk)
        return scrub(plain) if plain else b""

    return run
