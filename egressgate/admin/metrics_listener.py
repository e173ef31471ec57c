"""`listen.metrics`: a second, read-only HTTP listener for Prometheus and the kubelet.

Why a listener of its own instead of publishing the admin API: whoever reaches the admin API with its token can
admit sandboxes under any policy, so it stays on loopback (runtimes/render/common.py). A scraper in another
namespace and the kubelet's probes need three routes only, and none of them can change anything:

* `GET /metrics` — behind `admin.metrics_token_file`, a token that opens nothing else (the admin token is not
  accepted here: a scraper's credential must not be an operator's);
* `GET /healthz`, `GET /readyz` — public, as on the admin listener (probes carry no token; they reveal no secret).

Every other path and method answers 404/405 JSON; nothing here reads a request body.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from egressgate.admin.server import AdminServer

logger = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16


class MetricsTokenError(RuntimeError):
    """The metrics token file is missing, unreadable, too short or readable by everyone."""


def read_metrics_token(path: Path) -> str:
    """The operator's scraper token. Never created here: Prometheus must be given the same value, so it comes
    from where the operator keeps it (a Kubernetes Secret, a file the config management writes)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise MetricsTokenError(f"admin.metrics_token_file {path}: cannot read it ({exc.strerror or exc})") from None
    if mode & 0o007:  # a Secret mounted with defaultMode 0440 and fsGroup passes; 0444 does not
        raise MetricsTokenError(f"admin.metrics_token_file {path}: mode {mode:04o} lets every local user read it; "
                                "make it 0600 or 0440")
    if len(token) < MIN_TOKEN_CHARS:
        raise MetricsTokenError(f"admin.metrics_token_file {path}: the token is shorter than {MIN_TOKEN_CHARS} "
                                "characters (use e.g. `openssl rand -base64 32`)")
    return token


def _json_error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status, headers=headers)


class MetricsListener:
    """The read-only site; handlers are the admin server's own, so both listeners answer identically."""

    def __init__(self, admin: AdminServer, token: str) -> None:
        self._token = token.encode()
        self.runner: web.AppRunner | None = None
        self.app = web.Application(middlewares=[self._errors], client_max_size=1024)
        self.app.router.add_get("/metrics", self._metrics(admin))
        self.app.router.add_get("/healthz", admin.healthz)
        self.app.router.add_get("/readyz", admin.readiness.handle)

    def _metrics(self, admin: AdminServer):
        async def metrics(request: web.Request) -> web.Response:
            scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self._token):
                return _json_error(401, "unauthorized",
                                   "send Authorization: Bearer <the metrics token (admin.metrics_token_file)>",
                                   {"WWW-Authenticate": 'Bearer realm="egressgate-metrics"'})
            return await admin.metrics_text(request)

        return metrics

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = "unknown_route" if exc.status == 404 else exc.reason.lower().replace(" ", "_")
            return _json_error(exc.status, code,
                               f"{request.method} {request.path}: the metrics listener serves GET /metrics, /healthz "
                               "and /readyz only", {k: v for k, v in exc.headers.items() if k.lower() == "allow"})
        except Exception:
            logger.exception("metrics listener: %s %s failed", request.method, request.path)
            return _json_error(500, "internal_error", "the gateway failed on this request; see its log")

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> tuple[str, int]:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.SockSite(self.runner, sock) if sock is not None else web.TCPSite(self.runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        return str(bound[0]), int(bound[1])

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
