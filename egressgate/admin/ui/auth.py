"""Console authentication: role tokens, server-side sessions, CSRF and Origin checks, login rate limit.

Why each rule (the console is a browser app on the admin listener, so it has a browser's threats):

* Two roles, each with its own token in a 0600 file in the var dir next to the admin token (created on
  first start): `operator` may revoke and approve; `auditor` only reads (and runs pure computations).
  The admin bearer token is never accepted here and a console session never opens the /v1 API.
* Login exchanges a token for a session cookie (`HttpOnly; SameSite=Strict; Path=/ui`): JavaScript never
  holds the token, other sites' pages never send the cookie. The id is 256 random bits; the server keeps
  the session (role, CSRF token, expiry: 8 h) as a 0600 file named by SHA-256 of the id, in the var dir,
  so every worker process of `run --workers N` knows it and logout ends it everywhere.
* Every state-changing request needs `X-CSRF-Token` equal to the session's CSRF token AND an `Origin`
  equal to the console's own origin; login (no session yet) needs the same Origin.
* The Host must be an IP literal or `localhost` (DNS rebinding: a page on evil.example rebound to
  127.0.0.1 would otherwise be "same origin" with the console).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from egressgate.admin.errors import error_response

ROLES = ("operator", "auditor")
COOKIE = "egressgate_console"
SESSION_SECONDS = 8 * 3600
MAX_SESSIONS = 256  # per gateway (all workers): a login beyond it ends the oldest session
CSRF_HEADER = "X-CSRF-Token"
LOGIN_FAILURES_MAX = 10  # failed logins per client address per LOGIN_WINDOW_S, then 429
LOGIN_WINDOW_S = 60.0


def token_path(var: Path, role: str) -> Path:
    return var / f"console-{role}.token"


def ensure_role_tokens(var: Path) -> dict[str, str]:
    """{role: token}; each created (0600, exclusive) on first start like the admin token."""
    from egressgate.admin.server import ensure_admin_token  # here: server.py imports this package

    return {role: ensure_admin_token(token_path(var, role)) for role in ROLES}


@dataclass(frozen=True, slots=True)
class Session:
    role: str
    csrf: str
    expires: float


class SessionStore:
    """Server-side sessions as files `<dir>/<sha256(id)>` (0600): the id itself is never on disk."""

    def __init__(self, directory: Path, clock=time.time) -> None:
        self.dir = directory
        self.clock = clock
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(directory, 0o700)

    def _file(self, session_id: str) -> Path:
        return self.dir / hashlib.sha256(session_id.encode("utf-8", "surrogateescape")).hexdigest()

    def create(self, role: str) -> tuple[str, Session]:
        self.purge()
        session_id = secrets.token_urlsafe(32)  # 256 bits
        session = Session(role=role, csrf=secrets.token_urlsafe(32), expires=self.clock() + SESSION_SECONDS)
        fd = os.open(self._file(session_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"role": session.role, "csrf": session.csrf, "expires": session.expires}, fh)
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id or len(session_id) > 128:
            return None
        path = self._file(session_id)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            session = Session(role=data["role"], csrf=data["csrf"], expires=float(data["expires"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if session.role not in ROLES or session.expires <= self.clock():
            path.unlink(missing_ok=True)
            return None
        return session

    def delete(self, session_id: str | None) -> None:
        if session_id and len(session_id) <= 128:
            self._file(session_id).unlink(missing_ok=True)

    def purge(self) -> None:
        """Remove expired sessions, and the oldest beyond MAX_SESSIONS (on every login: the store never
        grows without bound, however often a token holder logs in)."""
        now = self.clock()
        live: list[tuple[float, Path]] = []
        for path in self.dir.iterdir():
            try:
                expires = float(json.loads(path.read_text(encoding="utf-8"))["expires"])
            except (OSError, ValueError, KeyError, TypeError):
                expires = now
            if expires <= now:
                path.unlink(missing_ok=True)
            else:
                live.append((expires, path))
        for _expires, path in sorted(live)[:max(0, len(live) - MAX_SESSIONS + 1)]:
            path.unlink(missing_ok=True)


class LoginLimiter:
    """At most LOGIN_FAILURES_MAX failed logins per client address per window (per process)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.failures: dict[str, deque[float]] = {}

    def _recent(self, peer: str) -> deque[float]:
        now = self.clock()
        q = self.failures.setdefault(peer, deque())
        while q and q[0] <= now - LOGIN_WINDOW_S:
            q.popleft()
        if not q:
            self.failures.pop(peer, None)
        return q

    def blocked(self, peer: str) -> bool:
        return len(self._recent(peer)) >= LOGIN_FAILURES_MAX

    def failed(self, peer: str) -> None:
        self.failures.setdefault(peer, deque()).append(self.clock())
        if len(self.failures) > 10_000:  # bounded memory whatever the number of peers
            self.failures.pop(next(iter(self.failures)))


def host_allowed(host: str) -> bool:
    """The Host header names this machine by IP literal or `localhost` (anything else: DNS rebinding)."""
    if host.startswith("["):  # [v6] or [v6]:port
        name, sep, _rest = host[1:].partition("]")
        if not sep:
            return False
    else:
        name = host.partition(":")[0]
    if name.lower() == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def own_origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


def origin_ok(request: web.Request) -> bool:
    origin = request.headers.get("Origin")
    return origin is not None and hmac.compare_digest(origin.encode(), own_origin(request).encode())


def forbidden(message: str) -> web.Response:
    return error_response(403, "forbidden", message)


def unauthorized() -> web.Response:
    return error_response(401, "unauthorized", "log in to the console first (POST /ui/api/login with a role token)")


def csrf_ok(request: web.Request, session: Session) -> bool:
    presented = request.headers.get(CSRF_HEADER, "")
    return bool(presented) and hmac.compare_digest(presented.encode(), session.csrf.encode())


def set_session_cookie(response: web.StreamResponse, request: web.Request, session_id: str) -> None:
    response.set_cookie(COOKIE, session_id, path="/ui", httponly=True, samesite="Strict",
                        secure=request.secure, max_age=SESSION_SECONDS)


def clear_session_cookie(response: web.StreamResponse, request: web.Request) -> None:
    response.set_cookie(COOKIE, "", path="/ui", httponly=True, samesite="Strict", secure=request.secure,
                        max_age=0, expires="Thu, 01 Jan 1970 00:00:00 GMT")


def match_token(tokens: dict[str, str], presented: object) -> str | None:
    """The role whose token this is (constant-time compare against each), else None."""
    if not isinstance(presented, str) or not 16 <= len(presented) <= 256:
        return None
    found = None
    for role, token in tokens.items():
        if hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), token.encode()):
            found = role
    return found
