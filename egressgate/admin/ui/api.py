"""`/ui/api/*` routes that reuse the control API's own code paths (so the console can do nothing the
admin API would not do, and nothing differently): sandboxes (SandboxesApi; revoke is AdminServer.revoke:
audited, closes live connections), approvals (ApprovalsApi's decision path, `by` = "console:<role>"),
the request-hash calculator (audit/reqhash.py, the documented spec — never a second implementation) and
policy explain (the pure engine, as `egressgate policy explain`).

Who may do what: every route needs a session; revoke/approve/deny need the operator role; POSTs that only
compute (request-hash, explain, and in audit_api.py replay-diff and learn) are allowed to auditors but
still need the CSRF token and Origin (routes.guard).
"""

from __future__ import annotations

import base64
import binascii
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from aiohttp import web

from egressgate.admin.approvals_api import ApprovalsApi
from egressgate.admin.errors import error_response
from egressgate.admin.jsonbody import BodyError, read_object
from egressgate.admin.sandboxes_api import SandboxesApi
from egressgate.admin.ui.routes import SESSION_KEY
from egressgate.approvals.grant import SCOPE_HOST, SCOPES
from egressgate.approvals.model import DEFAULT_FOR_SECONDS, MAX_FOR_SECONDS
from egressgate.audit.reqhash import RequestHashError, canonical_fields, canonical_request, request_hash
from egressgate.policy.canon import CanonError
from egressgate.policy.decide import decide
from egressgate.policy.errors import PolicyError
from egressgate.policy.facts import SandboxState
from egressgate.policy.loader import parse_policy
from egressgate.policy.target import parse_target

if TYPE_CHECKING:
    from egressgate.admin.ui import Console

MAX_HEADERS = 100
MAX_LABELS = 32


def bad(message: str) -> web.Response:
    return error_response(400, "invalid_request", message)


async def body_with(request: web.Request, allowed: set[str]) -> dict:
    body = await read_object(request)
    if set(body) - allowed:
        raise BodyError(400, "invalid_request", f"keys: {', '.join(sorted(allowed))}")
    return body


def labels_of(raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if (not isinstance(raw, dict) or len(raw) > MAX_LABELS
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items())):
        raise BodyError(400, "invalid_request", f"labels: a string map of at most {MAX_LABELS} entries")
    return dict(raw)


class ConsoleApi:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.server = console.server
        self.sandboxes = SandboxesApi(self.server.rt)
        self.approvals = ApprovalsApi(self.server)

    async def revoke(self, request: web.Request) -> web.StreamResponse:
        """The admin API's revoke itself (audited, closes the sandbox's connections). No body: the
        `outcome` a runtime reports is not the console's to set."""
        if request.can_read_body:
            return bad("DELETE /ui/api/sandboxes/{id} takes no body")
        return await self.server.revoke(request)

    async def _decision(self, request: web.Request, approve: bool) -> web.Response:
        try:
            body = await body_with(request, {"for_seconds", "scope"} if approve else set()) \
                if request.can_read_body else {}
        except BodyError as exc:
            return exc.response()
        seconds = body.get("for_seconds", DEFAULT_FOR_SECONDS)
        if type(seconds) is not int or not 1 <= seconds <= MAX_FOR_SECONDS:
            return bad(f"for_seconds: an integer 1..{MAX_FOR_SECONDS}")
        scope = body.get("scope", SCOPE_HOST)
        if scope not in SCOPES:
            return bad("scope: host or host+path")
        by = f"console:{request[SESSION_KEY].role}"
        return await self.approvals._decide(request, approve=approve, by=by, scope=scope,
                                            seconds=seconds if approve else 1)

    async def approve(self, request: web.Request) -> web.Response:
        return await self._decision(request, approve=True)

    async def deny(self, request: web.Request) -> web.Response:
        return await self._decision(request, approve=False)

    async def request_hash(self, request: web.Request) -> web.Response:
        """`{"method","url","headers":[[k,v]],"body_b64"}` → the request hash and its canonical octets
        (as text: every field is length-prefixed, so the auditor can compare byte for byte)."""
        try:
            body = await body_with(request, {"method", "url", "headers", "body_b64"})
        except BodyError as exc:
            return exc.response()
        method, url, headers = body.get("method"), body.get("url"), body.get("headers", [])
        if not isinstance(method, str) or not isinstance(url, str):
            return bad("method and url: strings")
        if (not isinstance(headers, list) or len(headers) > MAX_HEADERS
                or not all(isinstance(h, list) and len(h) == 2 and all(isinstance(x, str) for x in h)
                           for h in headers)):
            return bad(f"headers: a list of at most {MAX_HEADERS} [name, value] string pairs")
        raw_body = body.get("body_b64") or ""
        if not isinstance(raw_body, str):
            return bad("body_b64: base64 text")
        try:
            data = base64.b64decode(raw_body, validate=True)
        except (binascii.Error, ValueError):
            return bad("body_b64: not valid base64")
        try:
            fields = canonical_fields(method, url, [(k, v) for k, v in headers], data)
        except RequestHashError as exc:
            return error_response(422, "invalid_request", str(exc))
        canonical = canonical_request(*fields)
        return web.json_response({"request_hash": request_hash(*fields),
                                  "canonical": canonical.decode("utf-8", "backslashreplace")})

    async def explain(self, request: web.Request) -> web.Response:
        """The pure decision for one request: a loaded policy by name, or a candidate's YAML text."""
        try:
            body = await body_with(request, {"policy", "policy_yaml", "method", "url", "labels"})
            labels = labels_of(body.get("labels"))
        except BodyError as exc:
            return exc.response()
        name, text = body.get("policy"), body.get("policy_yaml")
        if (name is None) == (text is None) or not isinstance(name if text is None else text, str):
            return bad("give exactly one of policy (a loaded policy's name) or policy_yaml (text)")
        method, url = body.get("method"), body.get("url")
        if not isinstance(method, str) or not isinstance(url, str) or not method or " " in method:
            return bad("method and url: strings (e.g. GET and https://host/path)")
        if text is not None:
            try:
                compiled = parse_policy(text, "<console>")
            except PolicyError as exc:
                return error_response(422, "invalid_policy", str(exc))
        else:
            compiled = self.server.rt.policies.get(name)
            if compiled is None:
                return error_response(404, "unknown_policy", f"no policy named {name!r}",
                                      policies=sorted(self.server.rt.policies.policies))
        try:
            facts = parse_target(f"{method} {url}")
        except (CanonError, ValueError) as exc:
            return error_response(422, "invalid_request", f"cannot parse the request: {exc}")
        now = time.time()
        state = SandboxState(sandbox_id="explain", admitted_at=now, labels=MappingProxyType(labels))
        decision = decide(compiled, facts, state, now)
        return web.json_response({
            "decision": decision.effect.value, "reason": decision.reason.value, "rule": decision.rule_id,
            "capability": decision.capability, "message": decision.message or None,
            "policy": compiled.name, "policy_hash": compiled.hash,
            "canonical": {"host": facts.host, "port": facts.port, "method": facts.method, "path": facts.path},
            "operation": facts.op_class,  # package_install | publish | null (policy/opclass.py)
        })


def api_routes(console: Console, guard, operator: tuple[str, ...]) -> list[web.AbstractRouteDef]:
    api = ConsoleApi(console)
    routes: list[Any] = [
        web.get("/ui/api/sandboxes", guard(api.sandboxes.list), allow_head=False),
        web.get("/ui/api/sandboxes/{sandbox_id}", guard(api.sandboxes.show), allow_head=False),
        web.delete("/ui/api/sandboxes/{sandbox_id}", guard(api.revoke, roles=operator, mutating=True)),
        web.get("/ui/api/approvals", guard(api.approvals.list), allow_head=False),
        web.get("/ui/api/approvals/{approval_id}", guard(api.approvals.show), allow_head=False),  # a write's paths
        web.post("/ui/api/approvals/{approval_id}/approve", guard(api.approve, roles=operator, mutating=True)),
        web.post("/ui/api/approvals/{approval_id}/deny", guard(api.deny, roles=operator, mutating=True)),
        web.post("/ui/api/request-hash", guard(api.request_hash, mutating=True)),
        web.post("/ui/api/explain", guard(api.explain, mutating=True)),
    ]
    return routes
