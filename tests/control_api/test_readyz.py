"""/readyz against real failures: a full audit disk (a real tiny tmpfs) and an unreachable Vault make the
gateway unready with the component that failed named; freeing the disk makes it ready again (positive
control); a broker no loaded policy needs does not make it unready."""

from __future__ import annotations

import socket

from tests.control_api.harness import METRICS_POLICY, api, control_policies, start_control_gateway
from tests.support.replay_check import stop_and_replay
from tests.support.tmpfs import fill, tiny_tmpfs
from tests.support.waiting import wait_for


def _ready(gw) -> tuple[int, dict]:
    res = api(gw, "GET", "/readyz", token=None)
    return res.status_code, res.json()


def test_ready_when_every_component_answers(cgw):
    status, body = _ready(cgw)
    assert status == 200 and body["status"] == "ready", body
    assert {name: c["status"] for name, c in body["components"].items()} == {"state": "ok", "audit": "ok",
                                                                             "broker": "ok"}
    assert body["components"]["broker"] == {"status": "ok", "required": True, "backend": "local"}


def test_full_audit_disk_makes_the_gateway_unready_until_space_returns(world, tmp_path):
    with tiny_tmpfs(tmp_path / "auditfs", "128k") as mnt:
        gw = start_control_gateway(world, tmp_path / "gw", {"audit": {"path": str(mnt / "audit.jsonl")}})
        try:
            assert _ready(gw)[0] == 200
            filler = fill(mnt)
            refused = api(gw, "POST", "/v1/sandboxes", json={"policy": METRICS_POLICY})
            assert refused.status_code == 503 and refused.json()["error"] == "audit_unavailable"
            assert wait_for(lambda: _ready(gw)[0] == 503, timeout=10)
            _, body = _ready(gw)
            assert body["status"] == "not_ready" and body["components"]["audit"]["status"] == "unavailable"
            assert body["components"]["state"]["status"] == "ok"
            filler.unlink()
            assert wait_for(lambda: _ready(gw)[0] == 200, timeout=10), _ready(gw)
        finally:
            stop_and_replay(gw)


def _dead_port() -> socket.socket:
    """A port that is bound and never listening: nothing answers there while the socket lives."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def test_unreachable_vault_makes_the_gateway_unready_only_when_a_policy_needs_it(world, tmp_path):
    dead = _dead_port()
    token_file = tmp_path / "vault-token"
    token_file.write_text("not-a-real-token\n")
    token_file.chmod(0o600)
    broker = {"broker": {"backend": "vault", "vault_addr": f"http://127.0.0.1:{dead.getsockname()[1]}",
                         "auth": "token", "token_file": str(token_file), "timeout_seconds": 1},
              "audit": {"signer": "local"}}
    try:
        docs = control_policies(world)
        gw = start_control_gateway(world, tmp_path / "needs", broker, docs=docs)
        try:
            status, body = _ready(gw)
            assert status == 503 and body["status"] == "not_ready", body
            assert body["components"]["broker"]["status"] == "unavailable"
            assert body["components"]["broker"]["required"] is True
            assert body["components"]["broker"]["backend"] == "vault"
            assert body["components"]["audit"]["status"] == "ok" and body["components"]["state"]["status"] == "ok"
        finally:
            stop_and_replay(gw)
        # the same dead Vault, but no policy has a capability: ready, and the broker still reported
        plain = {name: doc for name, doc in docs.items() if not doc.get("credentials")}
        gw = start_control_gateway(world, tmp_path / "plain", broker, docs=plain)
        try:
            status, body = _ready(gw)
            assert status == 200 and body["status"] == "ready", body
            assert body["components"]["broker"]["status"] == "unavailable"
            assert body["components"]["broker"]["required"] is False
        finally:
            stop_and_replay(gw)
    finally:
        dead.close()
