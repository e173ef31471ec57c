"""The incremental SSE decoder: the same events whatever the network's chunking, every line-ending
style, comments and multi-line data, and a bound on what one event may hold."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressgate.mcp.sse import SseDecoder, SseEvent, SseMalformed, comment, encode

STREAM = (b": keep-alive\r\n"
          b"event: message\r\n"
          b"id: 1\r\n"
          b'data: {"jsonrpc":"2.0","id":1,"result":{}}\r\n'
          b"\r\n"
          b"data: line one\r"
          b"data:line two\n"
          b"retry: 1500\n"
          b"\n"
          b"event: endpoint\n"
          b"data: /messages?session_id=abc\n\n"
          b"id: only-an-id\n\n"  # no data: not dispatched
          b"data: last\n\n")
EXPECTED = [
    SseEvent(data=b'{"jsonrpc":"2.0","id":1,"result":{}}', event="message", id="1"),
    SseEvent(data=b"line one\nline two", retry=1500),
    SseEvent(data=b"/messages?session_id=abc", event="endpoint"),
    SseEvent(data=b"last"),
]


def decode_in(chunks: list[bytes], **kw) -> tuple[list[SseEvent], SseDecoder]:
    dec = SseDecoder(**kw)
    out: list[SseEvent] = []
    for chunk in chunks:
        out.extend(dec.feed(chunk))
    return out, dec


def test_whole_stream() -> None:
    events, dec = decode_in([STREAM])
    assert events == EXPECTED
    assert dec.comments == 1 and not dec.pending


@pytest.mark.parametrize("cut", range(len(STREAM) + 1))
def test_split_at_every_byte_offset(cut: int) -> None:
    events, _ = decode_in([STREAM[:cut], STREAM[cut:]])
    assert events == EXPECTED


def test_one_byte_at_a_time() -> None:
    events, _ = decode_in([STREAM[i:i + 1] for i in range(len(STREAM))])
    assert events == EXPECTED


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_chunking(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(STREAM)]
    events, _ = decode_in([STREAM[a:b] for a, b in itertools.pairwise(points)])
    assert events == EXPECTED


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b), min_size=1,
                max_size=5), st.sampled_from([b"\n", b"\r", b"\r\n"]), st.data())
def test_encoder_roundtrip_with_every_line_ending(lines: list[bytes], eol: bytes, data) -> None:
    payload = b"\n".join(lines)
    wire = encode(payload, event="message", id="7").replace(b"\n", eol)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    points = [0, *cuts, len(wire)]
    events, _ = decode_in([wire[a:b] for a, b in itertools.pairwise(points)])
    assert events == [SseEvent(data=payload, id="7")]


def test_cr_at_chunk_end_then_lf_is_one_line_end() -> None:
    # "data: a\r" | "\n\r\n": CRLF split over two chunks must not count as two line ends (an empty line
    # would dispatch early); then a real blank line dispatches
    events, _ = decode_in([b"data: a\r", b"\ndata: b\r\n\r\n"])
    assert events == [SseEvent(data=b"a\nb")]
    events, _ = decode_in([b"data: a\r", b"\r"])  # CR CR: line end, then a blank line
    assert events == [SseEvent(data=b"a")]


def test_bom_at_start_only() -> None:
    events, _ = decode_in([b"\xef\xbb", b"\xbfdata: x\n\n"])
    assert events == [SseEvent(data=b"x")]
    events, _ = decode_in([b"data: x\n\n\xef\xbb\xbfdata: y\n\n"])
    assert events == [SseEvent(data=b"x")]  # a BOM later is part of a field name, not "data"


def test_truncated_event_is_pending_not_dispatched() -> None:
    events, dec = decode_in([b"data: complete\n\ndata: cut"])
    assert events == [SseEvent(data=b"complete")] and dec.pending
    events, dec = decode_in([b"data: complete\n\ndata: cut\n"])
    assert dec.pending


def test_event_size_is_bounded_across_lines_and_unterminated_lines() -> None:
    dec = SseDecoder(max_event_bytes=100)
    dec.feed(b"data: " + b"a" * 60 + b"\n")
    with pytest.raises(SseMalformed) as info:
        dec.feed(b"data: " + b"b" * 60 + b"\n")
    assert info.value.detail == "event_too_large"
    dec = SseDecoder(max_event_bytes=100)
    with pytest.raises(SseMalformed):
        dec.feed(b"data: " + b"c" * 200)  # no line end ever comes: still bounded
    ok = SseDecoder(max_event_bytes=100)  # positive control: events under the bound, many of them
    for _ in range(50):
        assert ok.feed(b"data: " + b"d" * 80 + b"\n\n") == [SseEvent(data=b"d" * 80)]


def test_non_utf8_event_name_refused() -> None:
    with pytest.raises(SseMalformed):
        SseDecoder().feed(b"event: \xff\ndata: x\n\n")


def test_encode_refuses_line_breaks_in_fields_and_splits_data() -> None:
    with pytest.raises(ValueError):
        encode(b"x", event="message\ndata: injected")
    wire = encode(b"a\r\nevent: fake\rb")
    events, _ = decode_in([wire])
    assert events == [SseEvent(data=b"a\nevent: fake\nb")]
    assert comment("ping") == b":ping\n\n" and decode_in([comment("ping")])[0] == []
