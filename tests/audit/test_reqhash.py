"""Request hash test vectors (the same as docs/audit.md) and what may never enter the hash."""

from __future__ import annotations

import hashlib

import pytest
from click.testing import CliRunner

from egressgate.audit.cli import audit
from egressgate.audit.reqhash import (
    BodyHasher,
    RequestHashError,
    canonical_fields,
    canonical_request,
    request_hash,
    request_hash_raw,
)

EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
BODY = b'{"model":"gpt-5","input":"hi"}'

# (method, url, headers, body, canonical octets, hash) -- docs/audit.md "Test vectors"
VECTORS = [
    (
        "GET",
        "https://api.openai.com/v1/models",
        [],
        b"",
        b"egressgate-request-v1\n3:GET\n5:https\n14:api.openai.com\n3:443\n10:/v1/models\n0:\n0:\n64:"
        + EMPTY.encode()
        + b"\n",
        "sha256:aaa7f813910140a98ee3a7c7b6b5448a7ad65adfe10b8cfdeda0c154087b21b9",
    ),
    (
        "POST",
        "https://api.openai.com/v1/responses",
        [("Content-Type", " application/json ")],
        BODY,
        b"egressgate-request-v1\n4:POST\n5:https\n14:api.openai.com\n3:443\n13:/v1/responses\n0:\n"
        b"16:application/json\n64:49bb5ce66b2215f7193979d0ab5c1088e42046dcd9546f0e0780f3eb628e2721\n",
        "sha256:2958e7db971c6ec4412c82c2a96f0b48ecb2ac8b67b37313d47b5118f243b34e",
    ),
    (
        "get",
        "https://API.OpenAI.com.:443/v1/./files/../models?limit=10&after=%2f",
        [],
        b"",
        b"egressgate-request-v1\n3:GET\n5:https\n14:api.openai.com\n3:443\n10:/v1/models\n18:limit=10&after=%2f\n"
        b"0:\n64:" + EMPTY.encode() + b"\n",
        "sha256:2e41cb03e5c0f1a20bb8c13ac29c0d1fa7ad1c5ed2f4a0a25631e0ad7554850c",
    ),
    (
        "DELETE",
        "http://[2001:DB8::0001]:8080/a%2fb/%7Euser?x",
        [("Authorization", "Bearer sk-real"), ("Proxy-Authorization", "Basic Zm9vOmJhcg==")],
        b"",
        b"egressgate-request-v1\n6:DELETE\n4:http\n11:2001:db8::1\n4:8080\n12:/a%2Fb/~user\n1:x\n0:\n64:"
        + EMPTY.encode()
        + b"\n",
        "sha256:171b1670d0c579c6ad931b43f97d7a4456296f6c946af5bc8fe114a91b89a8df",
    ),
]


@pytest.mark.parametrize(("method", "url", "headers", "body", "canonical", "expected"), VECTORS)
def test_vectors(method, url, headers, body, canonical, expected):
    fields = canonical_fields(method, url, headers, body)
    assert canonical_request(*fields) == canonical
    # recomputable without egressgate: plain SHA-256 over the documented octets
    assert "sha256:" + hashlib.sha256(canonical).hexdigest() == expected
    assert request_hash_raw(method, url, headers, body) == expected


def test_equivalent_spellings_hash_equal_and_differences_do_not():
    base = request_hash_raw("GET", "https://api.openai.com/v1/models")
    assert request_hash_raw("GET", "https://API.OPENAI.COM:443/v1/x/../models#frag") == base
    assert request_hash_raw("GET", "https://api.openai.com/v1/%6dodels") == base  # unreserved %XX decoded
    assert request_hash_raw("POST", "https://api.openai.com/v1/models") != base
    assert request_hash_raw("GET", "http://api.openai.com/v1/models") != base
    assert request_hash_raw("GET", "https://api.openai.com:8443/v1/models") != base
    assert request_hash_raw("GET", "https://api.openai.com/v1/models?") == base  # empty query == no query
    assert request_hash_raw("GET", "https://api.openai.com/v1/models?a=1") != base
    assert request_hash_raw("GET", "https://api.openai.com/v1/models", body=b"x") != base


def test_credentials_and_other_headers_never_enter_the_hash():
    base = request_hash_raw("GET", "https://api.openai.com/v1/models")
    for h in [
        ("Authorization", "Bearer sk-live-123"),
        ("Proxy-Authorization", "Basic eDp5"),
        ("Cookie", "s=1"),
        ("X-Api-Key", "k"),
        ("User-Agent", "curl"),
    ]:
        assert request_hash_raw("GET", "https://api.openai.com/v1/models", [h]) == base
    ct = request_hash_raw("GET", "https://api.openai.com/v1/models", [("content-TYPE", "text/plain")])
    assert ct != base


def test_length_prefix_prevents_field_shifting():
    # the same concatenated text split differently across fields must not collide
    a = request_hash("GET", "https", "a.example", 443, "/x", "y=1", "")
    b = request_hash("GET", "https", "a.example", 443, "/xy=1", "", "")
    assert a != b


def test_streamed_body_digest_matches():
    h = BodyHasher()
    for chunk in (BODY[:5], BODY[5:], b""):
        h.update(chunk)
    assert h.hexdigest() == hashlib.sha256(BODY).hexdigest() and h.size == len(BODY)


@pytest.mark.parametrize(
    "url", ["https://user:pw@api.openai.com/", "ftp://x/", "api.openai.com/x", "https:///x", "https://a.example:99999/"]
)
def test_bad_requests_are_clear_errors(url):
    with pytest.raises(RequestHashError):
        request_hash_raw("GET", url)


def test_cli_hash(tmp_path):
    body = tmp_path / "body.json"
    body.write_bytes(BODY)
    r = CliRunner().invoke(
        audit,
        [
            "hash",
            "POST https://api.openai.com/v1/responses",
            "--header",
            "Content-Type: application/json",
            "--body-file",
            str(body),
        ],
    )
    assert r.exit_code == 0, r.output
    assert r.output.strip() == VECTORS[1][5]
    r = CliRunner().invoke(audit, ["hash", "GET https://u@x.example/"])
    assert r.exit_code == 2 and "userinfo" in r.output


def test_streaming_request_hash_equals_vector():
    from egressgate.audit.reqhash import StreamingRequestHash

    s = StreamingRequestHash("POST", "https", "api.openai.com", 443, "/v1/responses", "", "application/json")
    for i in range(0, len(BODY), 7):
        s.update(BODY[i : i + 7])
    assert s.request_hash() == VECTORS[1][5]
    assert s.body_hash() == "sha256:" + hashlib.sha256(BODY).hexdigest() and s.body_size == len(BODY)
