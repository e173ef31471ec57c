"""Escaped phantoms: a phantom sent JSON-escaped, HTML-escaped or partly percent-encoded is the same
phantom (its receiver decodes it) and must be reported like the raw one — in headers, the query, the
path and (streamed) bodies — while innocent `%`, `\\u`, `&#` are not (broker/inject.py, escapes.py)."""

from __future__ import annotations

import pytest

from egressgate.broker.inject import (
    PHANTOM_MAX_LEN,
    PhantomBodyScanner,
    find_phantoms,
    phantom_hash,
    phantom_value,
    redact_phantoms,
    swap_phantom,
)
from tests.broker.test_inject import CRED, PHANTOM_CAP


def _json(p: str) -> str:  # what json.dumps(ensure_ascii) of a lookalike would emit for some characters
    return "".join(f"\\u{ord(c):04x}" if i % 3 == 0 else c for i, c in enumerate(p))


def _html(p: str) -> str:
    return "".join(f"&#{ord(c)};" if i % 2 else (f"&#x{ord(c):X}" if c == "e" else c) for i, c in enumerate(p))


def _pct(p: str) -> str:
    return "".join(f"%{ord(c):02x}" if i % 4 == 1 else c for i, c in enumerate(p))


ENCODERS = {"json": _json, "html": _html, "percent": _pct}


@pytest.mark.parametrize("where", ["body", "query", "header", "path"])
def test_escaped_phantom_is_found_everywhere(where: str) -> None:
    p = phantom_value()
    for name, enc in ENCODERS.items():
        form = enc(p)
        assert p not in form and p.upper() not in form, name  # really escaped
        kw: dict = {"headers": [], "query": []}
        if where == "body":
            kw["body_chunk"] = b'{"k":"' + form.encode() + b'"}'  # as a JSON/HTML/form body carries it
        elif where == "query":
            kw["query"] = [("key", form)]
        elif where == "header":
            kw["headers"] = [("X-Api-Key", f"Bearer {form}")]
        else:
            kw["path"] = "/v1/" + form
        hits = find_phantoms(kw["headers"], kw["query"], kw.get("body_chunk", b""), path=kw.get("path", ""))
        assert [h.phantom_hash for h in hits] == [phantom_hash(p)], (where, name, form)


def test_mixed_escapes_in_one_phantom_found_innocent_escapes_not() -> None:
    p = phantom_value().upper()
    form = "\\u0045&#x47;p%48" + "&lowbar;" + p[5:9] + "\\x" + f"{ord(p[9]):02x}" + p[10:]
    hits = find_phantoms([], [], form.encode())
    assert [h.phantom_hash for h in hits] == [phantom_hash(p)]
    # control: innocent escapes (and phantom lookalikes) are not flagged
    bodies = [b'{"pct":"100%","u":"caf\\u00e9 \\n \\u0026","h":"&#39;&amp;&lt;&#x2F;"}',
              b"a=1&b=%20%2F%3D&c=%41%42%43&egph=1&egph_=" + b"%30" * 47,
              b"&#101;gph_" + b"0" * 47 + b"\\u0067",  # one hex digit short: not a phantom
              ("egph_" + "z" * 48).encode()]
    for body in bodies:
        assert find_phantoms([("Cookie", body.decode())], [("q", body.decode())], body, path="/" + body.decode()) == []


def test_escaped_phantom_in_its_own_header_is_allowed_there_but_stripped_not_swapped() -> None:
    p = phantom_value()
    headers = [("Authorization", "Bearer " + _json(p))]
    assert find_phantoms(headers, [], allowed=("authorization", phantom_hash(p))) == []
    inj = swap_phantom(PHANTOM_CAP, CRED, phantom_hash(p), headers, [])
    assert not inj.swapped and inj.headers == []  # never forwarded as sent
    # another sandbox's phantom (escaped) in the bound header is misuse
    other = phantom_value()
    hits = find_phantoms([("Authorization", "Bearer " + _html(other))], [], allowed=("authorization", phantom_hash(p)))
    assert [h.phantom_hash for h in hits] == [phantom_hash(other)]


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_streamed_escaped_phantom_split_at_every_point(name: str) -> None:
    p = phantom_value()
    data = b'{"k":"' + ENCODERS[name](p).encode() + b'"}'
    for cut in range(1, len(data)):
        scanner = PhantomBodyScanner()
        hits = scanner.feed(b"x" * 700 + data[:cut]) + scanner.feed(data[cut:])
        assert [h.phantom_hash for h in hits] == [phantom_hash(p)], cut


def test_window_covers_the_longest_escaped_form() -> None:
    p = phantom_value()
    longest = "".join(f"\\u{{{ord(c):08x}}}" for c in p).encode()  # 12 bytes per character
    assert len(longest) < PHANTOM_MAX_LEN
    scanner = PhantomBodyScanner()
    hits = []
    for i in range(0, len(longest), 7):
        hits += scanner.feed(longest[i:i + 7])
    assert [h.phantom_hash for h in hits] == [phantom_hash(p)]


def test_redact_phantoms_cuts_escaped_forms() -> None:
    p = phantom_value()
    text = f"a={_json(p)}&b={_html(p)}&c={_pct(p)}&d={p}"
    assert redact_phantoms(text) == "a=egph_[REDACTED]&b=egph_[REDACTED]&c=egph_[REDACTED]&d=egph_[REDACTED]"
