"""The running gateway's policy watcher survives hostile policy files: each is rejected (logged with the
file, audited), the previous set stays in force, and a later valid edit IS reloaded by the watch alone
(no SIGHUP). On the old code a complex key raised TypeError inside the watcher task and ended it."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from tests.support.gwworld import start_gateway
from tests.support.launcher import stop_gateway
from tests.support.waiting import wait_for

HOSTILE = {
    "complex key": "? [a, b]\n: 1\n",
    "deep nesting": "description: " + "[" * 5000 + "]" * 5000 + "\n",
    "alias bomb": "x:\n  - &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"  - &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 9)) + "description: *a8\n",
}


@pytest.fixture
def gateway_watch(gateway, tmp_path):
    gw = start_gateway(gateway.world, tmp_path)
    yield gw
    stop_gateway(gw)


def test_watcher_survives_hostile_files_and_reloads_a_later_fix(gateway_watch):
    gw = gateway_watch
    sbx = gw.admit("gw-basic")
    path = gw.policy_dir / "gw-basic.yaml"
    good = yaml.safe_load(path.read_text())
    stderr = gw.var.parent / "gateway.stderr"
    with sbx.client() as c:
        assert c.get(sbx.url("api.test", "/echo")).status_code == 200
    for name, text in HOSTILE.items():
        mark = stderr.read_text().count("policy reload rejected")
        path.write_text(yaml.safe_dump(good) + text)
        assert wait_for(lambda m=mark: stderr.read_text().count("policy reload rejected") > m, timeout=10), name
        assert f"{path}: line" in stderr.read_text()
        with sbx.client() as c:
            assert c.get(sbx.url("api.test", "/echo")).status_code == 200, name  # old set still in force
        time.sleep(0.05)  # a distinct mtime for the next write
    assert "Traceback" not in stderr.read_text().split("policy reload rejected", 1)[1]
    # the fix: /echo is no longer allowed; applied by the file watch only
    changed = json.loads(json.dumps(good))
    changed["network"]["https"]["allow"][0]["paths"] = ["/v1/**"]
    path.write_text(yaml.safe_dump(changed))

    def denied_now() -> bool:
        with sbx.client() as c:
            return c.get(sbx.url("api.test", "/echo")).status_code == 403
    assert wait_for(denied_now, timeout=10)
    reloads = [r for r in gw.audit_records() if r.get("egressgate.operation") == "policy_reload"]
    rejected = [r for r in reloads if r.get("egressgate.decision") == "deny"]
    assert len(rejected) >= len(HOSTILE) and all(str(path) in r.get("egressgate.message", "") for r in rejected)
    assert reloads[-1].get("egressgate.decision") == "allow"
