"""Local control API (aiohttp) on 127.0.0.1:8081: sandboxes, policies, health, readiness, metrics.

docs/openapi.yaml describes every route (tests/control_api check the server against it). Protected by a
bearer token stored in a 0600 file in the var dir (created on first start): only the operator account
that runs the gateway can read it, never a sandbox. Only /healthz, /readyz and the JWKS are public.
Admission and revocation are audited before they take effect (an admission that cannot be recorded does
not happen: 503). Every error is JSON `{"error", "message"}` (admin/errors.py).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat
import time
from pathlib import Path
from urllib.parse import quote

from aiohttp import web

from egressgate.admin.approvals_api import register_approvals
from egressgate.admin.errors import error_response, state_unavailable
from egressgate.admin.jsonbody import MAX_BODY, BodyError, read_object
from egressgate.admin.mcp_api import register_mcp
from egressgate.admin.metrics import GatewayMetrics
from egressgate.admin.policies_api import PoliciesApi, Reload
from egressgate.admin.readiness import Readiness
from egressgate.admin.sandboxes_api import SandboxesApi
from egressgate.admin.ui import console_headers, register_console
from egressgate.admin.workspaces_api import register_workspaces
from egressgate.audit.build import build
from egressgate.audit.event import AuditEvent, AuditUnavailable, EventKind
from egressgate.broker.inject import admission_phantoms
from egressgate.gateway.shared.context import Runtime
from egressgate.policy.canon import ip_text
from egressgate.policy.enforcement import admission_keys
from egressgate.policy.reasons import Reason
from egressgate.runtimes.admitenv import CA_ENV_VARS
from egressgate.state.base import SandboxRecord, StateUnavailable, hash_token

logger = logging.getLogger(__name__)

MAX_LABELS = 32
MAX_ADDRESSES = 16
JWKS_PATH = "/.well-known/jwks.json"  # public keys only: no auth, so upstreams can verify our JWTs
# no token: probes (kubelet, load balancers) and JWT verifiers rarely carry one; they reveal no secret
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", JWKS_PATH})
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PUBLIC_JWK_MEMBERS = frozenset({"kty", "crv", "x", "kid", "alg", "use"})  # never "d" (a private key)


def ensure_admin_token(path: Path) -> str:
    """Read the admin token, creating it (0600, exclusive create) when missing."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            logger.warning("admin token file %s had mode %04o; fixing to 0600", path, mode)
            os.chmod(path, 0o600)
        token = path.read_text(encoding="utf-8").strip()
        if len(token) < 16:
            raise RuntimeError(f"admin token in {path} is too short") from None
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    return token


def sandbox_env(proxy_host: str, proxy_port: int, sandbox_id: str, token: str, bundle: str | None) -> dict:
    host = f"[{proxy_host}]" if ":" in proxy_host else proxy_host
    url = f"http://{quote(sandbox_id, safe='')}:{quote(token, safe='')}@{host}:{proxy_port}"
    env = {
        "HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
        # "unset": an inherited NO_PROXY would let a client bypass the gateway for some hosts. An empty
        # value overrides any inherited one; runtimes should remove the variables entirely.
        "NO_PROXY": "", "no_proxy": "",
    }
    if bundle:
        env.update({name: bundle for name in CA_ENV_VARS})
    return env


OUTCOME_LIMITS = ("memory", "pids", "wall_time", "workspace_bytes")
OUTCOME_SETID_MAX = 100  # runtimes/setid.py MAX_REPORTED: set-id files stripped from the workspace at teardown
OUTCOME_RUNTIMES = ("netns", "docker", "gvisor", "microvm", "unknown")
OUTCOME_ACCELS = ("kvm", "tcg")  # microvm: hardware virtualization or software emulation
OUTCOME_DROPS = ("ipv6", "spoofed", "not_tcp_udp", "udp", "tcp", "other")  # runtimes/nftables.py DROP_COUNTERS


def run_outcome(body: dict) -> dict[str, object]:
    """The revocation body of `sandbox run`/`sandbox gc` → `egressgate.run.*` audit attributes of the
    revocation record (that is how a limit hit is audited). Strictly typed: these values go into the
    audit trail, so anything unexpected is a 400, never recorded as-is."""
    if set(body) - {"outcome"}:
        raise BodyError(400, "invalid_request", "keys: outcome")
    raw = body.get("outcome")
    if not isinstance(raw, dict):
        raise BodyError(400, "invalid_request", "outcome: an object")
    ints = ("exit_code", "status", "signal", "duration_ms")
    if set(raw) - {"runtime", "limit", "ended_by", "dropped", "setid_stripped", "accel", *ints}:
        raise BodyError(400, "invalid_request",
                        f"outcome keys: runtime, limit, ended_by, dropped, setid_stripped, accel, {', '.join(ints)}")
    if raw.get("accel") not in (None, *OUTCOME_ACCELS):
        raise BodyError(400, "invalid_request", f"outcome.accel: null or one of {', '.join(OUTCOME_ACCELS)}")
    if raw.get("runtime") not in OUTCOME_RUNTIMES:
        raise BodyError(400, "invalid_request", f"outcome.runtime: one of {', '.join(OUTCOME_RUNTIMES)}")
    if raw.get("limit") is not None and raw["limit"] not in OUTCOME_LIMITS:
        raise BodyError(400, "invalid_request", f"outcome.limit: null or one of {', '.join(OUTCOME_LIMITS)}")
    if raw.get("ended_by") not in (None, "gc", "watchdog"):
        raise BodyError(400, "invalid_request", "outcome.ended_by: null, \"gc\" or \"watchdog\"")
    for key in ints:
        value = raw.get(key)
        if value is not None and (type(value) is not int or not 0 <= value < 2**53):
            raise BodyError(400, "invalid_request", f"outcome.{key}: null or a non-negative integer")
    dropped = raw.get("dropped") or {}
    if (not isinstance(dropped, dict) or set(dropped) - set(OUTCOME_DROPS)
            or not all(type(v) is int and 0 <= v < 2**53 for v in dropped.values())):
        raise BodyError(400, "invalid_request", f"outcome.dropped: counts by {', '.join(OUTCOME_DROPS)}")
    setid = raw.get("setid_stripped")
    if setid is not None and (not isinstance(setid, list) or not 0 < len(setid) <= OUTCOME_SETID_MAX or not all(
            isinstance(p, str) and 0 < len(p) <= 4096 and "\0" not in p for p in setid)):
        raise BodyError(400, "invalid_request", f"outcome.setid_stripped: null or 1-{OUTCOME_SETID_MAX} "
                                                "workspace-relative paths")
    out: dict[str, object] = {f"egressgate.run.{key}": value for key, value in raw.items()
                              if value is not None and key != "dropped"}
    out.update({f"egressgate.run.dropped.{key}": value for key, value in dropped.items()})
    return out


class AdminServer:
    def __init__(self, runtime: Runtime, token: str, reload: Reload | None = None) -> None:
        """`reload`: the gateway's policy reload (app.py `Gateway.reload`), for POST /v1/policies/reload."""
        self.rt = runtime
        self._token = token
        self.runner: web.AppRunner | None = None
        self.metrics = GatewayMetrics(runtime)  # observes the audit sink from now on
        self.readiness = Readiness(runtime)
        sandboxes, policies = SandboxesApi(runtime), PoliciesApi(runtime, reload)
        # console_headers first: every /ui response, errors included, carries the console's CSP (admin/ui)
        self.app = web.Application(middlewares=[console_headers, self._errors, self._auth], client_max_size=MAX_BODY)
        router = self.app.router
        router.add_get("/healthz", self.healthz)
        router.add_get("/readyz", self.readiness.handle)
        router.add_get("/metrics", self.metrics_text)
        router.add_get("/v1/sandboxes", sandboxes.list)
        router.add_post("/v1/sandboxes", self.admit)
        router.add_get("/v1/sandboxes/{sandbox_id}", sandboxes.show)
        router.add_delete("/v1/sandboxes/{sandbox_id}", self.revoke)
        router.add_get("/v1/policies", policies.list)
        router.add_post("/v1/policies/reload", policies.reload)
        router.add_get(JWKS_PATH, self.jwks)
        register_approvals(self)  # /v1/approvals (admin/approvals_api.py) and the expiry sweeper
        register_workspaces(self)  # persistent workspaces: records and staged writes (admin/workspaces_api.py)
        register_mcp(self)  # local MCP servers: /v1/mcp/local-start, /v1/sandboxes/{id}/mcp/... (admin/mcp_api.py)
        self.console = register_console(self)  # /ui: session + role tokens, not the admin token (admin/ui)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Whatever a request makes a handler raise, the client gets JSON: aiohttp's own 4xx (bad method,
        unknown path, body too large) keep their status with a JSON reason, and a bug is a 500 with no
        detail in the body (the log has it)."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code, message = exc.reason.lower().replace(" ", "_"), exc.text or exc.reason
            if exc is request.match_info.http_exception:  # the router matched no route (not a handler's 404)
                code = "unknown_route" if exc.status == 404 else code
                message = f"{request.method} {request.path}: no such route; docs/openapi.yaml lists them"
            headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "www-authenticate")}
            return web.json_response({"error": code, "message": message}, status=exc.status, headers=headers)
        except Exception:
            logger.exception("admin API: %s %s failed", request.method, request.path)
            return web.json_response({"error": "internal_error", "message": "the gateway failed on this request; "
                                      "see its log"}, status=500)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path in PUBLIC_PATHS and request.method in ("GET", "HEAD"):
            return await handler(request)
        if self.console.owns(request):  # the console's routes check its session instead (admin/ui/routes.py)
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self._token.encode()):
            response = error_response(401, "unauthorized", "send Authorization: Bearer <the admin token file's "
                                      "content>")
            response.headers["WWW-Authenticate"] = 'Bearer realm="egressgate-admin"'
            return response
        return await handler(request)

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> tuple[str, int]:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.SockSite(self.runner, sock) if sock is not None else web.TCPSite(self.runner, host, port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        bound = sock.getsockname()
        return str(bound[0]), int(bound[1])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def healthz(self, _request: web.Request) -> web.Response:
        """503 `degraded` while the audit sink denies new requests; 200 `alert` when the trail needs an
        operator although traffic flows (file deleted/moved from outside, crash recovered, checkpoint
        signer down, records waiting for a retry); 200 `ok` otherwise. `audit_status` says which."""
        healthy = self.rt.audit.healthy()
        trail = self.rt.audit.status() if hasattr(self.rt.audit, "status") else {}
        alert = bool(trail.get("incidents") or trail.get("pending_records") or trail.get("degraded")
                     or not trail.get("signer", {}).get("available", True))
        return web.json_response(
            {"status": "degraded" if not healthy else "alert" if alert else "ok", "audit": healthy,
             "audit_status": trail, "policies": sorted(self.rt.policies.policies)},
            status=200 if healthy else 503,
        )

    async def metrics_text(self, _request: web.Request) -> web.Response:
        """Prometheus text format (admin/metrics.py), behind the admin token like every other route."""
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _audit(self, event: AuditEvent) -> bool:
        try:
            await self.rt.audit.write(event)
            return True
        except AuditUnavailable:
            return False

    async def admit(self, request: web.Request) -> web.Response:
        try:
            body = await read_object(request)
        except BodyError as exc:
            return exc.response()
        if set(body) - {"policy", "labels", "addresses"}:
            return web.json_response({"error": "invalid_request", "message": "keys: policy, labels, addresses"},
                                     status=400)
        policy_name = body.get("policy")
        labels = body.get("labels") or {}
        addresses, problem = await self._source_addresses(body.get("addresses") or [])
        if problem is not None:
            return problem
        if not isinstance(policy_name, str) or not policy_name:
            return web.json_response({"error": "invalid_request", "message": "policy is required"}, status=400)
        if (not isinstance(labels, dict) or len(labels) > MAX_LABELS
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())):
            return web.json_response({"error": "invalid_request", "message": "labels: string map"}, status=400)
        policy = self.rt.policies.get(policy_name)
        if policy is None:
            return web.json_response(
                {"error": "unknown_policy", "message": f"no policy named {policy_name!r}",
                 "policies": sorted(self.rt.policies.policies)}, status=404)
        env = sandbox_env(self.rt.proxy_url_host, self.rt.proxy_port, "-", "-", self.rt.sandbox_bundle)
        try:
            # phantom placeholders for `mode: phantom` capabilities; the store keeps only their hashes
            phantom_env, phantom_hashes = admission_phantoms(policy.capabilities)
        except ValueError as exc:
            return web.json_response({"error": "invalid_policy", "message": str(exc)}, status=409)
        clash = sorted(set(phantom_env) & set(env))
        if clash:
            return web.json_response(
                {"error": "invalid_policy", "message": f"phantom_env overrides gateway variables: {clash}"},
                status=409)
        sandbox_id = "sbx-" + secrets.token_hex(8)
        token = secrets.token_urlsafe(32)
        record = SandboxRecord(id=sandbox_id, token_hash=hash_token(token), policy_name=policy_name,
                               admitted_at=time.time(), labels=dict(labels), phantoms=phantom_hashes,
                               addresses=addresses)
        event = build(EventKind.ADMISSION, sandbox_id=sandbox_id, sandbox_labels=labels, decision="allow",
                      policy_name=policy_name, policy_hash=policy.hash)
        if not await self._audit(event):
            return error_response(503, "audit_unavailable", "the admission could not be recorded in the audit "
                                  "trail, so it did not happen; retry when /readyz is ready")
        try:
            await self.rt.state.admit(record)
        except StateUnavailable:
            return state_unavailable()
        env = sandbox_env(self.rt.proxy_url_host, self.rt.proxy_port, sandbox_id, token, self.rt.sandbox_bundle)
        env.update(phantom_env)
        return web.json_response(
            {"id": sandbox_id, "token": token, "policy": policy_name, "policy_hash": policy.hash,
             "addresses": list(addresses), "dns": self.rt.dns_address,
             "proxy_url": env["HTTP_PROXY"], "env": env,
             # what runtimes enforce (egressgate/runtimes/): the sections of the same policy version the
             # gateway decides with, so `sandbox run` never reads policy files itself
             "runtime_policy": {"sandbox": policy.model.sandbox.model_dump(mode="json"),
                                "filesystem": policy.model.filesystem.model_dump(mode="json"),
                                "execution": policy.model.execution.model_dump(mode="json"),
                                "persistence": (policy.model.persistence.model_dump(mode="json")
                                                if policy.model.persistence is not None else None),
                                # the keys the policy sets: `sandbox run` refuses (exit 120) one its
                                # runtime does not enforce (policy/enforcement.py)
                                "keys": admission_keys(policy.model, policy.hash)},
             "notes": {"NO_PROXY": "must be unset in the sandbox; the empty value overrides an inherited one",
                       "ca_bundle": "system roots + the gateway CA (TLS is intercepted)"}},
            status=201,
        )

    async def _source_addresses(self, raw: object) -> tuple[tuple[str, ...], web.Response | None]:
        """Source addresses a runtime registers for the sandbox (DNS and transparent identification).

        Stored in canonical text; an address already held by a live sandbox is refused, because two
        sandboxes behind one source address could not be told apart (one would get the other's policy)."""
        def bad(message: str, status: int = 400) -> tuple[tuple[str, ...], web.Response]:
            return (), web.json_response({"error": "invalid_request", "message": message}, status=status)

        if not isinstance(raw, list) or len(raw) > MAX_ADDRESSES or not all(isinstance(a, str) for a in raw):
            return bad(f"addresses: a list of at most {MAX_ADDRESSES} IP address strings")
        out: list[str] = []
        for item in raw:
            try:
                text = ip_text(ipaddress.ip_address(item))
            except ValueError:
                return bad(f"addresses: {item!r} is not an IP address")
            try:
                holder = await self.rt.state.by_address(text)
            except StateUnavailable:
                return (), state_unavailable()
            if holder is not None and not holder.revoked:
                return bad(f"addresses: {text} is already registered to sandbox {holder.id}", status=409)
            if text not in out:
                out.append(text)
        return tuple(out), None

    async def jwks(self, _request: web.Request) -> web.Response:
        """Public JWT verification keys (`Broker.jwks()`): only OKP public members (kty, crv, x, kid,
        alg, use) are served, whatever the backend returned, and a backend failure says nothing more
        than 503."""
        broker = self.rt.broker
        if broker is None:
            return error_response(503, "jwks_unavailable", "no credential broker is configured")
        try:
            doc = await broker.jwks()
        except Exception as exc:  # any backend failure is a plain 503
            logger.warning("jwks unavailable: %s", type(exc).__name__)
            response = error_response(503, "jwks_unavailable", "the signing keys cannot be read now; retry later")
            response.headers["Cache-Control"] = "no-store"
            return response
        keys = [{k: str(v) for k, v in key.items() if k in PUBLIC_JWK_MEMBERS} for key in doc.get("keys", [])]
        return web.json_response({"keys": keys}, headers={"Cache-Control": "public, max-age=60",
                                                          "X-Content-Type-Options": "nosniff"})

    async def revoke(self, request: web.Request) -> web.Response:
        sandbox_id = request.match_info["sandbox_id"]
        outcome: dict[str, object] = {}
        if request.can_read_body:  # optional {"outcome": {...}} from `sandbox run`: how the workload ended
            try:
                body = await read_object(request)
                outcome = run_outcome(body)
            except BodyError as exc:
                return exc.response()
        try:
            record = await self.rt.state.get(sandbox_id)
        except StateUnavailable:
            return state_unavailable()
        if record is None:
            return error_response(404, "unknown_sandbox", f"no sandbox {sandbox_id!r} was admitted")
        # The store takes the revocation first and the record follows it (queued and retried like an
        # outcome, never dropped): a revocation happens even when its record cannot be written now (fail
        # closed), and a revocation the store did not take is recorded as not applied and answered 503 —
        # never a trail saying "revoked" over a sandbox that still works on every replica.
        try:
            await self.rt.state.revoke(sandbox_id)
        except StateUnavailable:
            await self.rt.audit.write_after(build(
                EventKind.REVOCATION, sandbox_id=sandbox_id, sandbox_labels=record.labels, decision="deny",
                reason=str(Reason.STATE_UNAVAILABLE), policy_name=record.policy_name, extra=outcome))
            return error_response(503, "state_unavailable", "the state store did not take the revocation, so "
                                  "it was not applied; retry when /readyz is ready")
        event = build(EventKind.REVOCATION, sandbox_id=sandbox_id, sandbox_labels=record.labels,
                      decision="allow", policy_name=record.policy_name, extra=outcome)
        if not await self.rt.audit.write_after(event):
            logger.error("revocation of %s applied, its record not written yet (queued for retry)", sandbox_id)
        return web.json_response({"id": sandbox_id, "revoked": True,
                                  "connections_closed": len(self.rt.by_sandbox.get(sandbox_id, ()))})
