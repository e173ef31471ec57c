"""Per-request decisions through HTTPS interception: rules, identity, deny contract, headers, redirects."""

from __future__ import annotations

import base64
import json
import socket

import httpx
import pytest

from tests.support.gwworld import connect_tunnel
from tests.support.http1 import read_reply

DENY_KEYS = {"error", "reason", "rule", "request_id", "message"}


def assert_deny(r: httpx.Response, status: int, reason: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["x-egressgate-decision"] == "deny"
    body = r.json()
    assert set(body) == DENY_KEYS
    assert body["error"] == "egress_denied"
    assert body["reason"] == reason, body
    assert body["request_id"] == r.headers["x-egressgate-request-id"]
    assert isinstance(body["message"], str) and len(body["message"]) > 10
    return body


def test_allowed_get_and_post(gateway):
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    with sbx.client() as c:
        r1 = c.get(sbx.url("api.test", "/echo?q=1"))
        r2 = c.post(sbx.url("api.test", "/upload"), content=b"x" * 1000)
    assert r1.status_code == 200 and r1.json()["path"] == "/echo?q=1"
    assert r2.status_code == 200
    seen = gateway.world.hits.since(mark)
    assert [h["method"] for h in seen] == ["GET", "POST"]
    assert seen[1]["body_len"] == 1000
    assert all("proxy-authorization" not in h["headers"] for h in seen)
    assert r1.headers.get("x-egressgate-request-id")


@pytest.mark.parametrize(
    ("method", "path", "reason"),
    [("POST", "/echo", "path_not_allowed"), ("PUT", "/echo", "method_not_allowed"),
     ("GET", "/secret", "path_not_allowed"),
     ("GET", "/v1/../secret", "path_not_allowed"), ("GET", "/%65cho/../secret", "path_not_allowed"),
     ("DELETE", "/upload", "method_not_allowed")],
)
def test_wrong_method_or_path_denied_upstream_untouched(gateway, method, path, reason):
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    with sbx.client() as c:
        # raw path: httpx would normalize dot segments itself
        req = c.build_request(method, sbx.url("api.test", "/"))
        req.url = req.url.copy_with(raw_path=path.encode())
        r = c.send(req)
    body = assert_deny(r, 403, reason)
    assert body["rule"] is None or body["rule"].startswith("api-")
    assert gateway.world.hits.since(mark) == []


def test_keepalive_each_request_decided(gateway):
    """One client connection: allowed, denied, allowed — the tunnel is not a blanket allow."""
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    with sbx.client() as c:
        codes = [c.get(sbx.url("api.test", p)).status_code for p in ("/echo", "/admin", "/v1/x", "/admin")]
    assert codes == [200, 403, 200, 403]
    assert [h["path"] for h in gateway.world.hits.since(mark)] == ["/echo", "/v1/x"]


def test_http2_streams_decided_separately(gateway):
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    port = gateway.world.h2_port
    with sbx.client(http2=True) as c:
        r1 = c.get(sbx.url("h2.test", "/ok/1", port=port))
        r2 = c.get(sbx.url("h2.test", "/private", port=port))
        r3 = c.post(sbx.url("h2.test", "/ok/2", port=port), content=b"abc")
        r4 = c.get(sbx.url("h2.test", "/ok/3", port=port), headers={"host": "api.test"})
        r5 = c.get(sbx.url("h2.test", "/ok/4", port=port))
    assert r1.http_version == "HTTP/2" and r1.status_code == 200 and r1.json()["h2"] is True
    assert_deny(r2, 403, "path_not_allowed")
    assert_deny(r3, 403, "method_not_allowed")
    assert_deny(r4, 421, "host_mismatch")  # :authority naming another host inside the h2 tunnel
    assert r5.status_code == 200
    assert [h["path"] for h in gateway.world.hits.since(mark)] == ["/ok/1", "/ok/4"]


def test_unlisted_host_and_wrong_port_denied_at_connect(gateway):
    """Refused at the CONNECT, and answered inside the accepted tunnel (deny.connect_in_tunnel, the
    default): the client reads the JSON deny under the CONNECT's request id; nothing reaches the server."""
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    with sbx.client() as c:
        assert_deny(c.get(sbx.url("nohost.test", "/echo")), 403, "host_not_allowed")
        assert_deny(c.get(sbx.url("api.test", "/echo", port=gateway.world.tcp_port)), 403, "port_not_allowed")
    assert gateway.world.hits.since(mark) == []


def raw_connect(gateway, target: str, auth: str | None) -> tuple[int, dict, bytes]:
    with socket.create_connection(gateway.proxy, timeout=10) as s:
        extra = f"Proxy-Authorization: {auth}\r\n" if auth else ""
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{extra}\r\n".encode())
        return read_reply(s)


def test_connect_deny_body_and_reasons(gateway):
    sbx = gateway.admit("gw-basic")
    good = "Basic " + base64.b64encode(f"{sbx.id}:{sbx.token}".encode()).decode()
    port = gateway.world.https_port
    # refused, and accepted to answer inside (deny.connect_in_tunnel): the 200 already carries the deny headers
    status, headers, body = raw_connect(gateway, f"nohost.test:{port}", good)
    assert status == 200 and headers["x-egressgate-decision"] == "deny", (status, headers, body)
    assert headers["x-egressgate-reason"] == "host_not_allowed" and body == b""
    sock, reply = connect_tunnel(gateway, sbx, f"nohost.test:{port}")  # the body, read inside the tunnel
    sock.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403") and b"x-egressgate-decision: deny" in head, reply
    import json

    doc = json.loads(body)
    assert set(doc) == DENY_KEYS and doc["reason"] == "host_not_allowed"
    assert sbx.token not in body.decode()
    # positive control: the same CONNECT to an allowed host is established
    status, _, _ = raw_connect(gateway, f"api.test:{port}", good)
    assert status == 200


@pytest.mark.parametrize("auth", [None, "Basic !!!notbase64", "Bearer abc",
                                  "Basic " + base64.b64encode(b"sbx-unknown:tok").decode()])
def test_identity_required_407(gateway, auth):
    status, headers, body = raw_connect(gateway, f"api.test:{gateway.world.https_port}", auth)
    assert status == 407
    assert headers["x-egressgate-decision"] == "deny"
    assert headers["proxy-authenticate"].startswith("Basic")
    assert b'"reason":"identity_unknown"' in body


def test_wrong_token_for_known_id_407(gateway):
    sbx = gateway.admit("gw-basic")
    auth = "Basic " + base64.b64encode(f"{sbx.id}:{sbx.token}x".encode()).decode()
    status, _, body = raw_connect(gateway, f"api.test:{gateway.world.https_port}", auth)
    assert status == 407 and b"identity_unknown" in body


def test_plain_http_absolute_form_strips_proxy_auth_and_hop_by_hop(gateway):
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    headers = {"Connection": "keep-alive, X-Drop-Me", "X-Drop-Me": "secret", "Keep-Alive": "timeout=5",
               "TE": "trailers", "Proxy-Connection": "keep-alive", "X-Keep": "1"}
    with sbx.client() as c:
        r = c.get(sbx.url("api.test", "/echo", scheme="http"), headers=headers)
    assert r.status_code == 200, r.text
    seen = gateway.world.hits.since(mark)[0]["headers"]
    for name in ("proxy-authorization", "x-drop-me", "keep-alive", "te", "proxy-connection"):
        assert name not in seen, name
    assert seen["x-keep"] == "1"


def test_plain_http_identity_and_denials(gateway):
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    with httpx.Client(proxy=f"http://{gateway.proxy[0]}:{gateway.proxy[1]}", trust_env=False) as c:
        r = c.get(sbx.url("api.test", "/echo", scheme="http"))
    assert_deny(r, 407, "identity_unknown")
    with sbx.client() as c:
        r = c.delete(sbx.url("api.test", "/echo", scheme="http"))
        assert_deny(r, 403, "method_not_allowed")
        r = c.get(sbx.url("nohost.test", "/echo", scheme="http"))
        assert_deny(r, 403, "host_not_allowed")
        r = c.get(sbx.url("other.test", "/echo", scheme="http"))  # other.test has an http rule, other port
        assert_deny(r, 403, "port_not_allowed")
    assert gateway.world.hits.since(mark) == []


def test_redirect_not_followed_next_request_decided_afresh(gateway):
    sbx = gateway.admit("gw-basic")
    canary = gateway.world.canary.mark()
    target = f"https://nohost.test:{gateway.world.https_port}/echo"
    with sbx.client(follow_redirects=False) as c:
        r = c.get(sbx.url("api.test", "/redirect"), params={"to": target})
        assert r.status_code == 302 and r.headers["location"] == target
        assert_deny(c.get(target), 403, "host_not_allowed")  # answered inside the refused tunnel
    assert gateway.world.canary.since(canary) == []


def test_sandbox_env_shape(gateway):
    sbx = gateway.admit("gw-basic", labels={"team": "a"})
    env = sbx.env
    assert env["HTTPS_PROXY"] == env["HTTP_PROXY"] == sbx.proxy_url
    assert f"{sbx.id}:{sbx.token}@" in sbx.proxy_url
    assert env["NO_PROXY"] == "" and env["no_proxy"] == ""
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
                 "GIT_SSL_CAINFO", "PIP_CERT", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"):
        assert env[name] == gateway.bundle
    with open(gateway.bundle) as fh:
        text = fh.read()
    assert text.count("BEGIN CERTIFICATE") > 2 and "PRIVATE KEY" not in text


@pytest.mark.parametrize(("host", "port_attr"), [("untrusted.test", "untrusted_port"), ("badname.test", "https_port")])
def test_upstream_tls_verified(gateway, host, port_attr):
    """An upstream whose certificate chains to an unknown CA, or does not name the host, gets no request."""
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    with sbx.client() as c:
        try:
            r = c.get(sbx.url(host, "/echo", port=getattr(gateway.world, port_attr)))
            status = r.status_code
        except httpx.HTTPError:
            status = 0
    assert status in (0, 502)
    assert gateway.world.hits.since(mark) == []


def test_upstream_bundle_adds_to_system_roots(gateway):
    with open(gateway.var / "ca" / "upstream-ca-bundle.pem") as fh:
        text = fh.read()
    assert text.count("BEGIN CERTIFICATE") > 10  # the system roots
    assert gateway.world.ca.cert_pem.bytes().decode().strip() in text  # plus the configured ca_bundle


def test_tunnel_request_never_forwards_proxy_credentials_or_hop_by_hop(gateway):
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    headers = {"Proxy-Authorization": f"Basic {base64.b64encode(f'{sbx.id}:{sbx.token}'.encode()).decode()}",
               "Connection": "X-Secret-Hop", "X-Secret-Hop": "1", "Upgrade": "h2c", "X-Keep": "2"}
    with sbx.client() as c:
        r = c.get(sbx.url("api.test", "/echo"), headers=headers)
    assert r.status_code == 200
    seen = gateway.world.hits.since(mark)[0]["headers"]
    for name in ("proxy-authorization", "x-secret-hop", "upgrade"):
        assert name not in seen
    assert sbx.token not in json.dumps(seen)
    assert seen["x-keep"] == "2"


def test_denied_endless_upload_answered_then_cut(gateway):
    """A denied request announcing 100 MB is answered at once with the deny contract, before any body
    byte is read; the gateway then reads and discards what the client still sends (a lingering close, so
    clients that send first and read after still read the answer) and cuts it after LINGER_MAX_BYTES
    (64 MiB) or LINGER_SECONDS, before the 100 MB end. Nothing reaches the upstream; a small denied body gets the same
    answer (control: the deny contract itself)."""
    from tests.support.gwworld import connect_tunnel, tls_wrap

    sbx = gateway.admit("gw-basic")
    port = gateway.world.https_port
    mark = gateway.world.hits.mark()
    sock, _ = connect_tunnel(gateway, sbx, f"api.test:{port}")
    tls = tls_wrap(sock, gateway, "api.test")
    tls.sendall(f"POST /forbidden HTTP/1.1\r\nHost: api.test:{port}\r\nContent-Length: 100000000\r\n\r\n".encode())
    status, _, body = read_reply(tls)  # before a single body byte was sent
    assert status == 403 and json.loads(body)["reason"] == "path_not_allowed", (status, body)
    sent, closed = 0, False
    try:
        for _ in range(2000):  # up to 128 MiB; the gateway must stop reading after 64 MiB
            tls.sendall(b"z" * 65536)
            sent += 65536
    except (OSError, ConnectionError):
        closed = True
    tls.close()
    assert closed and sent < 100_000_000, sent  # cut at LINGER_MAX_BYTES read, or after LINGER_SECONDS
    with sbx.client() as c:
        r = c.post(sbx.url("api.test", "/forbidden"), content=b"small")
    assert r.status_code == 403 and r.json()["reason"] == "path_not_allowed"
    assert gateway.world.hits.since(mark) == []


def test_plain_http_keepalive_reuses_pinned_upstream_connection(gateway):
    sbx = gateway.admit("gw-basic")
    mark = gateway.world.hits.mark()
    with sbx.client() as c:
        codes = [c.get(sbx.url("api.test", f"/echo/{i}", scheme="http")).status_code for i in range(4)]
    assert codes == [200] * 4
    seen = gateway.world.hits.since(mark)
    assert len({tuple(h["peer"]) for h in seen}) == 1  # one upstream connection for all four
    assert {h["host"] for h in seen} == {f"api.test:{gateway.world.http_port}"}  # Host header untouched


def test_two_proxy_authorization_headers_refused(gateway):
    a, b = gateway.admit("gw-basic"), gateway.admit("gw-basic")
    auth = [base64.b64encode(f"{s.id}:{s.token}".encode()).decode() for s in (a, b)]
    status, _, body = raw_connect(gateway, f"api.test:{gateway.world.https_port}",
                                  f"Basic {auth[0]}\r\nProxy-Authorization: Basic {auth[1]}")
    assert status == 407 and b"identity_unknown" in body
