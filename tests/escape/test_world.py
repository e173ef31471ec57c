"""Self-tests of the network world: without these, "canary untouched" would prove nothing.

Each canary must be live (a direct request from the gateway namespace is answered and logged), the
direct path from a sandbox position must exist (the ``open`` namespace reaches the canaries), and the
sandbox namespace's firewall must be what stops it (``sbx`` cannot, and its reject counter moves).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import tests.networld as nw
from tests.networld import World

pytestmark = pytest.mark.netns

ALL_CANARIES = {**nw.NET_CANARIES, **nw.GW_CANARIES}


def url_of(addr: str, port: int, tls: bool, path: str = "/probe") -> str:
    host = f"[{addr}]" if ":" in addr else addr
    return f"{'https' if tls else 'http'}://{host}:{port}{path}"


def reject_count(world: World) -> int:
    out = world.exec(world.sbx, "nft", "-j", "list", "chain", "inet", "egw_sandbox", "out").stdout
    for item in json.loads(out)["nftables"]:
        for expr in item.get("rule", {}).get("expr", []):
            if "counter" in expr:
                return int(expr["counter"]["packets"])
    raise AssertionError("sandbox firewall has no reject counter")


@pytest.mark.parametrize("name", sorted(ALL_CANARIES))
def test_canary_is_live_from_gateway_namespace(world: World, name: str) -> None:
    addr, port, tls = ALL_CANARIES[name]
    mark = world.mark()
    res = world.curl(world.gw, url_of(addr, port, tls))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["banner"] == f"CANARY:{name}"
    events = [h["event"] for h in world.hits(mark, listener=name)]
    assert events[0] == "accept" and "request" in events


def test_allowed_upstream_serves_tls_for_its_name_and_logs_sni(world: World) -> None:
    mark = world.mark()
    res = world.curl(world.gw, "--resolve", f"api.allowed.test:443:{nw.UPSTREAM}", "https://api.allowed.test/x")
    assert res.returncode == 0, res.stderr
    [req] = [h for h in world.hits(mark, listener="upstream-tls") if h["event"] == "request"]
    assert (req["sni"], req["host"], req["target"]) == ("api.allowed.test", "api.allowed.test", "/x")


def test_upstream_redirects_to_metadata(world: World) -> None:
    res = world.curl(world.gw, "-i", f"http://{nw.UPSTREAM}/redirect-metadata")
    assert res.stdout.startswith("HTTP/1.1 302")
    assert "Location: http://169.254.169.254/latest/meta-data/" in res.stdout


@pytest.mark.parametrize("target", ["169.254.169.254:80", "[fd00:ec2::254]:80", "10.0.0.5:443"])
def test_open_namespace_has_a_direct_path(world: World, target: str) -> None:
    """Positive control for the no-bypass tests: the same position without the firewall gets through."""
    scheme = "https" if target.endswith(":443") else "http"
    res = world.curl(world.open, f"{scheme}://{target}/direct")
    assert res.returncode == 0, res.stderr
    assert "CANARY:" in res.stdout


@pytest.mark.parametrize("target", ["http://169.254.169.254/", "http://[fd00:ec2::254]/",
                                    "https://10.0.0.5/", f"https://{nw.UPSTREAM}/", "http://127.0.0.2:80/"])
def test_sandbox_namespace_cannot_connect_directly(world: World, target: str) -> None:
    mark, before = world.mark(), reject_count(world)
    start = time.monotonic()
    res = world.curl(world.sbx, target)
    assert res.returncode != 0
    assert time.monotonic() - start < 5, "a bypass attempt should be rejected, not time out"
    time.sleep(0.1)
    assert world.canary_hits(mark) == []
    assert [h for h in world.hits(mark) if h.get("peer", "").startswith(nw.SBX)] == []
    if "127.0.0.2" not in target:  # loopback is allowed inside the sandbox (its own lo, nothing there)
        assert reject_count(world) > before


@pytest.mark.parametrize("proto", ["+notcp", "+tcp"])
def test_sandbox_namespace_cannot_reach_the_resolver(world: World, proto: str) -> None:
    mark = world.mark()
    res = world.exec(world.sbx, "dig", proto, "+time=1", "+tries=1", f"@{nw.DNS_ADDR}", "api.allowed.test")
    assert "198.18.1.10" not in res.stdout
    assert world.dns_queries(mark) == []
    control = world.exec(world.open, "dig", proto, "+short", f"@{nw.DNS_ADDR}", "api.allowed.test")
    assert control.stdout.split() == [nw.UPSTREAM]
    assert len(world.dns_queries(mark)) >= 1  # (a retry may add one)


def test_dns_rebinding_mode_alternates_with_ttl_zero(world: World) -> None:
    answers = []
    for _ in range(4):
        res = world.exec(world.gw, "dig", "+noall", "+answer", f"@{nw.DNS_ADDR}", "rebind.evil.test")
        [line] = res.stdout.strip().splitlines()
        fields = line.split()
        assert fields[1] == "0", "rebinding answers must carry TTL 0"
        answers.append(fields[-1])
    assert set(answers) == {nw.UPSTREAM, "169.254.169.254"}
    assert answers[0] != answers[1] and answers[1] != answers[2]


def test_dns_answers_are_test_controlled(world: World) -> None:
    records = dict(nw.DEFAULT_DNS)
    records["flip.evil.test"] = {"A": ["10.0.0.5"], "AAAA": ["::ffff:169.254.169.254"]}
    world.set_dns(records)
    try:
        dig = ("dig", "+short", f"@{nw.DNS_ADDR}", "flip.evil.test")
        a = world.exec(world.gw, *dig, "A").stdout.split()
        aaaa = world.exec(world.gw, *dig, "AAAA").stdout.split()
        nx = world.exec(world.gw, "dig", f"@{nw.DNS_ADDR}", "nothing.evil.test").stdout
    finally:
        world.set_dns(nw.DEFAULT_DNS)
    assert a == ["10.0.0.5"] and aaaa == ["::ffff:169.254.169.254"]
    assert "NXDOMAIN" in nx


def test_namespaces_resolve_only_inside_the_world(world: World) -> None:
    for ns in world.namespaces:
        assert world.exec(ns, "cat", "/etc/resolv.conf").stdout.split() == ["nameserver", nw.DNS_ADDR]


def test_world_cleans_up_completely(tmp_path: Path) -> None:
    w = World.create(tmp_path)
    names = w.namespaces
    listed = world_listing()
    assert all(n in listed for n in names)
    w.close()
    listed = world_listing()
    assert not any(n in listed for n in names)
    assert not any((Path("/etc/netns") / n).exists() for n in names)
    assert not (nw.REGISTRY / f"{w.sid}.json").exists()


def world_listing() -> str:
    return nw.sh("ip", "netns", "list").stdout


def test_world_has_no_link_to_the_host_network(world: World) -> None:
    """Closure: only loopback and the world's own veths exist inside, nothing of ours outside, and an
    outside address has no route from the namespace that plays the internet (checked with
    `ip route get`, which sends nothing)."""
    prefix = f"{nw.PREFIX}{world.sid}"
    for ns in world.namespaces:
        links = world.exec(ns, "ip", "-o", "link").stdout.splitlines()
        names = {line.split(":")[1].strip().split("@")[0] for line in links}
        assert names <= {"lo"} | {n for n in names if n.startswith(prefix)}, (ns, names)
    host_links = nw.sh("ip", "-o", "link").stdout
    assert prefix not in host_links
    for target in ("192.0.2.1", "2001:db8::1"):
        route = world.exec(world.net, "ip", "route", "get", target)
        assert route.returncode != 0 and "unreachable" in route.stderr.lower(), (target, route.stdout)
