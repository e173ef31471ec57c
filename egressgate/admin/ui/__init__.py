"""The web console under /ui on the admin listener (docs/operations.md "Console", docs/openapi.yaml).

`register_console(server)` adds its routes to the AdminServer's app; the server's bearer-token middleware
lets exactly the console's own routes (and unmatched /ui paths, which are 404/405 anyway) through to the
session guard of routes.py, so a console session never opens /v1 and the admin token never opens /ui/api.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from egressgate.admin.ui import auth
from egressgate.admin.ui.live import LiveFeed
from egressgate.admin.ui.routes import CONSOLE_KEY, ShellRoutes, console_headers, guard, is_console_path

if TYPE_CHECKING:
    from egressgate.admin.server import AdminServer

__all__ = ["Console", "console_headers", "register_console"]

OPERATOR = ("operator",)


class Console:
    def __init__(self, server: AdminServer) -> None:
        var = server.rt.config.var_path()
        self.server = server
        self.tokens = auth.ensure_role_tokens(var)
        self.sessions = auth.SessionStore(var / "console-sessions")
        self.limiter = auth.LoginLimiter()
        self.live = LiveFeed(server.rt.audit)
        self.resources: set[int] = set()
        self.audit: Any = None  # audit_api.AuditApi (search, stats, replay-diff, learn)

    def owns(self, request: web.Request) -> bool:
        """True for a request the console answers itself (the bearer middleware skips it): one of the
        console's routes matched, or no route did and the path is under /ui (a 404/405 either way)."""
        match = request.match_info
        resource = match.route.resource
        if resource is not None:
            return id(resource) in self.resources
        return match.http_exception is not None and is_console_path(request.path)


def register_console(server: AdminServer) -> Console:
    console = Console(server)
    app = server.app
    app[CONSOLE_KEY] = console
    shell = ShellRoutes(console)
    routes = [
        web.get("/ui", shell.redirect, allow_head=False),
        web.get("/ui/", shell.index, allow_head=False),
        web.get("/ui/static/{file:.+}", shell.static_file, allow_head=False),
        web.post("/ui/api/login", shell.login),
        web.post("/ui/api/logout", guard(shell.logout, mutating=True)),
        web.get("/ui/api/session", guard(shell.session), allow_head=False),
        web.get("/ui/api/live", guard(console.live.handle), allow_head=False),
    ]
    from egressgate.admin.ui.api import api_routes  # the data routes
    from egressgate.admin.ui.audit_api import audit_routes

    routes += api_routes(console, guard, OPERATOR)
    console.audit, more = audit_routes(console, guard)
    routes += more
    for route in app.router.add_routes(routes):
        console.resources.add(id(route.resource))
    app.on_shutdown.append(console.live.close_all)
    app.on_cleanup.append(console.audit.stop)
    return console
