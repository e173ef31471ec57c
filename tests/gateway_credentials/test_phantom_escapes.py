"""A phantom sent escaped (JSON `\\u0065`, HTML `&#103;`, partly percent-encoded) to a host other than
its route is the same phantom to whoever decodes it: the real gateway denies it `credential_misuse`,
audits it (without the phantom in any form) and the upstream never receives it; the plain phantom on
its own route is still swapped, and innocent `%`, `\\u`, `&#` pass untouched."""

from __future__ import annotations

from urllib.parse import quote

from egressgate.broker.inject import redact_phantoms
from tests.gateway_credentials.test_phantom import _stream_post, phantom_sandbox
from tests.support.bao import KV_SECRET
from tests.support.credworld import Gateway, hits_for, last


def _json(p: str) -> str:
    return "".join(f"\\u{ord(c):04x}" if i % 3 == 0 else c for i, c in enumerate(p))


def _html(p: str) -> str:
    return "".join(f"&#{ord(c)};" if i % 2 else c for i, c in enumerate(p))


def _pct(p: str) -> str:
    return "".join(f"%{ord(c):02X}" if i % 4 == 1 else c for i, c in enumerate(p))


def test_escaped_phantom_to_another_host_is_misuse(cgw: Gateway) -> None:
    sbx, phantom = phantom_sandbox(cgw)
    u = cgw.url
    forms = [_json(phantom), _html(phantom), _pct(phantom)]
    cases = []
    for form in forms:
        cases += [
            ("POST", u("other.test", "/echo"), {"content": b'{"k":"' + form.encode() + b'"}'}),  # body
            ("GET", u("other.test", "/echo?k=" + quote(form, safe="")), {}),  # query (decoded: the form)
            ("GET", u("other.test", "/echo"), {"headers": {"X-Note": form}}),  # header
        ]
    for method, url, kw in cases:
        mark = cgw.world.hits.mark()
        with cgw.client(sbx) as c:
            r = c.request(method, url, **kw)
        assert r.status_code == 403 and r.json()["reason"] == "credential_misuse", (url, kw, r.text)
        assert cgw.world.hits.since(mark) == [], "the upstream must not receive an escaped phantom"
    records = [r for r in cgw.audit_records() if r.get("egressgate.sandbox.id") == sbx["id"]
               and r.get("egressgate.reason") == "credential_misuse"]
    assert len(records) == len(cases)
    audit = cgw.audit_text()
    assert all(f not in audit and quote(f, safe="") not in audit for f in [*forms, phantom])
    assert redact_phantoms(audit) == audit  # no phantom in any escaped form either

    # positive controls: innocent escapes reach the upstream unchanged; the plain phantom still works
    innocent = b'{"p":"100%","u":"caf\\u00e9\\n","h":"&#39;&amp;&#x2F;","q":"egph_' + b"z" * 48 + b'"}'
    mark = cgw.world.hits.mark()
    with cgw.client(sbx) as c:
        assert c.post(u("other.test", "/echo"), content=innocent).status_code == 200
        assert c.get(u("other.test", "/echo?a=%41%20%26&b=\\u0041"), headers={"X-Note": "&#65; 5%"}).status_code == 200
        r = c.post(u("phantom.test", "/v1/chat"), headers={"Authorization": f"Bearer {phantom}"}, json={"x": 1})
        assert r.status_code == 200, r.text
    assert hits_for(cgw, mark, "other.test")[0]["body"] == innocent
    assert last(cgw, mark, "phantom.test")["auth"] == [f"Bearer {KV_SECRET}"]


def test_escaped_phantom_split_across_streamed_chunks(cgw: Gateway) -> None:
    sbx, phantom = phantom_sandbox(cgw)
    form = _json(phantom).encode()
    mark = cgw.world.hits.mark()
    reply = _stream_post(cgw, sbx, [b"a" * 100, b'{"key":"' + form[:40], form[40:120], form[120:] + b'"}'])
    assert b" 200 " not in reply.split(b"\r\n", 1)[0]
    for hit in hits_for(cgw, mark, "phantom.test"):
        assert form[:40] not in hit["body"], "not even the first part of the escaped phantom got out"
    records = [r for r in cgw.audit_records() if r.get("egressgate.sandbox.id") == sbx["id"]
               and r.get("egressgate.reason") == "credential_misuse"]
    assert records, "a streamed misuse is audited"
