"""docs/openapi.yaml is the control API: checked against the real server.

- every route the server registers is documented (the route table of a real AdminServer built on real
  components: memory state, a real audit sink, the loaded policies);
- every documented operation is served by the running gateway (`egressgate run`) and answered at least
  once with a documented 2xx; an unknown route answers `unknown_route`, so "served" is never confused
  with a handler's own 404;
- every response the tests provoke has a documented status, and its JSON body validates (jsonschema,
  draft 2020-12) against the documented schema - errors included (`error` + `message`);
- every route that is not public answers 401 without the admin token (/metrics too).

The console's routes (/ui, egressgate/admin/ui) are in the route-table check here; they use a session
instead of the admin token, so tests/console/test_api_*.py check them against this file (CONSOLE below).

The approvals routes are implemented by egressgate/admin/approvals_api.py: until that module exists they
are the only documented routes not required to be served (APPROVALS below says so by name).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml

from egressgate.admin.server import AdminServer
from egressgate.audit.config import open_audit_sink
from egressgate.config import load_config
from egressgate.gateway.shared.context import PolicyHolder, Runtime
from egressgate.policy.loader import load_policies
from egressgate.state.memory import MemoryState
from tests.control_api.harness import APPROVE_POLICY, MCP_LOCAL_POLICY, METRICS_POLICY, api, control_policies
from tests.support.launcher import write_policies
from tests.support.waiting import wait_for

SPEC_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
# libyaml's safe loader when PyYAML has it (the same document, ~10x less CPU): every xdist worker collects
# this module, and the pure-Python loader took ~0.17 CPU-s for these 57 kB in each
SPEC: dict[str, Any] = yaml.load(SPEC_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506
METHODS = ("get", "post", "put", "delete", "patch")
APPROVALS = importlib.util.find_spec("egressgate.admin.approvals_api") is not None


def _norm(template: str) -> str:
    return re.sub(r"\{[^}]+\}", "{}", template)


def documented() -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in SPEC["paths"].items() for method in item if method in METHODS}


def console(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


def bearer_documented() -> set[tuple[str, str]]:
    """Every documented operation of the bearer-token API (the console's are tested in tests/console)."""
    return {op for op in documented() if not console(op[1])}


def required_ops() -> set[tuple[str, str]]:
    return {op for op in bearer_documented() if APPROVALS or not op[1].startswith("/v1/approvals")}


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def _response(method: str, template: str, status: int) -> tuple[str, dict]:
    """(JSON pointer, response object) of a documented response; fails when the status is undocumented."""
    responses = SPEC["paths"][template][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {template} answered {status}, not documented ({sorted(responses)})"
    pointer = f"#/paths/{_escape(template)}/{method.lower()}/responses/{status}"
    resp = responses[str(status)]
    if "$ref" in resp:
        pointer = resp["$ref"]
        resp = SPEC["components"]["responses"][pointer.rsplit("/", 1)[1]]
    return pointer, resp


class Checker:
    """Validates responses against the spec and remembers which operations answered 2xx."""

    def __init__(self) -> None:
        self.served: set[tuple[str, str]] = set()

    def __call__(self, res: httpx.Response, template: str) -> httpx.Response:
        method = res.request.method
        pointer, resp = _response(method, template, res.status_code)
        content = resp.get("content", {})
        if "application/json" in content:
            assert res.headers["content-type"].startswith("application/json"), res.headers
            root = {**SPEC, "$ref": f"{pointer}/content/application~1json/schema"}
            jsonschema.Draft202012Validator(root).validate(res.json())
        elif "text/plain" in content:
            assert res.headers["content-type"].startswith("text/plain")
        if 200 <= res.status_code < 300:
            self.served.add((method, template))
        return res


def test_spec_is_valid_and_every_schema_is_a_valid_json_schema():
    assert SPEC["openapi"].startswith("3.1")
    for name, schema in SPEC["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)  # raises naming the bad keyword
        assert name
    for path, item in SPEC["paths"].items():
        for method, op in item.items():
            if method in METHODS:
                assert op["responses"], (method, path)


async def test_every_registered_route_is_documented(world, tmp_path):
    """The real route table (not a list kept by hand) against the spec, both ways."""
    policy_dir = write_policies(tmp_path / "policies", control_policies(world))
    cfg = load_config(None, {"var_dir": str(tmp_path / "var"), "policy": str(policy_dir)})
    sink = await open_audit_sink(cfg.audit, tmp_path / "var")
    try:
        rt = Runtime(config=cfg, policies=PolicyHolder(load_policies(policy_dir)), state=MemoryState(), audit=sink,
                     resolver=None, ledger=None)  # type: ignore[arg-type]  # the admin server uses neither
        server = AdminServer(rt, "t" * 32)
        served = {(r.method, _norm(r.resource.canonical)) for r in server.app.router.routes()
                  if r.method != "HEAD" and r.resource is not None}
    finally:
        await sink.close()
    docs = {(m, _norm(p)) for m, p in documented()}
    assert served - docs == set(), "served but not in docs/openapi.yaml"
    required = {(m, _norm(p)) for m, p in required_ops() | (documented() - bearer_documented())}
    assert required - served == set(), "documented but not registered"


def test_live_gateway_serves_every_documented_route_as_documented(cgw, world):
    check = Checker()
    # public routes
    check(api(cgw, "GET", "/healthz", token=None), "/healthz")
    check(api(cgw, "GET", "/readyz", token=None), "/readyz")
    check(api(cgw, "GET", "/.well-known/jwks.json", token=None), "/.well-known/jwks.json")
    check(api(cgw, "GET", "/metrics"), "/metrics")

    # sandboxes
    admitted = check(api(cgw, "POST", "/v1/sandboxes", json={"policy": METRICS_POLICY, "labels": {"team": "c12"}}),
                     "/v1/sandboxes").json()
    sid = admitted["id"]
    check(api(cgw, "POST", "/v1/sandboxes", json={"policy": "no-such-policy"}), "/v1/sandboxes")
    check(api(cgw, "POST", "/v1/sandboxes", json={"policy": METRICS_POLICY, "extra": 1}), "/v1/sandboxes")
    check(api(cgw, "POST", "/v1/sandboxes", content=b"{", headers={"Content-Type": "application/json"}),
          "/v1/sandboxes")
    with cgw.proxied_client(admitted["proxy_url"]) as c:  # some usage, so the detail has numbers
        assert c.get(f"https://api.test:{world.https_port}/echo").status_code == 200
    listed = check(api(cgw, "GET", "/v1/sandboxes"), "/v1/sandboxes").json()["sandboxes"]
    assert sid in [s["id"] for s in listed]
    only = check(api(cgw, "GET", f"/v1/sandboxes?policy={METRICS_POLICY}&revoked=false"), "/v1/sandboxes")
    assert {s["policy"] for s in only.json()["sandboxes"]} == {METRICS_POLICY}
    check(api(cgw, "GET", "/v1/sandboxes?revoked=maybe"), "/v1/sandboxes")
    detail = check(api(cgw, "GET", f"/v1/sandboxes/{sid}"), "/v1/sandboxes/{sandbox_id}").json()
    assert detail["budgets"]["rules"]["c12-get"]["requests"] == {"limit": 3, "used": 1, "left": 2}
    check(api(cgw, "GET", "/v1/sandboxes/sbx-ffffffffffffffff"), "/v1/sandboxes/{sandbox_id}")
    check(api(cgw, "DELETE", f"/v1/sandboxes/{sid}"), "/v1/sandboxes/{sandbox_id}")
    check(api(cgw, "DELETE", "/v1/sandboxes/sbx-ffffffffffffffff"), "/v1/sandboxes/{sandbox_id}")
    check(api(cgw, "DELETE", f"/v1/sandboxes/{sid}", json={"outcome": {"runtime": "bogus"}}),
          "/v1/sandboxes/{sandbox_id}")

    # policies: a reload that keeps the set, one that is refused (previous set stays), one that works again
    before = check(api(cgw, "GET", "/v1/policies"), "/v1/policies").json()
    assert check(api(cgw, "POST", "/v1/policies/reload"), "/v1/policies/reload").json()["version"] == before["version"]
    broken = cgw.policy_dir / "zz-broken.yaml"
    broken.write_text("sandbox: {name: zz-broken}\nnetwork: {https: {allow: [{host: 'exa mple'}]}}\n")
    try:
        refused = check(api(cgw, "POST", "/v1/policies/reload"), "/v1/policies/reload")
        assert refused.status_code == 422 and refused.json()["version"] == before["version"]
    finally:
        broken.unlink()
    assert check(api(cgw, "POST", "/v1/policies/reload"), "/v1/policies/reload").status_code == 200

    if APPROVALS:
        _approvals(cgw, world, check)
    _mcp_local(cgw, check)
    _workspaces(cgw, check)

    missing = required_ops() - check.served
    assert missing == set(), f"documented but never answered 2xx: {sorted(missing)}"


def _approvals(cgw, world, check: Checker) -> None:
    """Runs once egressgate/admin/approvals_api.py exists: a request outside the allowlist from a sandbox
    whose policy requires approval creates a pending approval; approve it, deny another."""
    sbx = cgw.admit(APPROVE_POLICY)
    with sbx.client() as c:
        for path in ("/one", "/two"):
            res = c.get(f"http://other.test:{world.http_port}{path}")
            assert res.status_code == 403 and res.json()["reason"] == "approval_required", res.text
    assert wait_for(lambda: api(cgw, "GET", "/v1/approvals?state=pending").json()["approvals"])
    pending = [a for a in check(api(cgw, "GET", "/v1/approvals?state=pending"), "/v1/approvals").json()["approvals"]
               if a["sandbox_id"] == sbx.id]
    assert pending
    aid = pending[0]["id"]
    check(api(cgw, "GET", "/v1/approvals?state=nonsense"), "/v1/approvals")
    check(api(cgw, "GET", f"/v1/approvals/{aid}"), "/v1/approvals/{approval_id}")
    check(api(cgw, "GET", "/v1/approvals/does-not-exist"), "/v1/approvals/{approval_id}")
    check(api(cgw, "POST", f"/v1/approvals/{aid}/approve", json={"for_seconds": 60, "scope": "host", "by": "c12"}),
          "/v1/approvals/{approval_id}/approve")
    check(api(cgw, "POST", f"/v1/approvals/{aid}/approve", json={}), "/v1/approvals/{approval_id}/approve")
    check(api(cgw, "POST", f"/v1/approvals/{aid}/deny", json={}), "/v1/approvals/{approval_id}/deny")
    check(api(cgw, "POST", "/v1/approvals/does-not-exist/approve", json={}), "/v1/approvals/{approval_id}/approve")
    check(api(cgw, "POST", "/v1/approvals/does-not-exist/deny", json={}), "/v1/approvals/{approval_id}/deny")
    check(api(cgw, "POST", f"/v1/approvals/{aid}/approve", json={"for_seconds": 0}),
          "/v1/approvals/{approval_id}/approve")
    # a second pending one, denied
    other = [a for a in api(cgw, "GET", "/v1/approvals?state=pending").json()["approvals"]
             if a["sandbox_id"] == sbx.id and a["id"] != aid]
    if other:
        check(api(cgw, "POST", f"/v1/approvals/{other[0]['id']}/deny", json={"by": "c12"}),
              "/v1/approvals/{approval_id}/deny")
    else:  # same (sandbox, host) scope shares one id: deny needs a fresh request to another host
        with sbx.client() as c:
            c.get(f"http://open.test:{world.http_port}/three")
        fresh = [a for a in api(cgw, "GET", "/v1/approvals?state=pending").json()["approvals"]
                 if a["sandbox_id"] == sbx.id]
        check(api(cgw, "POST", f"/v1/approvals/{fresh[0]['id']}/deny", json={"by": "c12"}),
              "/v1/approvals/{approval_id}/deny")


def _workspaces(cgw, check: Checker) -> None:
    """The routes `sandbox run` uses for persistent workspaces (admin/workspaces_api.py): a record, a refused
    one, a staged write (a pending persistent_write approval listing its changes), an unknown sandbox's."""
    records, writes = "/v1/workspaces/records", "/v1/workspaces/writes"
    body = {"action": "saved", "workspace": "w", "decision": "allow", "attributes": {"entries": 1, "ok": True}}
    check(api(cgw, "POST", records, json=body), records)
    check(api(cgw, "POST", records, json={**body, "attributes": {"Bad Key": 1}}), records)
    sid = api(cgw, "POST", "/v1/sandboxes", json={"policy": METRICS_POLICY}).json()["id"]
    write = {"sandbox_id": sid, "workspace": "w", "manifest_hash": "sha256:1", "base_manifest_hash": "none",
             "changes": [{"path": "a.txt", "action": "added", "type": "f", "size": 1, "sha256": "0" * 64}]}
    staged = check(api(cgw, "POST", writes, json=write), writes).json()
    assert staged["kind"] == "persistent_write" and staged["details"]["changes"][0]["path"] == "a.txt"
    check(api(cgw, "POST", writes, json={**write, "sandbox_id": "sbx-ffffffffffffffff"}), writes)
    check(api(cgw, "POST", writes, json={**write, "changes": []}), writes)


def test_unknown_routes_are_told_apart_from_unknown_objects(cgw):
    res = api(cgw, "GET", "/v1/nothing-here")
    assert res.status_code == 404 and res.json()["error"] == "unknown_route" and res.json()["message"]
    res = api(cgw, "PUT", "/v1/sandboxes")
    assert res.status_code == 405 and res.json()["error"] == "method_not_allowed" and "Allow" in res.headers
    obj = api(cgw, "GET", "/v1/sandboxes/sbx-ffffffffffffffff")
    assert obj.status_code == 404 and obj.json()["error"] == "unknown_sandbox"


@pytest.mark.parametrize(("method", "template"), sorted(bearer_documented()))
def test_every_non_public_route_needs_the_token(cgw, method, template):
    op = SPEC["paths"][template][method.lower()]
    path = template.replace("{sandbox_id}", "sbx-ffffffffffffffff").replace("{approval_id}", "x")
    res = api(cgw, method, path, token=None, json={} if method == "POST" else None)
    if op.get("security") == []:
        assert res.status_code != 401
        return
    assert res.status_code == 401, res.text
    assert res.headers["WWW-Authenticate"].startswith("Bearer")
    Checker()(res, template)
    wrong = api(cgw, method, path, token="x" * 43, json={} if method == "POST" else None)
    assert wrong.status_code == 401


def _mcp_local(cgw, check: Checker) -> None:
    """The routes `egressgate mcp run` uses (admin/mcp_api.py): the start check, one session's lines both
    ways (allowed, denied, answered), its end, and a revoked sandbox's."""
    start = "/v1/mcp/local-start"
    assert check(api(cgw, "POST", start, json={"policy": MCP_LOCAL_POLICY, "server": "tools"}), start).json()[
        "max_message_bytes"] > 0
    refused = check(api(cgw, "POST", start, json={"policy": MCP_LOCAL_POLICY, "server": "undeclared"}), start)
    assert refused.status_code == 403 and refused.json()["reason"] == "mcp_local_denied"
    check(api(cgw, "POST", start, json={"policy": "no-such-policy", "server": "tools"}), start)
    check(api(cgw, "POST", start, json={"policy": MCP_LOCAL_POLICY}), start)
    sid = api(cgw, "POST", "/v1/sandboxes", json={"policy": MCP_LOCAL_POLICY}).json()["id"]
    messages, session = "/v1/sandboxes/{sandbox_id}/mcp/{server}/messages", "/v1/sandboxes/{sandbox_id}/mcp/{server}"

    def line(direction: str, body: bytes, sandbox: str = sid) -> httpx.Response:
        return check(api(cgw, "POST", f"/v1/sandboxes/{sandbox}/mcp/tools/messages?direction={direction}",
                         content=body, headers={"Content-Type": "application/octet-stream"}), messages)

    call = b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"%s","arguments":{}}}'
    assert line("to_server", call % (1, b"echo")).json()["forward"] is not None
    denied = line("to_server", call % (2, b"other")).json()
    assert denied["forward"] is None and denied["replies"][0]["error"]["code"] == -32001
    assert line("to_client", b'{"jsonrpc":"2.0","id":1,"result":{"content":[]}}').json()["forward"] is not None
    line("bogus", b"{}")
    line("to_server", call % (3, b"echo"), sandbox="sbx-ffffffffffffffff")
    check(api(cgw, "DELETE", f"/v1/sandboxes/{sid}/mcp/tools"), session)
    check(api(cgw, "DELETE", f"/v1/sandboxes/{sid}/mcp/tools"), session)  # 404: ended already
    api(cgw, "DELETE", f"/v1/sandboxes/{sid}")
    assert line("to_server", call % (4, b"echo")).status_code == 410
