"""`egressgate run` serves DNS beside the proxy: a sandbox admitted with `--address` resolves only its
policy's names, through the configured upstream (the test's own loopback resolver)."""

from __future__ import annotations

import json

import dns.message
import dns.query
import dns.rcode
import httpx
import pytest

from tests.support.gwworld import start_gateway
from tests.support.launcher import stop_gateway

SANDBOX_SOURCE = "127.0.0.9"
OTHER_SOURCE = "127.0.0.10"


@pytest.fixture(scope="module")
def dns_gateway(world, tmp_path_factory):
    gw = start_gateway(world, tmp_path_factory.mktemp("gwdns"), {
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": "127.0.0.1:0",
                   "transparent": "127.0.0.2:0"},
        "dns": {"upstreams": [f"127.0.0.1:{world.dns_port}"], "cache_min_ttl": 0},
    })
    try:
        yield gw
    finally:
        stop_gateway(gw)


def _dns_port(gw) -> int:
    info = json.loads((gw.var / "gateway.json").read_text())
    return int(info["dns"].rpartition(":")[2])


def ask(gw, name: str, source: str, qtype: str = "A") -> dns.message.Message:
    query = dns.message.make_query(name, qtype)
    return dns.query.udp(query, "127.0.0.1", port=_dns_port(gw), source=source, timeout=5)


def admit(gw, policy: str, addresses: list[str]) -> httpx.Response:
    return httpx.post(f"http://{gw.admin}/v1/sandboxes",
                      json={"policy": policy, "labels": {}, "addresses": addresses},
                      headers={"Authorization": f"Bearer {gw.token}"}, timeout=10, trust_env=False)


def test_admitted_source_resolves_only_its_policy_names(dns_gateway, world):
    res = admit(dns_gateway, "gw-basic", [SANDBOX_SOURCE])
    assert res.status_code == 201, res.text
    body = res.json()
    assert body["addresses"] == [SANDBOX_SOURCE]
    assert body["dns"] == f"127.0.0.1:{_dns_port(dns_gateway)}"

    before = dict(world.dns.counts)
    allowed = ask(dns_gateway, "api.test", SANDBOX_SOURCE)
    assert allowed.rcode() == dns.rcode.NOERROR
    assert [rr.to_text() for rrset in allowed.answer for rr in rrset] == ["127.0.0.1"]
    assert world.dns.counts.get("api.test", 0) == before.get("api.test", 0) + 1  # really forwarded

    # a name outside the policy: NXDOMAIN, and the upstream never sees it (no exfiltration in names)
    denied = ask(dns_gateway, "c2VjcmV0.exfil.test", SANDBOX_SOURCE)
    assert denied.rcode() == dns.rcode.NXDOMAIN
    assert "c2vjcmv0.exfil.test" not in world.dns.counts

    # an allowed name whose answer is a forbidden address (the canary) comes back empty
    stripped = ask(dns_gateway, "canary.test", SANDBOX_SOURCE)
    assert not stripped.answer
    # positive control: under a policy whose allow_private covers it, the same answer comes through
    assert admit(dns_gateway, "canary-open", ["127.0.0.12"]).status_code == 201
    control = ask(dns_gateway, "canary.test", "127.0.0.12")
    assert [rr.to_text() for rrset in control.answer for rr in rrset] == ["127.0.0.2"]

    # an unregistered source gets nothing, even for allowed names
    unknown = ask(dns_gateway, "api.test", OTHER_SOURCE)
    assert unknown.rcode() == dns.rcode.REFUSED


def test_source_address_cannot_be_registered_twice(dns_gateway):
    first = admit(dns_gateway, "gw-basic", ["127.0.0.11"])
    assert first.status_code == 201, first.text
    second = admit(dns_gateway, "gw-noprivate", ["127.0.0.11"])
    assert second.status_code == 409 and "already registered" in second.text
    assert admit(dns_gateway, "gw-basic", ["not-an-ip"]).status_code == 400
    # after revocation the address is free again
    revoked = httpx.delete(f"http://{dns_gateway.admin}/v1/sandboxes/{first.json()['id']}",
                           headers={"Authorization": f"Bearer {dns_gateway.token}"}, timeout=10, trust_env=False)
    assert revoked.status_code in (200, 204)
    assert admit(dns_gateway, "gw-noprivate", ["127.0.0.11"]).status_code == 201


def test_admission_formats_for_shells_and_env_files(dns_gateway):
    """`sandbox admit --format shell|env-file`: the same env, ready for eval or docker --env-file."""
    import shlex

    from tests.support import cli
    from tests.support.launcher import EGRESSGATE

    def admit_cli(fmt: str) -> str:
        out = cli.run([EGRESSGATE, "sandbox", "admit", "--config", str(dns_gateway.config),
                       "--policy", "gw-basic", "--format", fmt], check=True, timeout=30)
        return out.stdout

    shell = admit_cli("shell")
    exported = dict(line.removeprefix("export ").split("=", 1) for line in shell.splitlines())
    env = {k: shlex.split(v)[0] if v != "''" else "" for k, v in exported.items()}
    assert env["NO_PROXY"] == "" and env["EGRESSGATE_SANDBOX_ID"].startswith("sbx-")
    assert env["HTTPS_PROXY"].startswith("http://" + env["EGRESSGATE_SANDBOX_ID"] + ":")
    assert env["SSL_CERT_FILE"].startswith("/")  # absolute: the sandbox does not share our cwd
    env_file = dict(line.split("=", 1) for line in admit_cli("env-file").splitlines())
    assert env_file.keys() == env.keys() and env_file["EGRESSGATE_SANDBOX_ID"] != env["EGRESSGATE_SANDBOX_ID"]
