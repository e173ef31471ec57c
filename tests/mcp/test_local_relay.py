"""`egressgate mcp run`: a real `mcp` SDK stdio server inside a netns sandbox, its stdio relayed through the
gateway's tool-call decisions; a real SDK client (and a hand-written one for what no SDK would send).

The server (tests/mcp/stdio_server.py) records every call it received in the sandbox's workspace: a denied
call must never appear there. Positive controls: the allowed call works and is recorded, and the same
smuggled lines sent to the same server WITHOUT egressgate do run the hidden call.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from egressgate.runtimes.adminapi import call
from egressgate.runtimes.endpoints import load
from tests.mcp.local_world import (
    RawSession,
    calls,
    child_env,
    direct_server,
    mcp_argv,
    mcp_policy,
    tagged_pids,
    wait_until,
)
from tests.networld import World
from tests.runtimes.harness import Gateway, running_gateway, safety_net, sandbox_world


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with sandbox_world(tmp_path_factory.mktemp("networld")) as w:
        yield w


@pytest.fixture(scope="module")
def gateway(world: World) -> Iterator[Gateway]:
    with running_gateway(world, {"mcp-local": mcp_policy("mcp-local"),
                                 "mcp-nolocal": mcp_policy("mcp-nolocal", local="deny")}) as gw:
        yield gw


@pytest.fixture
def workspace(gateway: Gateway) -> Path:
    return gateway.base / f"ws-{secrets.token_hex(4)}"


def _records(gw: Gateway, predicate) -> list[dict]:
    return [r for r in gw.records(predicate=predicate) if predicate(r)]


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("policy", "server", "says"), [
    ("mcp-nolocal", "tools", "execution.local_mcp_servers: deny"),
    ("mcp-local", "remote-one", "local: true"),
    ("mcp-local", "undeclared", "local: true"),
])
def test_refused_local_start_never_runs_the_server(gateway: Gateway, workspace: Path, policy: str, server: str,
                                                    says: str) -> None:
    """Refused at once: exit 126, one sentence on stderr, audited by the gateway, and the server process never
    started (its very first statement would have written the record file). The same argv with policy
    mcp-local and server tools does start it (test_sdk_client_*: its record starts with "started")."""
    tag = secrets.token_hex(6)
    res = subprocess.run(mcp_argv(gateway, policy, server=server, workspace=workspace, tag=tag),
                         capture_output=True, text=True, timeout=60, env={**_env()}, stdin=subprocess.DEVNULL,
                         check=False, preexec_fn=safety_net)
    assert res.returncode == 126, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], res.stderr
    assert not workspace.exists() and calls(workspace) == []  # no sandbox was even prepared
    refusals = _records(gateway, lambda r: r.get("egressgate.reason") == "mcp_local_denied"
                        and r.get("egressgate.mcp.server") == server and r.get("egressgate.policy.name") == policy)
    assert refusals and refusals[-1]["egressgate.decision"] == "deny", refusals
    assert not tagged_pids(tag)


def _env() -> dict[str, str]:
    import os

    return {**os.environ, **child_env()}


# ---------------------------------------------------------------------------------------------- SDK client
async def test_sdk_client_allowed_denied_and_network(gateway: Gateway, workspace: Path) -> None:
    world = gateway.world
    tag = secrets.token_hex(6)
    argv = mcp_argv(gateway, "mcp-local", workspace=workspace, tag=tag, labels=("tenant=acme",))
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=child_env())
    mark = world.mark()
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        listed = {tool.name for tool in (await session.list_tools()).tools}
        assert listed == {"echo", "fetch", "lookup"}, listed  # delete_everything is filtered out of tools/list

        ok = await session.call_tool("echo", {"text": "hello local"})  # positive control
        assert not ok.is_error and ok.content[0].text == "hello local"
        own = await session.call_tool("lookup", {"project": "acme"})  # --label tenant=acme reached the decision
        assert not own.is_error and own.content[0].text == "tickets of acme"

        for tool, arguments, reason in (("delete_everything", {"confirm": True}, "mcp_tool_denied"),
                                        ("echo", {"text": "UPPER; rm -rf /"}, "mcp_argument_denied"),  # pattern
                                        ("echo", {"text": "fine", "smuggled": "x"}, "mcp_argument_denied"),
                                        ("lookup", {"project": "globex"}, "mcp_argument_denied")):  # other tenant
            with pytest.raises(MCPError) as refused:
                await session.call_tool(tool, arguments)
            assert refused.value.code == -32001 and refused.value.data["reason"] == reason, refused.value.data
            assert refused.value.data["egressgate"] is True

        # the server's own network access: through the gateway, under the same policy
        allowed = await session.call_tool("fetch", {"url": f"https://api.allowed.test:443/{tag}"})
        assert allowed.content[0].text.startswith("status 2"), allowed
        forbidden = await session.call_tool("fetch", {"url": "https://forbidden.test/"})
        assert not forbidden.content[0].text.startswith("status 2"), forbidden
    seen = calls(workspace)
    assert seen[0]["event"] == "started"
    assert [(c["tool"], c["arguments"]) for c in seen if c["event"] == "call"] == [
        ("echo", {"text": "hello local"}),
        ("lookup", {"project": "acme"}),
        ("fetch", {"url": f"https://api.allowed.test:443/{tag}"}),
        ("fetch", {"url": "https://forbidden.test/"}),
    ]  # never delete_everything, never the bad or extra arguments, never the other tenant
    assert world.hits(mark, listener="upstream-tls")  # positive control: the allowed fetch got out
    assert not world.hits(mark, listener="forbidden-tls")  # the denied one never reached its host
    decisions = _records(gateway, lambda r: r.get("egressgate.operation") == "mcp_tool_call"
                         and r.get("egressgate.mcp.server") == "tools")
    reasons = {(r.get("egressgate.mcp.tool"), r.get("egressgate.decision"), r.get("egressgate.reason"))
               for r in decisions}
    assert ("delete_everything", "deny", "mcp_tool_denied") in reasons, reasons
    assert ("echo", "deny", "mcp_argument_denied") in reasons, reasons
    assert any(tool == "echo" and decision == "allow" for tool, decision, _ in reasons), reasons
    assert wait_until(lambda: not tagged_pids(tag), 10)  # the client left: the server is gone


# ---------------------------------------------------------------------------------------------- smuggling
SMUGGLED = {
    # duplicate keys: first-wins reads echo, last-wins (Python's json, the SDK) runs delete_everything
    "duplicate_key": b'{"jsonrpc":"2.0","id":11,"method":"tools/call","params":{"name":"echo",'
                     b'"arguments":{"text":"hi"},"name":"delete_everything","arguments":{"confirm":true}}}',
    # a batch whose second member is the call a per-message reader would miss
    "batch": b'[{"jsonrpc":"2.0","id":12,"method":"tools/call","params":{"name":"echo","arguments":'
             b'{"text":"hi"}}},{"jsonrpc":"2.0","id":13,"method":"tools/call","params":{"name":'
             b'"delete_everything","arguments":{"confirm":true}}}]',
    # the denied name behind unicode escapes
    "escaped_name": b'{"jsonrpc":"2.0","id":14,"method":"tools/call","params":{"name":'
                    b'"\\u0064elete_everything","arguments":{"confirm":true}}}',
    # a call as a notification (no id: nobody would see its answer)
    "notification": b'{"jsonrpc":"2.0","method":"tools/call","params":{"name":"delete_everything",'
                    b'"arguments":{"confirm":true}}}',
}


def _direct_control(proc: subprocess.Popen[bytes], record: Path) -> list[dict]:
    """The smuggled lines sent to the same SDK server without egressgate: what the server would run."""
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}
    lines = [json.dumps(init).encode(), b'{"jsonrpc":"2.0","method":"notifications/initialized"}',
             SMUGGLED["duplicate_key"], SMUGGLED["escaped_name"]]
    try:
        assert proc.stdin is not None
        proc.stdin.write(b"\n".join(lines) + b"\n")
        proc.stdin.flush()
        wait_until(lambda: record.exists() and record.read_text().count('"call"') >= 2, 30)
    finally:
        proc.kill()
        proc.wait()
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def test_smuggled_lines_are_refused_and_never_reach_the_server(gateway: Gateway, workspace: Path,
                                                               tmp_path: Path) -> None:
    tag = secrets.token_hex(6)
    direct = direct_server(tmp_path / "direct.jsonl", secrets.token_hex(6))  # starts meanwhile (control)
    raw = RawSession(mcp_argv(gateway, "mcp-local", workspace=workspace, tag=tag, linger=True))
    try:
        assert raw.initialize()["result"]["serverInfo"]["name"] == "local-tools"
        control = _direct_control(direct, tmp_path / "direct.jsonl")  # the positive control without egressgate
        for name, line in SMUGGLED.items():
            raw.send(line)
            if name == "notification":
                continue  # refused; its answer (if any) is checked by the next call's id below
            answer = raw.recv()
            members = answer if isinstance(answer, list) else [answer]
            assert all("error" in m for m in members), (name, answer)
        ok = raw.call(20, "echo", {"text": "still works"})  # positive control on the same relay
        while ok.get("id") != 20:
            assert "error" in ok, ok  # only refusals may come first (the notification's)
            ok = raw.recv()
        assert ok["result"]["content"][0]["text"] == "still works"
        seen = [c for c in calls(workspace) if c["event"] == "call"]
        assert seen == [{"event": "call", "tool": "echo", "arguments": {"text": "still works"}}], seen
        ran = {c["tool"] for c in control if c["event"] == "call"}
        assert "delete_everything" in ran, control  # without egressgate, the hidden call would have run
        # the client goes away (stdin closed, no signal): the server (--linger: it ignores the end of its
        # input) is killed by the relay, and the run ends
        rc = raw.close()
        assert rc == 128 + 9, raw.stderr
        assert wait_until(lambda: any(c["event"] == "lingering" for c in calls(workspace)), 1)  # it did linger
        assert wait_until(lambda: not tagged_pids(tag), 5), tagged_pids(tag)
    finally:
        raw.close()
        if direct.poll() is None:
            direct.kill()
            direct.wait()
    refused = _records(gateway, lambda r: r.get("egressgate.reason") == "mcp_malformed")
    assert refused, "smuggled lines were not audited"


# ---------------------------------------------------------------------------------------------- revocation
def test_revocation_ends_the_relay_and_the_server(gateway: Gateway, workspace: Path) -> None:
    tag = secrets.token_hex(6)
    raw = RawSession(mcp_argv(gateway, "mcp-local", workspace=workspace, tag=tag))
    try:
        raw.initialize()
        assert raw.call(1, "echo", {"text": "before"})["result"]["content"][0]["text"] == "before"
        assert tagged_pids(tag)  # positive control: the server is alive
        sid = next(w for w in raw.stderr.decode().split() if w.startswith("sbx-"))
        info = load(gateway.base / "var")
        token = info.admin_token_file.read_text().strip()
        status, _ = gateway.world.in_ns(gateway.world.gw, lambda: call(info.endpoints.admin, "DELETE",
                                                                        f"/v1/sandboxes/{sid}", token))
        assert status == 200
        assert raw.proc.wait(timeout=10) != 0  # the relay ended by itself, with the server killed
        assert wait_until(lambda: not tagged_pids(tag), 5)
        assert "revoked" in raw.stderr.decode()
    finally:
        raw.close()
