"""The control-API world: the loopback world of tests/gateway (real upstreams, real `egressgate run`)
with the gateway's DNS listener on, and one more policy (`c12-metrics`) that has every kind of budget
and a credentialed route, so usage, budgets left, broker mints and DNS rcodes all have something to show.

Helpers read the real server from outside, as an operator's tools would: `scrape` parses /metrics with
prometheus-client's own parser; `api` calls a route with the admin token.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dns.message
import dns.query
import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gwworld import Gateway, World, policies
from tests.support.launcher import launch_loopback, write_policies

METRICS_POLICY = "c12-metrics"
APPROVE_POLICY = "c12-approve"
MCP_LOCAL_POLICY = "c13-mcp-local"  # a local MCP server (`egressgate mcp run`): the /v1/.../mcp routes
DNS_SOURCE = "127.0.0.41"


def control_policies(w: World) -> dict[str, dict]:
    https = w.https_port
    return {**policies(w), METRICS_POLICY: {
        "sandbox": {"name": METRICS_POLICY, "resources": {"outbound_bytes_max": 1_000_000}},
        "network": {
            "allow_private": ["127.0.0.1/32"],
            "dns": {"budget": {"queries": 100, "name_bytes": 10_000}},
            "https": {"allow": [
                {"id": "c12-get", "host": "api.test", "ports": [https], "methods": ["GET"],
                 "paths": ["/echo", "/v1/**"], "budget": {"requests": 3}},
                {"id": "c12-post", "host": "api.test", "ports": [https], "methods": ["POST"], "paths": ["/upload"],
                 "budget": {"bytes": 500_000}},
                {"id": "c12-cred", "host": "other.test", "ports": [https], "methods": ["GET"], "credential": "billing"},
            ]},
        },
        "credentials": {"capabilities": {"billing": {"type": "jwt", "ttl_seconds": 120}}},
    }, APPROVE_POLICY: {
        # anything outside this allowlist asks an operator (egressgate/approvals): the approvals routes
        "sandbox": {"name": APPROVE_POLICY},
        "network": {"allow_private": ["127.0.0.1/32"], "http": {"allow": [
            {"id": "c12-plain", "host": "api.test", "ports": [w.http_port], "methods": ["GET"]}]}},
        "execution": {"require_approval_for": ["network_expansion"]},
    }, MCP_LOCAL_POLICY: {
        "sandbox": {"name": MCP_LOCAL_POLICY}, "execution": {"local_mcp_servers": "allow"},
        "mcp": {"servers": [{"name": "tools", "local": True, "tools": {"allow": [{"name": "echo"}]}}]},
    }}


def start_control_gateway(w: World, tmp: Path, extra: dict[str, Any] | None = None,
                          docs: dict[str, dict] | None = None, launcher: list[str] | None = None,
                          args: Sequence[str] = ()) -> Gateway:
    policy_dir = write_policies(tmp / "policies", docs if docs is not None else control_policies(w))
    ca_bundle = tmp / "upstream-ca.pem"
    ca_bundle.write_bytes(w.ca.cert_pem.bytes())
    config = {
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": "127.0.0.1:0", "transparent": None},
        "policy": str(policy_dir),
        "var_dir": str(tmp / "var"),
        "upstream": {"resolver": f"127.0.0.1:{w.dns_port}", "ca_bundle": str(ca_bundle)},
        "dns": {"upstreams": [f"127.0.0.1:{w.dns_port}"], "cache_min_ttl": 0},
        "broker": {"local_key_dir": str(tmp / "var" / "keys")},
        **(extra or {}),
    }
    return Gateway(**launch_loopback(tmp, config, launcher=launcher, args=args), policy_dir=policy_dir, world=w)


# The admin API is plain HTTP, yet every httpx client builds a TLS context and loads certifi's bundle into it
# (~16 ms of CPU; 0.2 s of wall on this 2-core machine under load): one context for every call instead, so a
# test that makes a hundred calls is not slowed past its timeout by contexts it never uses.
_UNUSED_TLS = ssl.create_default_context()


def api(gw: Gateway, method: str, path: str, token: str | None = "", **kw: Any) -> httpx.Response:
    """One request to the admin API on a new connection (with several workers behind the admin address,
    the kernel picks one per connection); `token=None` sends none, "" the gateway's own."""
    headers = dict(kw.pop("headers", {}))
    if token is not None:
        headers["Authorization"] = f"Bearer {token or gw.token}"
    return httpx.request(method, f"http://{gw.admin}{path}", headers=headers, timeout=10, trust_env=False,
                         verify=_UNUSED_TLS, **kw)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
SCRAPED_BY = "scraped_by"  # not a metric: the `worker` label every egressgate_* sample of the scrape had


def scrape(gw: Gateway) -> Samples:
    res = api(gw, "GET", "/metrics")
    assert res.status_code == 200, res.text
    out: Samples = {}
    workers = set()
    for family in text_string_to_metric_families(res.text):
        for sample in family.samples:
            labels = dict(sample.labels)
            workers.add(labels.pop("worker"))  # every sample names its process
            out[(sample.name, tuple(sorted(labels.items())))] = sample.value
    assert len(workers) == 1, workers  # one process answered the whole scrape
    out[(SCRAPED_BY, (("worker", workers.pop()),))] = 1.0
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: Samples, after: Samples) -> dict[tuple, float]:
    """Every sample that changed, with by how much."""
    keys = set(before) | set(after)
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys if after.get(k, 0.0) != before.get(k, 0.0)}


def dns_port(gw: Gateway) -> int:
    return int(json.loads((gw.var / "gateway.json").read_text())["dns"].rpartition(":")[2])


def ask(gw: Gateway, name: str, source: str = DNS_SOURCE) -> dns.message.Message:
    return dns.query.udp(dns.message.make_query(name, "A"), "127.0.0.1", port=dns_port(gw), source=source,
                         timeout=5)
