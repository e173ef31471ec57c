"""Scrubbing every encoding of an injected value, whole and streamed, split at any offset.

The leak check is independent of the scrubber's own pattern list: it decodes what came out (base64 runs
at every alignment, percent-decoding, JSON unescaping) and looks for the secret.
"""

from __future__ import annotations

import base64
import json
import re
from urllib.parse import quote, quote_plus

from hypothesis import given, settings
from hypothesis import strategies as st

from egressgate.broker.redact import REPLACEMENT, Scrubber, SecretSpec
from tests.support.leaks import leaks

SECRET = 'sk-live/Ab+cd=ef&gh%20ij"k\\l:é€'
USER = "svc"


def forms(secret: str, user: str) -> list[bytes]:
    raw = secret.encode()
    blob = b'{"token": "' + raw + b'", "n": 1}'
    return [
        raw,
        base64.b64encode(raw),
        base64.urlsafe_b64encode(raw).rstrip(b"="),
        base64.b64encode(f"{user}:{secret}".encode()),
        quote(secret, safe="").encode(),
        re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(secret, safe="")).encode(),
        quote_plus(secret).encode(),
        json.dumps(secret)[1:-1].encode(),
        json.dumps(secret, ensure_ascii=False)[1:-1].encode(),
        base64.b64encode(blob),  # the secret inside a larger base64 document
        base64.b64encode(b"x" + blob),
        base64.b64encode(b"xy" + blob),
    ]


def test_leak_checker_sees_every_form() -> None:
    # positive control: without scrubbing, each form is detected as a leak
    for f in forms(SECRET, USER):
        assert leaks(b"<<" + f + b">>", SECRET), f


def test_scrub_every_form_whole() -> None:
    s = Scrubber([SecretSpec(SECRET, USER)])
    for f in forms(SECRET, USER):
        out = s.scrub(b"before " + f + b" after")
        assert not leaks(out, SECRET), f
        assert out.startswith(b"before ") and REPLACEMENT in out


def test_headers_location_and_set_cookie() -> None:
    s = Scrubber([SecretSpec(SECRET, USER)])
    b64pair = base64.b64encode(f"{USER}:{SECRET}".encode()).decode()
    headers = [
        ("Location", f"https://cb.example.test/done?token={quote(SECRET, safe='')}&x=1"),
        ("Set-Cookie", f"auth={b64pair}; Path=/; HttpOnly"),
        ("X-Echo-Authorization", f"Bearer {SECRET}"),
        ("Content-Type", "application/json"),
    ]
    out = s.scrub_headers(headers)
    assert out[3] == headers[3]
    assert out[0][1].startswith("https://cb.example.test/done?token=[REDACTED]&x=1")
    assert out[1][1] == "auth=[REDACTED]; Path=/; HttpOnly"
    for _, v in out:
        assert not leaks(v.encode(), SECRET)


def test_every_split_offset_of_every_form() -> None:
    s = Scrubber([SecretSpec(SECRET, USER)])
    body = b"HEAD|" + b"|".join(forms(SECRET, USER)) + b"|TAIL"
    whole = s.scrub(body)
    assert not leaks(whole, SECRET)
    for cut in range(len(body) + 1):
        stream = s.stream()
        out = b"".join(stream(c) for c in (body[:cut], body[cut:]) if c) + stream(b"")
        assert out == whole, cut


def test_byte_by_byte_stream() -> None:
    s = Scrubber([SecretSpec(SECRET, USER)])
    body = b"a" + b"b".join(forms(SECRET, USER)) * 2
    stream = s.stream()
    out = b"".join(stream(body[i : i + 1]) for i in range(len(body))) + stream(b"")
    assert out == s.scrub(body) and not leaks(out, SECRET)


def test_overlapping_and_adjacent_secrets() -> None:
    a, b = "AAAAAAAAAABBBBBBBBBB", "BBBBBBBBBBCCCCCCCCCC"
    s = Scrubber([a, b])
    body = b"x" + a.encode() + b"CCCCCCCCCC" + a.encode() + a.encode() + b"y"
    whole = s.scrub(body)
    assert whole == b"x[REDACTED]y"
    for cut in range(len(body) + 1):
        st_ = s.stream()
        assert b"".join(st_(c) for c in (body[:cut], body[cut:]) if c) + st_(b"") == whole


def test_clean_body_passes_unchanged_and_stream_finishes() -> None:
    s = Scrubber([SECRET])
    stream = s.stream()
    body = bytes(range(256)) * 20
    out = b"".join(stream(body[i : i + 97]) for i in range(0, len(body), 97)) + stream(b"")
    assert out == body
    assert stream(b"more") == b""  # after the end marker nothing more is emitted


secrets_st = st.text(alphabet=st.sampled_from('abcXYZ019/+=&%?" \\:_-.~é€\u2028'), min_size=8, max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    secret=secrets_st,
    user=st.from_regex(r"[a-z]{1,8}", fullmatch=True),
    filler=st.lists(st.binary(max_size=40), min_size=13, max_size=13),
    cuts=st.lists(st.integers(0, 5000), max_size=8),
)
def test_property_stream_equals_whole_and_nothing_leaks(secret, user, filler, cuts) -> None:
    s = Scrubber([SecretSpec(secret, user)])
    parts = forms(secret, user)
    body = b"".join(f + p for f, p in zip(filler, [*parts, b""], strict=False))
    points = sorted({c % (len(body) + 1) for c in cuts})
    chunks = [body[x:y] for x, y in zip([0, *points], [*points, len(body)], strict=True)]
    stream = s.stream()
    out = b"".join(stream(c) for c in chunks if c) + stream(b"")
    assert out == s.scrub(body)
    assert not leaks(out, secret)


def test_header_named_after_a_secret_is_dropped() -> None:
    s = Scrubber([SECRET])
    out = s.scrub_headers([(f"X-{quote(SECRET, safe='')}", "1"), ("X-Ok", "2")])
    assert out == [("X-Ok", "2")]


def test_cached_scrubber_is_shared_per_secret_set() -> None:
    from egressgate.broker.redact import cached_scrubber

    a = cached_scrubber(SecretSpec(SECRET, USER))
    assert cached_scrubber(SecretSpec(SECRET, USER)) is a
    assert cached_scrubber(SecretSpec(SECRET)) is not a
    assert not leaks(a.scrub(base64.b64encode(f"{USER}:{SECRET}".encode())), SECRET)
