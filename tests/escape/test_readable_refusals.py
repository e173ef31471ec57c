"""Refusals an agent can read (issue 21 item 4, issue 23 item 5): what real clients print or raise.

Explicit proxy: a CONNECT refused by the policy is accepted and every request inside it answered with the
deny body over the gateway's TLS (`deny.connect_in_tunnel`, the default), so curl prints the JSON and
requests/httpx/urllib return a 403 whose body and headers carry the reason, the request id and the
approval id. The accepted tunnel never forwards anything (many requests, HTTP/2, an SNI and Host naming an
allowed host, raw bytes, plain HTTP): the upstream canaries stay silent while the positive controls (the
allowed host, through a tunnel of its own) are reached. With the option off, the CONNECT's own 403 carries
the reason in its headers and reason phrase, which the Python clients put in their exception.

Transparent mode: a name the policy does not allow is answered with the gateway's address (no upstream DNS
query: the world's resolver is the DNS canary), the connection is redirected to the transparent listener,
and the deny comes over TLS. `network.dns.deny_answer: rcode` keeps NXDOMAIN.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import dns.message
import dns.query
import dns.rcode
import pytest

import tests.networld as nw
from tests.escape.checks import SETTLE, assert_untouched, requests_on
from tests.escape.h2streams import exchange
from tests.networld import World
from tests.support.http1 import parse_response, read_all, read_response
from tests.support.launcher import complete_lines, flatten_otlp
from tests.support.netgateway import Gateway, Sandbox
from tests.support.transparent import Transparent

pytestmark = pytest.mark.netns

SCRIPT = Path(__file__).with_name("readable_clients.py")
PY_CLIENTS = ["requests", "httpx", "urllib"]
NET = "198.18.15"  # this module's transparent namespace (other modules: .5 .6 .7 .9 .12 .13 .14)
GW_SIDE, SOURCE, RCODE_SOURCE = f"{NET}.1", f"{NET}.2", f"{NET}.3"


def proxy_url(gateway: Gateway, sbx: Sandbox) -> str:
    return f"http://{quote(sbx.id, safe='')}:{quote(sbx.token, safe='')}@{gateway.proxy[0]}:{gateway.proxy[1]}"


def run_client(world: World, ns: str, client: str, urls: list[str], ca: Path, proxy: str | None = None) -> list[dict]:
    """What one real client prints for each of `urls` (readable_clients.py), run inside `ns`: the URLs in
    turn, each by a client of its own, in one interpreter (a refusal and its positive control share one
    Python start and one import of the client library, the bulk of this module's CPU)."""
    res = world.exec(ns, sys.executable, str(SCRIPT), client, str(ca), proxy or "-", *urls, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert isinstance(out, list) and len(out) == len(urls), out
    return out


def records(gateway: Gateway, request_id: str, settle: float = 0.5) -> list[dict]:
    """Every audit record carrying `request_id` (after the batched writer had time to write more)."""
    gateway.audit_record(request_id)  # waits for the first one
    time.sleep(settle)
    path = gateway.tmp / "var" / "audit.jsonl"
    found = [flatten_otlp(json.loads(line)) for line in complete_lines(path) if request_id in line]
    return [r for r in found if r.get("egressgate.request.id") == request_id]


def fresh(gateway: Gateway, policy: str, address: str | None = None) -> Sandbox:
    """A sandbox of its own (Gateway.admit caches by policy; approvals are per sandbox)."""
    gateway.sandboxes.pop(f"{policy}@{address}" if address else policy, None)
    return gateway.admit(policy, address=address)


# ------------------------------------------------------------------ explicit proxy, tunnel accepted (default)
def test_curl_prints_the_deny_of_a_refused_connect(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    res = gateway.curl(sbx, "https://forbidden.test/upload?secret=1")
    assert (res.rc, res.connect_status, res.status) == (0, 200, 403), res
    body = json.loads(res.body)  # what curl printed on stdout
    assert body["reason"] == "host_not_allowed" and body["request_id"] and body["message"], body
    assert res.header("x-egressgate-reason") == "host_not_allowed"
    [record] = records(gateway, body["request_id"])  # one refusal, one record: the CONNECT's
    assert (record["egressgate.operation"], record["egressgate.decision"]) == ("connect", "deny"), record
    assert world.hits(mark, listener="forbidden-tls") == []
    assert_untouched(world, mark, "refused CONNECT")
    # positive control: the allowed host is reached through the same proxy
    ok = gateway.curl(sbx, "https://api.allowed.test/readable")
    assert ok.status == 200 and not ok.denied, ok
    assert [r["target"] for r in requests_on(world, mark, "upstream-tls")] == ["/readable"]


def test_curl_prints_the_approval_id(world: World, gateway: Gateway) -> None:
    sbx = fresh(gateway, "escape-approval")
    mark = world.mark()
    res = gateway.curl(sbx, "https://other.allowed.test/needs-approval")
    assert res.rc == 0 and res.status == 403, res
    body = json.loads(res.body)
    assert body["reason"] == "approval_required" and body["approval_id"].startswith("apr-"), body
    assert res.header("x-egressgate-approval-id") == body["approval_id"]
    assert requests_on(world, mark, "upstream-tls") == []  # other.allowed.test resolves to the upstream


@pytest.mark.parametrize("client", PY_CLIENTS)
def test_python_clients_read_reason_and_approval_id_through_the_proxy(
    world: World, gateway: Gateway, client: str
) -> None:
    sbx = fresh(gateway, "escape-approval")
    mark = world.mark()
    # the refusal, then the positive control (the allowed host), by the same client through the same proxy
    out, ok = run_client(
        world,
        world.sbx,
        client,
        ["https://other.allowed.test/py", "https://api.allowed.test/py-ok"],
        gateway.client_ca,
        proxy_url(gateway, sbx),
    )
    assert out.get("status") == 403, out
    body = json.loads(out["body"])
    assert body["reason"] == "approval_required" and body["approval_id"].startswith("apr-"), body
    headers = {k.lower(): v for k, v in out["headers"].items()}
    assert headers["x-egressgate-approval-id"] == body["approval_id"]
    assert headers["x-egressgate-request-id"] == body["request_id"]
    assert ok.get("status") == 200, ok
    # exactly the control reached the upstream (other.allowed.test resolves to it): the refused /py did not
    assert [r["target"] for r in requests_on(world, mark, "upstream-tls")] == ["/py-ok"]


# ------------------------------------------------------------------ the accepted tunnel never forwards
def test_allowed_sni_and_host_inside_a_refused_tunnel_reach_nothing(
    world: World, gateway: Gateway, sbx: Sandbox
) -> None:
    """CONNECT forbidden.test, then TLS and Host naming the allowed api.allowed.test, three requests on one
    connection: the first gets the CONNECT's deny (its request id), the connection then closes, and no
    upstream sees a byte. Positive control: the same TLS and requests in a tunnel to api.allowed.test."""
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "forbidden.test:443", read_refusal=False)
    assert resp.status == 200 and resp.headers["x-egressgate-reason"] == "host_not_allowed", resp
    connect_id = resp.headers["x-egressgate-request-id"]
    with gateway.tls(sock, "api.allowed.test") as tls:
        req = b"GET /fronted HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n"
        tls.sendall(req * 3)
        data = read_all(tls, 1.0, first=10)
    first = parse_response(data)
    assert first.status == 403 and first.json()["request_id"] == connect_id, data[:500]
    assert data.count(b"HTTP/1.1 ") == 1, "one answer, then the close"
    time.sleep(SETTLE)
    assert requests_on(world, mark, "upstream-tls") == [] and world.hits(mark, listener="forbidden-tls") == []
    assert len(records(gateway, connect_id)) == 1
    sock, resp = gateway.tunnel(sbx, "api.allowed.test:443")
    assert resp.status == 200, resp
    with gateway.tls(sock, "api.allowed.test") as tls:
        tls.sendall(b"GET /control HTTP/1.1\r\nHost: api.allowed.test\r\nConnection: close\r\n\r\n")
        assert read_response(tls).status == 200
    assert [r["target"] for r in requests_on(world, mark, "upstream-tls")] == ["/control"]


def test_h2_streams_in_a_refused_tunnel_each_get_the_deny(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "forbidden.test:443", read_refusal=False)
    assert resp.status == 200, resp
    streams = {1: "forbidden.test", 3: "api.allowed.test", 5: "api.allowed.test:9443", 7: "169.254.169.254"}
    with gateway.tls(sock, "forbidden.test", alpn=("h2",)) as tls:
        assert tls.selected_alpn_protocol() == "h2"
        result = exchange(tls, streams)
    assert result == dict.fromkeys(streams, 403), result
    time.sleep(SETTLE)
    for listener in ("upstream-tls", "upstream-h2", "forbidden-tls"):
        assert world.hits(mark, listener=listener) == [], listener
    assert_untouched(world, mark, "h2 in a refused tunnel")
    assert len(records(gateway, resp.headers["x-egressgate-request-id"])) == 1


@pytest.mark.parametrize("payload", [b"\x00\x01not tls nor http\r\n", b"SSH-2.0-OpenSSH_9.2\r\n"])
def test_raw_bytes_in_a_refused_tunnel_get_the_deny_and_the_close(
    world: World, gateway: Gateway, sbx: Sandbox, payload: bytes
) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "forbidden.test:443", read_refusal=False)
    assert resp.status == 200, resp
    with sock:
        sock.sendall(payload)
        data = read_all(sock, 1.0, first=10)
    answer = parse_response(data)
    assert answer.status == 403 and answer.json()["reason"] == "host_not_allowed", data[:400]
    assert world.hits(mark, listener="forbidden-tls") == []
    assert_untouched(world, mark, "raw bytes in a refused tunnel")


def test_plain_http_in_a_refused_tunnel(world: World, gateway: Gateway, sbx: Sandbox) -> None:
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "forbidden.test:80", read_refusal=False)
    assert resp.status == 200, resp
    with sock:
        sock.sendall(b"POST /exfil HTTP/1.1\r\nHost: forbidden.test\r\nContent-Length: 5\r\n\r\nhello")
        answer = read_response(sock)
    assert answer.status == 403 and answer.json()["reason"] == "host_not_allowed", answer
    time.sleep(SETTLE)
    assert world.hits(mark, listener="forbidden-http") == []


def test_metadata_literal_is_delivered_in_the_tunnel_and_the_canary_is_untouched(
    world: World, gateway: Gateway, sbx: Sandbox
) -> None:
    """escape-https allows 169.254.169.254 by rule: only the address check refuses it (metadata_endpoint)."""
    mark = world.mark()
    sock, resp = gateway.tunnel(sbx, "169.254.169.254:443", read_refusal=False)
    assert resp.status == 200 and resp.headers["x-egressgate-reason"] == "metadata_endpoint", resp
    with gateway.tls(sock, None) as tls:
        tls.sendall(b"GET /latest/meta-data/ HTTP/1.1\r\nHost: 169.254.169.254\r\nConnection: close\r\n\r\n")
        answer = read_response(tls)
    assert answer.status == 403 and answer.json()["reason"] == "metadata_endpoint", answer
    assert_untouched(world, mark, "metadata literal in a refused tunnel")


def test_an_identity_challenge_stays_on_the_connect(gateway: Gateway) -> None:
    """407 is a challenge the client answers with credentials: never accepted into a tunnel."""
    data = gateway.raw(b"CONNECT forbidden.test:443 HTTP/1.1\r\nHost: forbidden.test:443\r\n\r\n")
    resp = parse_response(data)
    assert resp.status == 407 and resp.headers["x-egressgate-reason"] == "identity_unknown", data[:400]
    assert "identity_unknown" in resp.reason
    record = gateway.audit_record(resp.headers["x-egressgate-request-id"])
    assert (record["egressgate.decision"], record["egressgate.reason"]) == ("challenge", "identity_unknown")
    # positive control: wrong credentials are a denial (recorded as one), and also stay on the CONNECT
    data = gateway.raw(
        b"CONNECT forbidden.test:443 HTTP/1.1\r\nHost: forbidden.test:443\r\n"
        b"Proxy-Authorization: Basic c2J4LTA6d3Jvbmc=\r\n\r\n"
    )
    resp = parse_response(data)
    assert resp.status == 407, data[:400]
    assert gateway.audit_record(resp.headers["x-egressgate-request-id"])["egressgate.decision"] == "deny"


# ------------------------------------------------------------------ explicit proxy, option off
@pytest.fixture(scope="module")
def plain_gateway(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = Gateway.start(
        world, tmp_path_factory.mktemp("gw-no-tunnel"), extra_config={"deny": {"connect_in_tunnel": False}}
    )
    try:
        yield gw
    finally:
        gw.stop()


def test_without_the_tunnel_curl_shows_the_reason_headers(world: World, plain_gateway: Gateway) -> None:
    sbx = plain_gateway.admit("escape-https")
    mark = world.mark()
    res = plain_gateway.curl(sbx, "https://forbidden.test/")
    assert res.connect_status == 403 and res.rc != 0, res
    assert res.header("x-egressgate-reason") == "host_not_allowed"
    assert "egress denied: host_not_allowed" in res.headers  # the status line's reason phrase
    assert world.hits(mark, listener="forbidden-tls") == []


@pytest.mark.parametrize("client", PY_CLIENTS)
def test_without_the_tunnel_python_clients_raise_with_the_reason(
    world: World, plain_gateway: Gateway, client: str
) -> None:
    sbx = plain_gateway.admit("escape-approval")
    # the refusal, then the positive control: the allowed host works through this gateway too
    out, ok = run_client(
        world,
        world.sbx,
        client,
        ["https://other.allowed.test/", "https://api.allowed.test/"],
        plain_gateway.client_ca,
        proxy_url(plain_gateway, sbx),
    )
    error = out.get("error", "")
    assert "approval_required" in error and "approval_id=apr-" in error and "request_id=" in error, out
    assert ok.get("status") == 200, ok


# ------------------------------------------------------------------ transparent mode: DNS points at the gateway
@pytest.fixture(scope="module")
def trd(world: World, gateway: Gateway) -> Iterator[Transparent]:
    """A transparent sandbox namespace (as a runtime builds one): every TCP connection DNATed to the
    transparent listener, DNS (UDP/TCP 53, any address) to the gateway's resolver, nothing forwarded."""
    ns, ifname = world.add_namespace("trd", GW_SIDE, SOURCE)
    nw.sh("ip", "-n", ns, "addr", "add", f"{RCODE_SOURCE}/32", "dev", f"{nw.PREFIX}{world.sid}trdb")
    (Path("/etc/netns") / ns / "resolv.conf").write_text(f"nameserver {GW_SIDE}\n")
    host, port = gateway.transparent
    dns_host, dns_port = gateway.dns
    nw.sh("ip", "netns", "exec", world.gw, "sysctl", "-qw", f"net.ipv4.conf.{ifname}.route_localnet=1")
    table = "egR_readable"
    ruleset = (
        f"table ip {table} {{\n"
        f"  chain egr_pre {{ type nat hook prerouting priority -100; policy accept;\n"
        f'    iifname "{ifname}" meta l4proto {{ tcp, udp }} th dport 53 dnat to {dns_host}:{dns_port}\n'
        f'    iifname "{ifname}" ip protocol tcp dnat to {host}:{port}\n  }}\n'
        f"  chain egr_fwd {{ type filter hook forward priority 0; policy accept;\n"
        f'    iifname "{ifname}" drop\n    oifname "{ifname}" drop\n  }}\n}}\n'
    )
    nw.sh("ip", "netns", "exec", world.gw, "nft", "-f", "-", input=ruleset)
    sbx = fresh(gateway, "escape-approval", SOURCE)
    fresh(gateway, "escape-readable-rcode", RCODE_SOURCE)
    t = Transparent(world=world, gateway=gateway, ns=ns, ifname=ifname, sbx=sbx, table=table)
    try:
        yield t
    finally:
        nw.sh("ip", "netns", "exec", world.gw, "nft", "delete", "table", "ip", table, check=False)
        # the namespace stays in the session's world (World.namespaces): give it back the world's resolver,
        # which tests/escape/test_world.py checks in every namespace when it runs later on the same worker
        (Path("/etc/netns") / ns / "resolv.conf").write_text(f"nameserver {nw.DNS_ADDR}\n")


def ask(trd: Transparent, name: str, qtype: str = "A", source: str = SOURCE) -> dns.message.Message:
    query = dns.message.make_query(name, qtype)
    return trd.in_tsb(lambda: dns.query.udp(query, GW_SIDE, port=53, source=source, timeout=5))


def addresses(answer: dns.message.Message) -> list[str]:
    return [rr.to_text() for rrset in answer.answer for rr in rrset]


def test_a_denied_name_points_at_the_gateway_and_never_leaves(world: World, gateway: Gateway, trd: Transparent) -> None:
    secret = secrets.token_hex(6)
    name = f"{secret}.exfil.test"
    mark = world.mark()
    answer = ask(trd, name)
    assert answer.rcode() == dns.rcode.NOERROR and addresses(answer) == [GW_SIDE], answer
    aaaa = ask(trd, name, "AAAA")
    assert aaaa.rcode() == dns.rcode.NOERROR and addresses(aaaa) == [], aaaa  # NODATA: use the A answer
    time.sleep(SETTLE)
    assert [q for q in world.dns_queries(mark) if secret in q["qname"]] == []  # the DNS canary heard nothing
    # positive controls: an allowed name is really asked upstream; the canary logs this name when asked
    assert addresses(ask(trd, "api.allowed.test")) == [nw.UPSTREAM]
    assert [q for q in world.dns_queries(mark) if q["qname"] == "api.allowed.test"]
    world.exec(world.open, "dig", "+short", f"@{nw.DNS_ADDR}", name)
    assert [q for q in world.dns_queries(mark) if secret in q["qname"]]


def test_nxdomain_stays_a_policy_choice(world: World, trd: Transparent) -> None:
    secret = secrets.token_hex(6)
    mark = world.mark()
    answer = ask(trd, f"{secret}.exfil.test", source=RCODE_SOURCE)  # escape-readable-rcode: deny_answer rcode
    assert answer.rcode() == dns.rcode.NXDOMAIN and addresses(answer) == [], answer
    assert addresses(ask(trd, "api.allowed.test", source=RCODE_SOURCE)) == [nw.UPSTREAM]  # control
    time.sleep(SETTLE)
    assert [q for q in world.dns_queries(mark) if secret in q["qname"]] == []


def test_transparent_curl_prints_reason_and_approval_id(world: World, gateway: Gateway, trd: Transparent) -> None:
    mark = world.mark()
    res = world.exec(
        trd.ns,
        "curl",
        "-sS",
        "--max-time",
        "20",
        "--cacert",
        str(gateway.client_ca),
        "https://forbidden.test/transparent",
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    assert body["reason"] == "approval_required" and body["approval_id"].startswith("apr-"), body
    record = gateway.audit_record(body["request_id"])
    assert record["egressgate.mode"] == "transparent"
    time.sleep(SETTLE)
    assert world.hits(mark, listener="forbidden-tls") == []
    assert [q for q in world.dns_queries(mark) if q["qname"] == "forbidden.test"] == []
    ok = world.exec(
        trd.ns,
        "curl",
        "-sS",
        "--max-time",
        "20",
        "--cacert",
        str(gateway.client_ca),
        "https://api.allowed.test/transparent-ok",
        timeout=30,
    )
    assert ok.returncode == 0 and "egress_denied" not in ok.stdout, ok
    assert [r["target"] for r in requests_on(world, mark, "upstream-tls")] == ["/transparent-ok"]


@pytest.mark.parametrize("client", PY_CLIENTS)
def test_transparent_python_clients_read_reason_and_approval_id(
    world: World, gateway: Gateway, trd: Transparent, client: str
) -> None:
    mark = world.mark()
    out, ok = run_client(
        world,
        trd.ns,
        client,
        ["https://forbidden.test/py", "https://api.allowed.test/py-transparent"],
        gateway.client_ca,
    )
    assert out.get("status") == 403, out
    body = json.loads(out["body"])
    assert body["reason"] == "approval_required" and body["approval_id"].startswith("apr-"), body
    assert {k.lower(): v for k, v in out["headers"].items()}["x-egressgate-approval-id"] == body["approval_id"]
    assert ok.get("status") == 200, ok  # positive control: the same client in the same namespace
    assert [r["target"] for r in requests_on(world, mark, "upstream-tls")] == ["/py-transparent"]
    assert world.hits(mark, listener="forbidden-tls") == []


NODE_FETCH = (
    "fetch(process.argv[1]).then(async r => console.log(JSON.stringify({status: r.status, "
    "body: await r.text()}))).catch(e => console.log(JSON.stringify({error: String(e.cause || e)})))"
)


def test_transparent_node_fetch_reads_reason_and_approval_id(world: World, gateway: Gateway, trd: Transparent) -> None:
    mark = world.mark()

    def fetch(url: str) -> dict:
        res = world.exec(
            trd.ns, "env", f"NODE_EXTRA_CA_CERTS={gateway.client_ca}", "node", "-e", NODE_FETCH, url, timeout=60
        )
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1])

    out = fetch("https://forbidden.test/node")
    assert out.get("status") == 403, out
    body = json.loads(out["body"])
    assert body["reason"] == "approval_required" and body["approval_id"].startswith("apr-"), body
    assert fetch("https://api.allowed.test/node-ok").get("status") == 200
    assert [r["target"] for r in requests_on(world, mark, "upstream-tls")] == ["/node-ok"]
    assert world.hits(mark, listener="forbidden-tls") == []
