"""`egressgate sandbox list|show` against the running gateway (the CLI as an operator runs it): the list
shows admitted sandboxes with their state and open connections; show prints labels, usage and what is
left of each budget, which moves with real traffic."""

from __future__ import annotations

import json
import os
import subprocess

from tests.control_api.harness import METRICS_POLICY
from tests.support import cli as support_cli
from tests.support.launcher import EGRESSGATE


def cli(gw, *args: str) -> subprocess.CompletedProcess:
    return support_cli.run([EGRESSGATE, "sandbox", *args, "--config", str(gw.config)], timeout=30,
                           env={**os.environ, "NO_PROXY": ""})


def test_list_and_show_follow_real_traffic(cgw):
    sbx = cgw.admit(METRICS_POLICY, labels={"team": "c12cli"})
    other = cgw.admit("gw-basic")
    with sbx.client() as c:
        held = c.get(sbx.url("api.test", "/echo"))  # the client keeps its connection open while we look
        assert held.status_code == 200
        listing = cli(cgw, "list", "--policy", METRICS_POLICY)
        assert listing.returncode == 0, listing.stderr
        rows = {line.split()[0]: line.split() for line in listing.stdout.splitlines()[1:]}
        assert rows[sbx.id][1:4] == [METRICS_POLICY, "active", "1"] and "team=c12cli" in rows[sbx.id]
        assert other.id not in rows  # --policy filters
        shown = cli(cgw, "show", sbx.id)
        assert shown.returncode == 0, shown.stderr
        detail = json.loads(shown.stdout)
    assert detail["labels"] == {"team": "c12cli"} and detail["connections"] == 1
    assert detail["usage"]["rules"]["c12-get"]["requests"] == 1
    assert detail["budgets"]["rules"]["c12-get"]["requests"] == {"limit": 3, "used": 1, "left": 2}
    out = detail["budgets"]["outbound_bytes"]
    assert out["limit"] == 1_000_000 and out["used"] == detail["usage"]["bytes_out"] > 0
    assert out["left"] == 1_000_000 - out["used"]
    assert detail["budgets"]["dns_queries"] == {"limit": 100, "used": 0, "left": 100}

    assert cgw.revoke(sbx.id).status_code == 200
    revoked = cli(cgw, "list", "--revoked", "--json")
    assert sbx.id in [s["id"] for s in json.loads(revoked.stdout)["sandboxes"]]
    active = cli(cgw, "list", "--active", "--json")
    assert sbx.id not in [s["id"] for s in json.loads(active.stdout)["sandboxes"]]


def test_show_unknown_sandbox_fails_with_the_reason(cgw):
    res = cli(cgw, "show", "sbx-ffffffffffffffff")
    assert res.returncode != 0 and "unknown_sandbox (404)" in res.stderr
