"""A secret reflected with ANY SUBSET of its characters escaped (JSON `\\u0065` / `\\/`, partial
percent-encoding `s%65cret`, HTML `&#101;` `&#x65;` `&#X65;`, zero-padded, `;`-less, named) is scrubbed,
whole and streamed at every split; innocent escapes are left alone.

The mixed forms come from tests/support/mixed.py and the leak check from tests/support/leaks.py (both
written from the decoders' specifications, not from the scrubber). Each test first shows the form
carries the secret (the sandbox would recover it by decoding), then that nothing of it comes out.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressgate.broker.escapes import MAX_REF_DIGITS
from egressgate.broker.redact import REPLACEMENT, Scrubber, SecretSpec
from egressgate.mcp.records import redact_arguments
from tests.support.leaks import leaks
from tests.support.mixed import EVERY, HTML, JSON, URL, mixed, mixed_at_random

SPECIAL = 'sk-live/Ab+cd=ef&gh%20ij"k\\l:é€𝄞 x1'  # escape introducers, non-ASCII, non-BMP (surrogates)
PLAIN = 'sk-live/Ab+cd=ef:é€𝄞 x1"'  # every style mixed: no bare introducer to be ambiguous about
TOKEN = "sk-kv-Q3_9xZ-bT7uVw0aLmN2pRsY8cD1e"

CASES = [(SPECIAL, styles, off) for styles in (JSON, HTML, URL) for off in range(len(styles))]
CASES += [(PLAIN, EVERY, off) for off in range(len(EVERY))]
CASES += [(TOKEN, styles, off) for styles in (JSON, HTML, URL, EVERY) for off in range(3)]


@pytest.mark.parametrize(("secret", "styles", "off"), CASES)
def test_mixed_escapes_scrubbed_whole(secret: str, styles: tuple[str, ...], off: int) -> None:
    form = mixed(secret, styles, off).encode()
    assert secret.encode() not in form and leaks(form, secret), form  # positive control: it decodes back
    out = Scrubber([SecretSpec(secret, "svc")]).scrub(b"<p>before " + form + b" after</p>")
    assert out == b"<p>before " + REPLACEMENT + b" after</p>", out
    assert not leaks(out, secret)


@pytest.mark.parametrize("form", [
    "s\\u0065cret-VALUE/42", "s\\u0065cr\\u0065t-VALUE/42", "secret-VALU\\u0045\\/42",
    "s%65cret-VALUE/42", "s%65cret-VALUE%2f42", "secret%2DVALUE%2F42", "s&#101;cret-VALUE/42",
    "s&#x65;cret-VALUE/42", "s&#X65;cret-VALUE/42", "s&#0000101;cret-VALUE/42", "s&#x0065;cret-VALUE/42",
    "secret-VALU&#x45/42",
    "s&#101cret-VALUE&sol;42", "secret&#45;VALUE&#x2F;&#52;2", "\\u0073ecret-VALUE/42",
])
def test_each_escape_named_in_the_report(form: str) -> None:
    secret = "secret-VALUE/42"
    assert secret.encode() not in form.encode() and leaks(form.encode(), secret)
    s = Scrubber([secret])
    assert s.scrub(b"x=" + form.encode() + b";") == b"x=" + REPLACEMENT + b";"


def test_surrogate_pairs_in_either_case() -> None:
    secret = "tok-𝄞-😀-end"
    for form in ("tok-\\ud834\\udd1e-\\uD83D\\uDE00-end", "tok-\\uD834\\uDD1E-😀-\\u0065nd",
                 "tok-&#119070;-&#x1F600;-end", "tok-%F0%9D%84%9E-%f0%9f%98%80-end"):
        assert leaks(form.encode(), secret)
        assert Scrubber([secret]).scrub(form.encode()) == REPLACEMENT, form


def test_split_at_every_offset_equals_whole() -> None:
    s = Scrubber([SecretSpec(SPECIAL, "svc")])
    body = b"HEAD|" + b"|".join(mixed(SPECIAL, st_, 1).encode() for st_ in (JSON, HTML, URL)) + b"|TAIL"
    whole = s.scrub(body)
    assert whole == b"HEAD|" + b"|".join([REPLACEMENT] * 3) + b"|TAIL"
    for cut in range(len(body) + 1):
        stream = s.stream()
        out = b"".join(stream(c) for c in (body[:cut], body[cut:]) if c) + stream(b"")
        assert out == whole, cut


def test_longest_encoding_byte_by_byte() -> None:
    """Every character at its longest bounded form: the stream window must still hold all of it."""
    secret = "a/é𝄞"
    pad = MAX_REF_DIGITS
    form = (f"&#x{ord('a'):0{pad}x};&#{ord('/'):0{pad}d};&#X{ord('é'):0{pad}X};"
            "\\uD834\\uDD1E").encode()
    assert leaks(form, secret)
    s = Scrubber([secret])
    body = b"z" * 50 + form + b"z" * 50
    stream = s.stream()
    out = b"".join(stream(body[i:i + 1]) for i in range(len(body))) + stream(b"")
    assert out == b"z" * 50 + REPLACEMENT + b"z" * 50


def test_innocent_escapes_are_not_redacted() -> None:
    """Negative controls: escapes of other characters, near misses, and references a decoder reads
    differently (`&#1011` is one character, not `e` + `1`) pass unchanged; the plain forms still match."""
    secret = "e1-secret-Value"
    s = Scrubber([SecretSpec(secret, "svc")])
    innocent = [
        b"100% sure, 50%-off %20 %2F %u00e9 \\u00e9 \\n \\\" \\/ &amp; &lt; &#233; &#x27; &#39; &quot;",
        b"&#1011-secret-Value",  # &#1011 is U+03F3, then "-secret-Value"
        b"&#x651-secret-Value",  # U+0651 then "-secret-Value"
        b"e1-s&#x0065cret-Value",  # U+065C: the hex reference runs on into "c"
        b"e1-secr%65t-Valu",  # truncated
        b"e1-secr%66t-Value", b"\\u0066\\u0031-secret-Value", b"e1-s&#101;cret-Valuf",  # one character off
        b"E1-SECRET-VALUE", b"e1%2Dsecret%2Dvalue",  # the value is case-sensitive
    ]
    for text in innocent:
        assert s.scrub(text) == text, text
        assert not leaks(text, secret)
    for plain in (secret.encode(), b"e1%2Dsecret%2DValue", b"&#101;1-secret-Value", b"&#101;&#49-secret-Value"):
        assert s.scrub(b"(" + plain + b")") == b"(" + REPLACEMENT + b")", plain


def test_headers_location_cookie_and_reason() -> None:
    s = Scrubber([SecretSpec(TOKEN, "x-access-token")])
    headers = [("Location", "https://cb.example.test/done?token=" + mixed(TOKEN, URL) + "&x=1"),
               ("Set-Cookie", "auth=" + mixed(TOKEN, HTML, 2) + "; Path=/"),
               ("X-Echo", '{"t": "' + mixed(TOKEN, JSON) + '"}'), ("Content-Type", "text/html")]
    for _, v in headers[:3]:
        assert leaks(v.encode(), TOKEN)
    out = s.scrub_headers(headers)
    assert out[0][1] == "https://cb.example.test/done?token=[REDACTED]&x=1"
    assert out[1][1] == "auth=[REDACTED]; Path=/" and out[3] == headers[3]
    assert all(not leaks(v.encode(), TOKEN) for _, v in out)
    assert s.scrub_text("OK " + mixed(TOKEN, EVERY)) == "OK [REDACTED]"  # reason phrase / WS text


def test_recorded_mcp_arguments_are_redacted() -> None:
    """The audit redaction (mcp/records.py) uses the same Scrubber: a mixed form in arguments is gone."""
    args = {"query": "see " + mixed(TOKEN, HTML, 1), "n": 1, "url": "/x?k=" + mixed(TOKEN, URL, 1)}
    assert leaks(str(args).encode(), TOKEN)
    text = redact_arguments(args, (SecretSpec(TOKEN),))
    assert not leaks(text.encode(), TOKEN) and text.count("[REDACTED]") == 2, text


secret_st = st.text(alphabet=st.sampled_from('abcXYZ019/+=:_-.~ é€"\u2028𝄞'), min_size=6, max_size=24)


@settings(max_examples=120, deadline=None)
@given(secret=secret_st, seed=st.integers(0, 2**32), filler=st.lists(st.binary(max_size=30), min_size=4, max_size=4),
       cuts=st.lists(st.integers(0, 4000), max_size=6))
def test_property_any_subset_escaped_stream_equals_whole(secret, seed, filler, cuts) -> None:
    rng = random.Random(seed)
    forms = [mixed_at_random(secret, rng.choice).encode() for _ in range(3)]
    body = filler[0] + forms[0] + filler[1] + forms[1] + filler[2] + forms[2] + filler[3]
    s = Scrubber([secret])
    whole = s.scrub(body)
    assert not leaks(whole, secret) or leaks(filler[0] + filler[1] + filler[2] + filler[3], secret)
    points = sorted({c % (len(body) + 1) for c in cuts})
    chunks = [body[x:y] for x, y in zip([0, *points], [*points, len(body)], strict=True)]
    stream = s.stream()
    assert b"".join(stream(c) for c in chunks if c) + stream(b"") == whole
