"""Placement and phantom handling: no duplicates, sandbox's Authorization stripped, misuse found."""

from __future__ import annotations

import base64
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter

from egressgate.broker.config import Capability
from egressgate.broker.credential import Credential
from egressgate.broker.inject import (
    PHANTOM_LEN,
    PhantomBodyScanner,
    admission_phantoms,
    find_phantoms,
    inject,
    phantom_hash,
    phantom_value,
    swap_phantom,
)

CAP = TypeAdapter(Capability)
REAL = "sk-real-ABCDEF0123456789"
CRED = Credential("openai", REAL, "k1", 0.0, 300.0)
BEARER = CAP.validate_python({"type": "static", "source": {"file": "/s"}})
XKEY = CAP.validate_python({"type": "static", "source": {"file": "/s"}, "placement": {"header": "X-Api-Key"}})
BASIC = CAP.validate_python({"type": "static", "source": {"file": "/s"}, "placement": {"basic": {"username": "svc"}}})
QUERY = CAP.validate_python({"type": "static", "source": {"file": "/s"}, "placement": {"query": "api_key"}})
PHANTOM_CAP = CAP.validate_python(
    {
        "type": "static",
        "source": {"file": "/s"},
        "mode": "phantom",
        "phantom_env": "OPENAI_API_KEY",
        "placement": {"header": "Authorization", "format": "Bearer {value}"},
    }
)


def values(headers, name):
    return [v for k, v in headers if k.lower() == name.lower()]


def test_header_always_replaces_every_copy() -> None:
    sent = [("Host", "api.x"), ("authorization", "Bearer mine"), ("AUTHORIZATION", "Basic bWU6cHc="), ("Accept", "*/*")]
    inj = inject(BEARER, CRED, sent, [])
    assert values(inj.headers, "authorization") == [f"Bearer {REAL}"]
    assert ("Host", "api.x") in inj.headers and ("Accept", "*/*") in inj.headers
    assert inj.set_header == "Authorization" and inj.removed_headers == ("authorization",)
    assert REAL not in repr(inj) and REAL not in str(inj)


def test_custom_header_strips_sandbox_authorization_too() -> None:
    sent = [("x-api-key", "sandbox-own"), ("X-API-KEY", "dup"), ("Authorization", "Bearer own")]
    inj = inject(XKEY, CRED, sent, [])
    assert values(inj.headers, "x-api-key") == [REAL] and values(inj.headers, "authorization") == []
    assert inj.removed_headers == ("authorization", "x-api-key")


def test_basic_auth() -> None:
    inj = inject(BASIC, CRED, [("Authorization", "Basic c2FuZGJveDpwdw==")], [])
    (value,) = values(inj.headers, "authorization")
    assert value.startswith("Basic ") and base64.b64decode(value[6:]).decode() == f"svc:{REAL}"


def test_query_param_replaces_sandbox_value() -> None:
    inj = inject(QUERY, CRED, [("Authorization", "x")], [("q", "1"), ("api_key", "mine"), ("API_KEY", "x")])
    assert inj.query == [("q", "1"), ("api_key", REAL)] and inj.set_query == "api_key"
    assert values(inj.headers, "authorization") == []


def test_phantom_format() -> None:
    a, b = phantom_value(), phantom_value()
    assert a != b and len(a) == PHANTOM_LEN and re.fullmatch(r"egph_[0-9a-f]{48}", a)
    assert phantom_hash(a) != phantom_hash(b) and a not in phantom_hash(a)


def test_phantom_swapped_only_in_configured_header() -> None:
    ph = phantom_value()
    sent = [("Authorization", f"Bearer {ph}"), ("Accept", "*/*")]
    inj = swap_phantom(PHANTOM_CAP, CRED, phantom_hash(ph), sent, [])
    assert inj.swapped and values(inj.headers, "authorization") == [f"Bearer {REAL}"]
    assert not find_phantoms(sent, [], b"", allowed=("Authorization", phantom_hash(ph)))


def test_phantom_absent_or_foreign_is_not_swapped() -> None:
    mine, theirs = phantom_value(), phantom_value()
    for sent in ([("Authorization", "Bearer sk-sandbox-own")], [("Authorization", f"Bearer {theirs}")], []):
        inj = swap_phantom(PHANTOM_CAP, CRED, phantom_hash(mine), sent, [])
        assert not inj.swapped and values(inj.headers, "authorization") == []
        assert all(REAL not in v for _, v in inj.headers)
    # another sandbox's phantom in the right header is misuse too
    hits = find_phantoms([("Authorization", f"Bearer {theirs}")], [], allowed=("Authorization", phantom_hash(mine)))
    assert [(h.where, h.phantom_hash) for h in hits] == [("header", phantom_hash(theirs))]


@pytest.mark.parametrize(
    "case",
    ["other_header", "query", "query_encoded", "path", "body", "other_host", "header_name", "upper"],
)
def test_phantom_misuse_everywhere_else(case: str) -> None:
    ph = phantom_value()
    allowed = ("Authorization", phantom_hash(ph))
    headers, query, body, path = [("Accept", "*/*")], [("q", "x")], b"{}", "/v1/chat"
    if case == "other_header":
        headers.append(("X-Forwarded-Token", f"t={ph}"))
    elif case == "query":
        query.append(("key", ph))
    elif case == "query_encoded":
        query.append(("key", "".join(f"%{ord(c):02X}" for c in ph)))
    elif case == "path":
        path = f"/v1/{ph}/chat"
    elif case == "body":
        body = b'{"api_key": "' + ph.encode() + b'"}'
    elif case == "other_host":  # the route has no phantom capability: even its Authorization is misuse
        headers.append(("Authorization", f"Bearer {ph}"))
        allowed = None
    elif case == "header_name":
        headers.append((ph, "1"))
    elif case == "upper":
        query.append(("key", ph.upper()))
    hits = find_phantoms(headers, query, body, path=path, allowed=allowed)
    assert len(hits) == 1 and hits[0].phantom_hash == phantom_hash(ph)
    # positive control: the same request without the phantom is clean
    assert not find_phantoms([("Accept", "*/*")], [("q", "x")], b"{}", path="/v1/chat", allowed=allowed)


@given(st.binary(max_size=200), st.binary(max_size=200), st.lists(st.integers(1, 400), max_size=6))
def test_phantom_split_across_body_chunks(prefix: bytes, suffix: bytes, cuts: list[int]) -> None:
    ph = phantom_value()
    body = prefix + ph.encode() + suffix
    points = sorted({c % (len(body) + 1) for c in cuts})
    chunks = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    scanner = PhantomBodyScanner()
    for chunk in chunks:
        scanner.feed(chunk)
    assert [h.phantom_hash for h in scanner.hits].count(phantom_hash(ph)) == 1


def test_phantom_every_split_offset() -> None:
    ph = phantom_value().encode()
    body = b"x" * 10 + ph + b"y" * 10
    for cut in range(len(body) + 1):
        scanner = PhantomBodyScanner()
        scanner.feed(body[:cut])
        scanner.feed(body[cut:])
        assert len(scanner.hits) == 1, cut


def test_admission_phantoms() -> None:
    env, hashes = admission_phantoms({"openai": PHANTOM_CAP, "plain": BEARER})
    assert list(env) == ["OPENAI_API_KEY"] and list(hashes) == ["openai"]
    assert phantom_hash(env["OPENAI_API_KEY"]) == hashes["openai"]
    assert REAL not in str(env)
    env2, _ = admission_phantoms({"openai": PHANTOM_CAP})
    assert env2 != env  # fresh per sandbox
    with pytest.raises(ValueError, match="share phantom_env"):
        admission_phantoms({"a": PHANTOM_CAP, "b": PHANTOM_CAP})


@pytest.mark.parametrize("bad", ["a\r\nX-Evil: 1", "a\nb", "nul\x00", ""])
def test_value_with_line_break_is_never_placed(bad: str) -> None:
    cred = Credential("c", bad, "k", 0.0, 1.0)
    with pytest.raises(ValueError, match="CR/LF/NUL"):
        inject(BEARER, cred, [], [])
    ph = phantom_value()
    with pytest.raises(ValueError, match="CR/LF/NUL"):
        swap_phantom(PHANTOM_CAP, cred, phantom_hash(ph), [("Authorization", f"Bearer {ph}")], [])
