"""A real gateway, a real echo upstream: the injected credential reflected with some of its characters
escaped (JSON `\\u0065` / `\\/`, HTML `&#101;` / `&#x65;` / `;`-less / named, a partly percent-encoded
form body and redirect) reaches the sandbox only as [REDACTED] — buffered, in headers, and streamed with
the body cut into two chunks at every offset. Each test first shows the upstream received the
credential and that what it sent decodes back to it (tests/support/leaks.py)."""

from __future__ import annotations

import pytest

from tests.support.bao import KV_SECRET
from tests.support.credworld import Gateway, last
from tests.support.leaks import leaks
from tests.support.mixed import HTML, URL, mixed
from tests.support.reflect import MIXED_PAD, mixed_reflection


@pytest.mark.parametrize("kind", ["json", "html", "form"])
def test_mixed_escape_reflection_scrubbed(cgw: Gateway, kind: str) -> None:
    sent, _, forms = mixed_reflection(kind, KV_SECRET)
    assert KV_SECRET.encode() not in sent and all(leaks(f, KV_SECRET) for f in forms)  # decodes back
    sbx = cgw.admit("cred-kv")
    mark = cgw.world.hits.mark()
    with cgw.client(sbx) as c:
        r = c.get(cgw.url("api.test", f"/reflect/mixed-{kind}"))
    assert r.status_code == 200, r.text
    assert last(cgw, mark, "api.test")["auth"] == [f"Bearer {KV_SECRET}"]  # it was there to reflect
    expected = sent
    for f in forms:
        expected = expected.replace(f, b"[REDACTED]")
    assert r.content == expected
    assert not leaks(r.content, KV_SECRET)


def test_mixed_escape_in_location_and_cookie(cgw: Gateway) -> None:
    sbx = cgw.admit("cred-kv")
    with cgw.client(sbx) as c:
        r = c.get(cgw.url("api.test", "/reflect/mixed-headers"))
    assert r.status_code == 200
    assert leaks(mixed(KV_SECRET, URL, 1).encode(), KV_SECRET) and leaks(mixed(KV_SECRET, HTML, 1).encode(), KV_SECRET)
    assert r.headers["location"] == "https://other.test/cb?token=[REDACTED]"
    assert r.headers["set-cookie"] == "t=[REDACTED]"


def test_mixed_escape_split_across_chunks_at_every_offset(cgw: Gateway) -> None:
    body, _, (form,) = mixed_reflection("split", KV_SECRET)
    assert leaks(form, KV_SECRET)
    want = b"x" * MIXED_PAD + b"[REDACTED]" + b"y" * MIXED_PAD
    sbx = cgw.admit("cred-kv")
    bad = []
    with cgw.client(sbx) as c:
        for cut in range(len(body) + 1):
            r = c.get(cgw.url("api.test", f"/reflect/mixed-split?cut={cut}"))
            assert r.status_code == 200
            assert "content-length" not in r.headers  # streamed (chunked), not buffered
            if r.content != want or leaks(r.content, KV_SECRET):
                bad.append((cut, r.content))
    assert not bad, bad[:3]
