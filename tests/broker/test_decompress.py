"""Compressed responses are decoded before scrubbing (or refused when they cannot be)."""

from __future__ import annotations

import gzip
import zlib

import brotli
import pytest

from egressgate.broker.decompress import (
    DecodeError,
    UnsupportedEncoding,
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
