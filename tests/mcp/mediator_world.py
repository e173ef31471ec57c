"""The MCP mediator's world, shared by the tests that drive it directly (test_mediator.py,
test_review_discover.py, test_review_ids.py, tests/audit/test_replay_mcp.py): the `mcp-med` policy, a
Runtime over a real state store, the real audit file sink and the real approval store, one admitted
sandbox, and the JSON-RPC messages a client and a server exchange. Fixture `mem_world`: conftest.py."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from egressgate.approvals.memory import MemoryApprovals
from egressgate.approvals.store import open_approvals
from egressgate.audit.config import open_audit_sink
from egressgate.config import load_config
from egressgate.gateway.shared.context import PolicyHolder, Runtime
from egressgate.mcp.jsonrpc import dumps
from egressgate.mcp.mediator import McpSession
from egressgate.mcp.schema import tool_hash
from egressgate.policy.loader import parse_policy
from egressgate.state.base import SandboxRecord, hash_token
from egressgate.state.redis import RedisState
from tests.support.launcher import audit_records

POLICY = """
sandbox: {name: mcp-med}
network:
  https:
    allow:
      - host: tickets.mcp.test
        paths: ["/mcp", "/mcp/**"]
      - host: pinned.mcp.test
mcp:
  record_arguments: %s
  servers:
    - name: tickets
      url: https://tickets.mcp.test/mcp
      budget: {calls: 4}
      tools:
        allow:
          - name: search_tickets
            id: tickets-search
            budget: {calls: 3}
            arguments:
              project: {equals_label: tenant, required: true}
              query: {type: string, max_length: 40}
          - name: escalate
            approval: required
            unlisted_arguments: allow
          - name: note
            unlisted_arguments: allow
          - name: reopen
            approval: required
            unlisted_arguments: allow
          - name: fetch
            arguments:
              url: {allowed_by_network: true, required: true}
        deny: [delete_ticket]
    - name: pinned
      url: https://pinned.mcp.test/mcp
      server_info: {name: pinned-server, version: "2.0.0"}
      tool_schemas: {lookup: "%s"}
      tools:
        allow:
          - name: lookup
"""
LOOKUP = {"name": "lookup", "description": "Look up.", "inputSchema": {"type": "object"}}
SEARCH = {"name": "search_tickets", "description": "Search tickets.",
          "inputSchema": {"type": "object", "properties": {"project": {"type": "string"}}}}
DELETE = {"name": "delete_ticket", "description": "Delete.", "inputSchema": {"type": "object"}}
OTHER = {"name": "unlisted_tool", "description": "Not in the policy.", "inputSchema": {"type": "object"}}


def policy_text(record_arguments: bool = False) -> str:
    """The policy file's text (the `pinned` server's lookup schema pinned to LOOKUP's hash)."""
    return textwrap.dedent(POLICY % ("true" if record_arguments else "false", tool_hash(LOOKUP)))


def compiled(record_arguments: bool = False):
    return parse_policy(policy_text(record_arguments), "mcp-med.yaml")


def call(jid, tool: str, arguments: dict | None = None) -> dict:
    params: dict = {"name": tool}
    if arguments is not None:
        params["arguments"] = arguments
    return {"jsonrpc": "2.0", "id": jid, "method": "tools/call", "params": params}


def body(obj) -> bytes:
    return json.dumps(obj).encode()


def answer(jid, result: dict | None = None, error: dict | None = None) -> bytes:
    out: dict = {"jsonrpc": "2.0", "id": jid}
    if error is not None:
        out["error"] = error
    else:
        out["result"] = result if result is not None else {"content": [{"type": "text", "text": "ok"}]}
    return dumps(out)


@dataclass
class World:
    rt: Runtime
    var: Path
    sandbox: SandboxRecord

    def session(self, server: str = "tickets", sandbox: SandboxRecord | None = None) -> McpSession:
        policy = self.rt.policies.get("mcp-med")
        return McpSession(self.rt, policy, policy.mcp.servers[server], sandbox or self.sandbox, "streamable_http")

    def records(self, **match) -> list[dict]:
        path = self.var / "audit.jsonl"
        if not path.exists():
            return []
        return [r for r in audit_records(path) if all(r.get(k) == v for k, v in match.items())]

    async def wait_records(self, n: int = 1, **match) -> list[dict]:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            found = self.records(**match)
            if len(found) >= n:
                return found
            await asyncio.sleep(0.01)
        raise AssertionError(f"no {n} audit records matching {match}: {self.records()[-3:]}")


async def make_world(tmp_path: Path, state, *, record_arguments: bool = False, var: Path | None = None) -> World:
    var = var or tmp_path / "var"
    cfg = load_config(None, {"var_dir": str(var)})
    sink = await open_audit_sink(cfg.audit, var)
    rt = Runtime(config=cfg, policies=PolicyHolder({"mcp-med": compiled(record_arguments)}), state=state,
                 audit=sink, resolver=None, ledger=None,  # type: ignore[arg-type]  # the mediator uses neither
                 approvals=open_approvals(state) if isinstance(state, RedisState) else MemoryApprovals())
    sandbox = SandboxRecord(id="sbx-a", token_hash=hash_token("t"), policy_name="mcp-med", admitted_at=time.time(),
                            labels={"tenant": "acme"})
    await state.admit(sandbox)
    return World(rt, var, sandbox)


async def list_tools(s: McpSession, jid, tools: list[dict]) -> list[str]:
    assert (await s.from_client(body({"jsonrpc": "2.0", "id": jid, "method": "tools/list"}))).forward
    out = json.loads(await s.from_server_bytes(answer(jid, {"tools": tools})))
    return [t["name"] for t in out["result"]["tools"]]


async def initialize(s: McpSession, jid, name: str, version: str, protocol: str = "2025-06-18") -> None:
    init = {"jsonrpc": "2.0", "id": jid, "method": "initialize",
            "params": {"protocolVersion": protocol, "capabilities": {},
                       "clientInfo": {"name": "c", "version": "1"}}}
    assert (await s.from_client(body(init))).forward
    await s.from_server_bytes(answer(jid, {"protocolVersion": protocol, "capabilities": {},
                                           "serverInfo": {"name": name, "version": version}}))
