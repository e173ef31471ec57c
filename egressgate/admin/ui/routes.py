"""The console's HTTP shell: security headers on every /ui response, the session guard of every API
route, login/logout/session, and the static files.

Static files: the allowlist is the set of files shipped in egressgate/admin/ui/static/, read into memory
once at start. A request names a key of that dict and nothing else: the request path never reaches the
file system, so `..`, `%2e%2e`, `..%2f`, absolute paths and symlinks planted later cannot read anything.
"""

from __future__ import annotations

import mimetypes
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from aiohttp import web

from egressgate.admin.errors import error_response
from egressgate.admin.jsonbody import BodyError, read_object
from egressgate.admin.ui import auth

STATIC_DIR = Path(__file__).with_name("static")
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "font-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon", ".woff2": "font/woff2",
         ".json": "application/json", ".txt": "text/plain; charset=utf-8"}
SESSION_KEY: web.RequestKey[auth.Session] = web.RequestKey("console_session", auth.Session)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_console_path(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


def secure(headers) -> None:
    """Set the console's security headers (also called by handlers that prepare a stream themselves)."""
    headers.update(SECURITY_HEADERS)


@web.middleware
async def console_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost middleware: every /ui response (errors, 404s, redirects included) gets the headers; a
    Host that is not an IP literal or `localhost` is refused before anything else runs (auth.py)."""
    if not is_console_path(request.path):
        return await handler(request)
    if not auth.host_allowed(request.host):
        response: web.StreamResponse = error_response(
            403, "forbidden", "open the console by IP address or localhost (this Host header is refused)")
    else:
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # redirects (the errors middleware turned the rest into JSON)
            secure(exc.headers)
            raise
    if not response.prepared:
        secure(response.headers)
    return response


def guard(handler: Handler, *, roles: Iterable[str] = auth.ROLES, mutating: bool = False) -> Handler:
    """Session (401), then for POST/DELETE the CSRF token and Origin (403), then the role (403)."""
    allowed = frozenset(roles)

    async def guarded(request: web.Request) -> web.StreamResponse:
        console = request.app[CONSOLE_KEY]
        session = console.sessions.get(request.cookies.get(auth.COOKIE))
        if session is None:
            return auth.unauthorized()
        if mutating:
            if not auth.origin_ok(request):
                return auth.forbidden("state-changing console requests need the console's own Origin")
            if not auth.csrf_ok(request, session):
                return auth.forbidden(f"send the session's CSRF token in {auth.CSRF_HEADER} "
                                      "(GET /ui/api/session gives it)")
        if session.role not in allowed:
            return auth.forbidden(f"the {session.role} role cannot do this (needs {' or '.join(sorted(allowed))})")
        request[SESSION_KEY] = session
        return await handler(request)

    guarded.__doc__ = handler.__doc__
    return guarded


def load_static(directory: Path = STATIC_DIR) -> dict[str, tuple[bytes, str]]:
    """{relative posix path: (bytes, content type)} of every regular file under `directory` (no
    symlinks, no dotfiles), read once: the fixed allowlist."""
    files: dict[str, tuple[bytes, str]] = {}
    if not directory.is_dir():
        return files
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if path.is_symlink() or not path.is_file() or any(p.startswith(".") for p in rel.parts):
            continue
        ctype = TYPES.get(path.suffix.lower()) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        files[rel.as_posix()] = (path.read_bytes(), ctype)
    return files


CONSOLE_KEY: web.AppKey = web.AppKey("console", object)


class ShellRoutes:
    """Login, logout, session and static files (the rest of /ui/api is in api.py and live.py)."""

    def __init__(self, console) -> None:
        self.console = console
        self.static = load_static()

    async def index(self, _request: web.Request) -> web.Response:
        return self._file("index.html")

    async def redirect(self, _request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/ui/")

    async def static_file(self, request: web.Request) -> web.Response:
        return self._file(request.match_info["file"])

    def _file(self, name: str) -> web.Response:
        found = self.static.get(name)  # a dict lookup: the only way a request names a file
        if found is None:
            return error_response(404, "not_found", "no such console file")
        body, ctype = found
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def login(self, request: web.Request) -> web.Response:
        if not auth.origin_ok(request):
            return auth.forbidden("log in from the console's own page (Origin must be this console)")
        peer = request.remote or "?"
        limiter = self.console.limiter
        if limiter.blocked(peer):
            response = error_response(429, "too_many_requests", "too many failed logins; wait a minute")
            response.headers["Retry-After"] = str(int(auth.LOGIN_WINDOW_S))
            return response
        try:
            body = await read_object(request)
        except BodyError as exc:
            return exc.response()
        if set(body) - {"token"}:
            return error_response(400, "invalid_request", "keys: token")
        role = auth.match_token(self.console.tokens, body.get("token"))
        if role is None:
            limiter.failed(peer)
            return error_response(401, "unauthorized", "not a console token (console-operator.token or "
                                  "console-auditor.token in the gateway's var dir)")
        self.console.sessions.delete(request.cookies.get(auth.COOKIE))  # a login replaces any previous session
        session_id, session = self.console.sessions.create(role)
        self.console.audit.start_index()  # search is warm by the time the page asks (audit_api.py)
        response = web.json_response({"role": session.role, "csrf": session.csrf, "expires_at": session.expires})
        auth.set_session_cookie(response, request, session_id)
        return response

    async def logout(self, request: web.Request) -> web.Response:
        self.console.sessions.delete(request.cookies.get(auth.COOKIE))
        self.console.live.end_session(request.cookies.get(auth.COOKIE))  # its live streams end too
        response = web.json_response({"logged_out": True})
        auth.clear_session_cookie(response, request)
        return response

    async def session(self, request: web.Request) -> web.Response:
        session = request[SESSION_KEY]
        return web.json_response({"role": session.role, "csrf": session.csrf, "expires_at": session.expires})
