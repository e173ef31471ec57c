"""Compressed responses are decoded before scrubbing (or refused when they cannot be)."""

from __future__ import annotations

import gzip
import tracemalloc
import zlib

import brotli
import pytest

from egressgate.broker.decompress import (
    MAX_CODINGS,
    DecodeError,
    UnsupportedEncoding,
    coding_names,
    decoder,
    scrubbing_stream,
    supported,
)
from egressgate.broker.redact import Scrubber

try:
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:
    from backports import zstd  # type: ignore[import-not-found,no-redef]

SECRET = "sk-gz-0123456789abcdefXYZ"
BODY = b'{"echo": {"authorization": "Bearer ' + SECRET.encode() + b'"}, "pad": "' + b"p" * 3000 + b'"}'


def compressors():
    raw_deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    return {
        "gzip": gzip.compress(BODY),
        "x-gzip": gzip.compress(BODY),
        "deflate": zlib.compress(BODY),
        "deflate-raw": raw_deflate.compress(BODY) + raw_deflate.flush(),
        "br": brotli.compress(BODY),
        "zstd": zstd.compress(BODY),
        "gzip, br": brotli.compress(gzip.compress(BODY)),
    }


@pytest.mark.parametrize("name", list(compressors()))
@pytest.mark.parametrize("size", [1, 7, 64, 100000])
def test_decoded_and_scrubbed(name: str, size: int) -> None:
    data = compressors()[name]
    run = scrubbing_stream(name.replace("-raw", ""), Scrubber([SECRET]))
    out = b"".join(run(data[i : i + size]) for i in range(0, len(data), size)) + run(b"")
    assert out == BODY.replace(SECRET.encode(), b"[REDACTED]")


def test_multi_member_gzip_secret_split_between_members() -> None:
    half = len(BODY) // 2 - 1500 + 30  # inside the secret
    data = gzip.compress(BODY[:half]) + gzip.compress(BODY[half:])
    run = scrubbing_stream("gzip", Scrubber([SECRET]))
    out = b"".join(run(data[i : i + 5]) for i in range(0, len(data), 5)) + run(b"")
    assert SECRET.encode() not in out and out.count(b"[REDACTED]") == 1


@pytest.mark.parametrize("enc", ["compress", "exi", "pack200-gzip", "gzip, bogus"])
def test_unknown_encoding_is_refused(enc: str) -> None:
    with pytest.raises(UnsupportedEncoding):
        decoder(enc)


def test_identity_and_none_pass_through() -> None:
    for enc in (None, "", "identity"):
        d = decoder(enc)
        assert d(b"abc") + d(b"") == b"abc"
    assert {"gzip", "deflate", "br", "zstd"} <= set(supported())


def test_corrupt_and_bomb() -> None:
    with pytest.raises(DecodeError):
        decoder("gzip")(b"\x1f\x8b\x08\x00garbage-garbage")
    bomb = gzip.compress(b"\0" * 10_000_000)
    d = decoder("gzip", max_output=1_000_000)
    with pytest.raises(DecodeError, match="exceeds"):
        for i in range(0, len(bomb), 1024):
            d(bomb[i : i + 1024])


ENCODE = {"gzip": gzip.compress, "br": brotli.compress, "zstd": zstd.compress}


@pytest.mark.parametrize("outer", ["gzip", "br", "zstd"])
@pytest.mark.parametrize("inner", ["gzip", "br", "zstd"])
def test_nested_bomb_refused_before_it_inflates(inner: str, outer: str) -> None:
    """`Content-Encoding: <inner>, <outer>` over 32 MiB of zeros is a few hundred bytes on the wire. The
    cap holds per stage while decoding: no stage materialises much more than `max_output` (a check on
    the final output alone would come after the inner stage had inflated all 32 MiB at once)."""
    data = ENCODE[outer](ENCODE[inner](b"\0" * (32 << 20)))
    assert len(data) < 100_000
    tracemalloc.start()
    try:
        d = decoder(f"{inner}, {outer}", max_output=1 << 20)
        with pytest.raises(DecodeError, match="exceeds"):
            d(data)
            d(b"")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    # control: the same body under a cap it fits in decodes whole
    d = decoder(f"{inner}, {outer}", max_output=40 << 20)
    assert len(d(data) + d(b"")) == 32 << 20


def test_one_chunk_may_not_inflate_beyond_max_step() -> None:
    bomb = gzip.compress(b"\0" * (8 << 20))
    with pytest.raises(DecodeError, match="one chunk"):
        decoder("gzip", max_output=None, max_step=1 << 20)(bomb)
    d = decoder("gzip", max_output=None, max_step=1 << 20)  # control: small reads stay under the step
    assert sum(len(d(bomb[i:i + 512])) for i in range(0, len(bomb), 512)) + len(d(b"")) == 8 << 20


def test_more_than_max_codings_refused() -> None:
    assert decoder(", ".join(["gzip"] * MAX_CODINGS))(b"") == b""
    with pytest.raises(UnsupportedEncoding):
        decoder(", ".join(["gzip"] * (MAX_CODINGS + 1)))
    assert coding_names(["GZip ", " identity", "", "br"]) == ["gzip", "br"]


@pytest.mark.parametrize("name", ["gzip", "deflate", "deflate-raw", "br", "zstd", "gzip, br"])
def test_truncated_body_is_an_error(name: str) -> None:
    """A body that stops inside a compressed stream is corrupt, not complete (the decoder used to
    accept it silently); an empty body under a coding is fine."""
    data = compressors()[name]
    enc = name.replace("-raw", "")
    for cut in (1, len(data) // 2, len(data) - 1):
        d = decoder(enc)
        with pytest.raises(DecodeError, match=r"truncated|corrupt"):
            d(data[:cut])
            d(b"")
    d = decoder(enc)
    assert d(b"") == b""
