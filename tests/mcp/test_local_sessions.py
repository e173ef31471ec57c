"""The gateway's side of local MCP sessions (admin/mcp_api.py) on a real admin server, real state store and
real audit file: a relay killed with SIGKILL never ends its session, so the sweeper must — its unanswered
call is recorded `no_response` and the session table does not grow with dead sandboxes."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from egressgate.admin.server import AdminServer
from egressgate.audit.config import open_audit_sink
from egressgate.config import load_config
from egressgate.gateway.shared.context import PolicyHolder, Runtime
from egressgate.mcp.local import read_line
from egressgate.policy.loader import load_policies
from egressgate.state.memory import MemoryState
from tests.support.launcher import audit_records, write_policies

POLICY = {"sandbox": {"name": "s13-local"}, "execution": {"local_mcp_servers": "allow"},
          "mcp": {"servers": [{"name": "tools", "local": True, "tools": {"allow": [{"name": "echo"}]}}]}}
CALL = b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"echo","arguments":{}}}'


@contextlib.asynccontextmanager
async def admin(tmp_path: Path) -> AsyncIterator[tuple[Runtime, AdminServer, httpx.AsyncClient]]:
    """A real admin server (policy s13-local, memory state, audit file under tmp_path/var) and a client
    holding its token; the audit sink is closed (every record on disk) when the block ends."""
    policy_dir = write_policies(tmp_path / "policies", {"s13-local": POLICY})
    cfg = load_config(None, {"var_dir": str(tmp_path / "var"), "policy": str(policy_dir)})
    sink = await open_audit_sink(cfg.audit, tmp_path / "var")
    rt = Runtime(config=cfg, policies=PolicyHolder(load_policies(policy_dir)), state=MemoryState(), audit=sink,
                 resolver=None, ledger=None)  # type: ignore[arg-type]  # the admin server uses neither
    server = AdminServer(rt, "t" * 32)
    host, port = await server.start("127.0.0.1", 0)
    headers = {"Authorization": "Bearer " + "t" * 32}
    try:
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", headers=headers, trust_env=False) as c:
            yield rt, server, c
    finally:
        await server.stop()
        await sink.close()


async def test_sweeper_ends_sessions_of_revoked_sandboxes(tmp_path: Path) -> None:
    async with admin(tmp_path) as (_rt, server, c):
        sid = (await c.post("/v1/sandboxes", json={"policy": "s13-local"})).json()["id"]
        sent = await c.post(f"/v1/sandboxes/{sid}/mcp/tools/messages?direction=to_server", content=CALL)
        assert sent.status_code == 200 and sent.json()["forward"] is not None  # an allowed call, unanswered
        await server.mcp.sweep()
        assert (sid, "tools") in server.mcp.sessions  # positive control: a live sandbox keeps its session
        assert (await c.delete(f"/v1/sandboxes/{sid}")).status_code == 200  # no DELETE of the session
        await server.mcp.sweep()
        assert server.mcp.sessions == {}
    records = audit_records(tmp_path / "var" / "audit.jsonl")
    outcomes = [r for r in records if r.get("egressgate.mcp.outcome") == "no_response"]
    assert outcomes and outcomes[0]["egressgate.sandbox.id"] == sid, records


async def test_a_reload_that_withdraws_local_servers_ends_the_session(tmp_path: Path) -> None:
    """The start check is not the only one: every line is checked against the policy in force, so a reload
    to `execution.local_mcp_servers: deny` refuses the next line (403, audited) and ends the session."""
    withdrawn = write_policies(tmp_path / "withdrawn", {"s13-local": {**POLICY, "execution": {}}})
    path = "/v1/sandboxes/{}/mcp/tools/messages?direction=to_server"
    async with admin(tmp_path) as (rt, server, c):
        sid = (await c.post("/v1/sandboxes", json={"policy": "s13-local"})).json()["id"]
        assert (await c.post(path.format(sid), content=CALL)).json()["forward"] is not None  # positive control
        rt.policies.replace(load_policies(withdrawn))
        refused = await c.post(path.format(sid), content=CALL.replace(b'"id":7', b'"id":8'))
        assert refused.status_code == 403 and refused.json()["reason"] == "mcp_local_denied", refused.text
        assert server.mcp.sessions == {}
    records = audit_records(tmp_path / "var" / "audit.jsonl")
    assert any(r.get("egressgate.reason") == "mcp_local_denied" and r.get("egressgate.sandbox.id") == sid
               for r in records), records


def test_relay_cuts_an_oversized_line_and_skips_its_rest() -> None:
    """A line over the limit goes to the gateway cut at limit+1 bytes (which it refuses as too large) and the
    rest of it is dropped in bounded reads; the next line is whole again. Real pipe, real reader."""
    read_fd, write_fd = os.pipe()
    writer = threading.Thread(target=_write_all, args=(write_fd, b"x" * 200_000 + b"\n" + b'{"jsonrpc":"2.0"}\r\n'
                                                        + b"tail-without-newline"))
    writer.start()
    with os.fdopen(read_fd, "rb") as r:
        assert read_line(r, 10) == (b"x" * 11, True)
        assert read_line(r, 64) == (b'{"jsonrpc":"2.0"}', False)  # CRLF ends a line too
        assert read_line(r, 64) == (b"tail-without-newline", False)
        assert read_line(r, 64) is None
    writer.join(5)


def _write_all(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as w:
        w.write(data)
