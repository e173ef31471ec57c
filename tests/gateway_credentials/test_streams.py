"""The stream callables on their own: every split offset, the mitmproxy contract (no empty non-final
chunk: it would terminate an HTTP/1 chunked body), no phantom byte released before detection."""

from __future__ import annotations

import gzip

from egressgate.broker.inject import phantom_value
from egressgate.broker.redact import Scrubber
from egressgate.gateway.shared.credential_streams import phantom_guard, replace_body, scrub_chain

SECRET = "sk-live-0123456789abcdefghij"


def _feed(fn, chunks: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for c in [*chunks, b""]:
        got = fn(c)
        parts = [got] if isinstance(got, bytes) else list(got)
        assert all(p for p in parts), "an empty chunk would end a chunked body early"
        out += parts
    return out


def test_phantom_guard_passes_clean_bodies_through_the_counter_unchanged() -> None:
    body = bytes(range(256)) * 20
    counted: list[int] = []

    def counter(chunk: bytes) -> object:
        counted.append(len(chunk))
        return [chunk] if chunk else []

    for step in (1, 7, 52, 53, 100, 4096):
        counted.clear()
        guard = phantom_guard(counter, lambda hits: (_ for _ in ()).throw(AssertionError(hits)))
        out = _feed(guard, [body[i:i + step] for i in range(0, len(body), step)])
        assert b"".join(out) == body and sum(counted) == len(body)


def test_phantom_guard_never_releases_a_phantom_byte() -> None:
    phantom = phantom_value().encode()
    body = b"a" * 70 + b'{"key":"' + phantom + b'"}' + b"z" * 70
    start = body.index(phantom)
    for cut in range(1, len(body)):
        for second in (cut + 1, cut + 17, len(body)):
            chunks = [body[:cut], body[cut:second], body[second:]]
            hits: list = []
            out = b"".join(_feed(phantom_guard(None, hits.extend), [c for c in chunks if c]))
            assert hits, (cut, second)
            assert len(out) <= start, (cut, second)  # nothing from the phantom's first byte on


def test_scrub_chain_equals_whole_body_scrub_at_every_split() -> None:
    scrubber = Scrubber([SECRET])
    body = b"x" * 40 + SECRET.encode() + b"|" + SECRET.encode()[:5] + b"y" * 40
    expected = scrubber.scrub(body)
    assert SECRET.encode() not in expected
    for cut in range(len(body) + 1):
        chain = scrub_chain(None, None, scrubber, None, lambda e: None)
        assert b"".join(_feed(chain, [c for c in (body[:cut], body[cut:]) if c])) == expected


def test_scrub_chain_decodes_gzip_split_anywhere_and_kills_on_corruption() -> None:
    scrubber = Scrubber([SECRET])
    plain = b"head " + SECRET.encode() + b" tail" * 50
    z = gzip.compress(plain)
    for cut in range(1, len(z), 3):
        chain = scrub_chain(None, "gzip", scrubber, None, lambda e: None)
        assert b"".join(_feed(chain, [z[:cut], z[cut:]])) == scrubber.scrub(plain)
    errors: list = []
    chain = scrub_chain(None, "gzip", scrubber, None, errors.append)
    out = _feed(chain, [z[:20], b"\x00garbage" * 10, z[20:]])
    assert errors and SECRET.encode() not in b"".join(out)
    errors.clear()
    bomb = gzip.compress(b"\0" * 1_000_000)
    chain = scrub_chain(None, "gzip", scrubber, 10_000, errors.append)
    assert len(b"".join(_feed(chain, [bomb]))) <= 10_000 and errors


def test_replace_body_swallows_everything_and_emits_once() -> None:
    fn = replace_body(b'{"error":"x"}')
    assert _feed(fn, [b"upstream " + SECRET.encode(), b"more"]) == [b'{"error":"x"}']


def test_phantom_guard_holds_back_only_from_a_byte_a_phantom_can_start_with() -> None:
    """Bytes no phantom (raw `egph_…` or any escape: `%`, `\\`, `&`) can start at go out at once: a
    budget counter behind the guard sees them (a stream cut for its budget has them spent)."""
    guard = phantom_guard(None, lambda hits: (_ for _ in ()).throw(AssertionError(hits)))
    assert b"".join(guard(b"x" * 1000)) == b"x" * 1000  # nothing held
    assert b"".join(guard(b"y" * 10 + b"%z" + b"w" * 20)) == b"y" * 10  # held from the `%` on
    assert b"".join(guard(b"q" * 700)) == b"%z" + b"w" * 20 + b"q" * 700  # beyond any phantom's length


def test_phantom_guard_never_releases_an_escaped_phantom_byte() -> None:
    phantom = phantom_value()
    forms = {
        "json": "".join(f"\\u{ord(c):04x}" if i % 3 == 0 else c for i, c in enumerate(phantom)).encode(),
        "html": "".join(f"&#{ord(c)};" if i % 2 == 0 else c for i, c in enumerate(phantom)).encode(),
        "percent": "".join(f"%{ord(c):02X}" if i % 4 == 1 else c for i, c in enumerate(phantom)).encode(),
    }
    for name, escaped in forms.items():
        body = b"e%&\\ " * 30 + b'{"key":"' + escaped + b'"}' + b"z" * 40
        start = body.index(escaped)
        for cut in range(1, len(body), 5):
            hits: list = []
            out = b"".join(_feed(phantom_guard(None, hits.extend), [body[:cut], body[cut:]]))
            assert hits, (name, cut)
            assert len(out) <= start, (name, cut)
