"""Admin API additions for `egressgate sandbox run` (issue 10): the admission hands out the policy's
runtime sections, the revocation accepts how the workload ended and audits it (egressgate.run.*), and
an outcome body that is not exactly the documented shape is refused (400) without revoking or recording
anything from it: these values go into the audit trail."""

from __future__ import annotations

import json
import time

import httpx
import pytest


def delete(gw, sandbox_id: str, body: object | None) -> httpx.Response:
    content = None if body is None else json.dumps(body).encode()
    return httpx.request("DELETE", f"http://{gw.admin}/v1/sandboxes/{sandbox_id}", content=content, timeout=10,
                         trust_env=False, headers={"Authorization": f"Bearer {gw.token}",
                                                   "Content-Type": "application/json"})


def revocations(gw, sandbox_id: str, timeout: float = 5.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in gw.audit_records() if r.get("egressgate.operation") == "revocation"
                 and r.get("egressgate.sandbox.id") == sandbox_id]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_admission_hands_out_the_runtime_sections(gateway):
    res = httpx.post(f"http://{gateway.admin}/v1/sandboxes", json={"policy": "gw-basic"}, timeout=10,
                     trust_env=False, headers={"Authorization": f"Bearer {gateway.token}"})
    assert res.status_code == 201, res.text
    runtime = res.json()["runtime_policy"]
    assert set(runtime) == {"sandbox", "filesystem", "execution", "persistence", "keys"}
    # the keys the policy sets (policy/enforcement.py), which `sandbox run` checks against its runtime
    assert {"sandbox.name", "sandbox.root_fs", "sandbox.tmp.max_bytes"} <= set(runtime["keys"])
    assert "network.{https,http,tcp}.{allow,deny}[].host" in runtime["keys"]
    assert runtime["persistence"] is None  # the policy has no persistence section (runtimes/persist.py)
    assert runtime["sandbox"]["name"] == "gw-basic" and runtime["sandbox"]["root_fs"] == "read_only"
    assert runtime["filesystem"] == {"allow": [], "deny": []}
    assert runtime["execution"]["commands"] == []


def test_outcome_is_audited_on_the_revocation(gateway):
    sbx = gateway.admit("gw-basic")
    outcome = {"runtime": "netns", "exit_code": 121, "status": None, "signal": 9, "limit": "memory",
               "duration_ms": 1234, "dropped": {"udp": 3, "ipv6": 0}}
    res = delete(gateway, sbx.id, {"outcome": outcome})
    assert res.status_code == 200, res.text
    (record,) = revocations(gateway, sbx.id)
    got = {k: str(v) for k, v in record.items() if k.startswith("egressgate.run.")}  # OTLP intValue: a string
    assert got == {"egressgate.run.runtime": "netns", "egressgate.run.exit_code": "121",
                   "egressgate.run.signal": "9", "egressgate.run.limit": "memory",
                   "egressgate.run.duration_ms": "1234", "egressgate.run.dropped.udp": "3",
                   "egressgate.run.dropped.ipv6": "0"}, got


BAD = {
    "unknown_top_key": {"outcome": {"runtime": "netns"}, "x": 1},
    "outcome_not_object": {"outcome": "done"},
    "unknown_outcome_key": {"outcome": {"runtime": "netns", "note": "hello"}},
    "bad_runtime": {"outcome": {"runtime": "kvm"}},
    "bad_limit": {"outcome": {"runtime": "netns", "limit": "disk"}},
    "negative_code": {"outcome": {"runtime": "netns", "exit_code": -1}},
    "bool_code": {"outcome": {"runtime": "netns", "exit_code": True}},
    "float_code": {"outcome": {"runtime": "netns", "duration_ms": 1.5}},
    "huge_code": {"outcome": {"runtime": "netns", "duration_ms": 2**60}},
    "bad_ended_by": {"outcome": {"runtime": "netns", "ended_by": "user"}},
    "dropped_unknown": {"outcome": {"runtime": "netns", "dropped": {"sctp": 1}}},
    "dropped_string": {"outcome": {"runtime": "netns", "dropped": {"udp": "1"}}},
    "not_an_object": ["outcome"],
    "setid_not_list": {"outcome": {"runtime": "netns", "setid_stripped": "a"}},
    "setid_empty": {"outcome": {"runtime": "netns", "setid_stripped": []}},
    "setid_not_str": {"outcome": {"runtime": "netns", "setid_stripped": [1]}},
    "setid_nul": {"outcome": {"runtime": "netns", "setid_stripped": ["a\0b"]}},
    "setid_too_many": {"outcome": {"runtime": "netns", "setid_stripped": ["f"] * 101}},
    "bad_accel": {"outcome": {"runtime": "microvm", "accel": "hvf"}},
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_outcome_is_refused_and_revokes_nothing(gateway, name):
    sbx = gateway.admit("gw-basic")
    res = delete(gateway, sbx.id, BAD[name])
    assert res.status_code == 400, res.text
    assert res.json()["error"] == "invalid_request"
    assert revocations(gateway, sbx.id, timeout=0.3) == []
    # positive control: the plain revocation (what `sandbox run` falls back to) still works
    assert delete(gateway, sbx.id, None).status_code == 200
    (record,) = revocations(gateway, sbx.id)
    assert not any(k.startswith("egressgate.run.") for k in record)


def test_runtime_file_publishes_what_sandbox_run_needs(gateway):
    data = json.loads((gateway.var / "gateway.json").read_text())
    assert data["runtime"]["subnet"] == "198.18.128.0/17" and data["runtime"]["state_dir"].startswith("/")
    assert data["admin_token_file"].endswith("admin.token")
    assert data["audit_file"] == str((gateway.var / "audit.jsonl").absolute())


def test_microvm_accelerator_is_audited(gateway):
    """The microvm runtime says whether its guest had hardware virtualization (kvm) or software emulation."""
    sbx = gateway.admit("gw-basic")
    res = delete(gateway, sbx.id, {"outcome": {"runtime": "microvm", "accel": "tcg", "exit_code": 0}})
    assert res.status_code == 200, res.text
    (record,) = revocations(gateway, sbx.id)
    assert record["egressgate.run.runtime"] == "microvm" and record["egressgate.run.accel"] == "tcg"
