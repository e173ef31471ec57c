"""The `state:` section of the gateway config: where the sandbox registry and the counters live.

`memory` (the default) keeps them in the gateway process: one process, nothing shared. `redis` shares
them between workers and replicas (docs/operations.md, "State"). A `url` without `backend: redis` is
refused rather than ignored: an operator who wrote it expects replicas to share budgets, and silently
running on per-process memory would give each replica a full budget of its own.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Literal
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

_PREFIX = re.compile(r"[A-Za-z0-9_.:{}-]{1,64}")


class StateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    backend: Literal["memory", "redis"] = "memory"
    url: str | None = None  # redis://[user:password@]host:port/db, rediss:// (TLS) or unix:///path/to/redis.sock
    key_prefix: str = "egressgate:"  # every key this gateway writes starts with it (share a Redis safely)
    # redis: a worker whose heartbeat key is this old is dead and its byte leases are forfeited. Shorter
    # forfeits a crashed worker's leases sooner; too short declares a live but stalled worker dead (it is
    # refreshed every third of it), hence the 3 s floor.
    heartbeat_ttl_seconds: float = 15.0
    # The Redis password read from a file at start (a Secret, compose's generated one) instead of written
    # into `url`: a config file is shown, copied and committed; the password should not travel with it.
    password_file: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"state.url must start with redis://, rediss:// or unix://, got scheme "
                             f"{parts.scheme or '(none)'!r}")
        if parts.scheme == "unix" and not parts.path:
            raise ValueError("state.url: unix:// needs the socket's path (unix:///run/redis/redis.sock)")
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError("state.url: no host (expected redis://host:port/db)")
        return value

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not _PREFIX.fullmatch(value):
            raise ValueError("state.key_prefix must be 1-64 characters of letters, digits and _ . : { } -, "
                             f"got {value!r}")
        return value

    @field_validator("heartbeat_ttl_seconds")
    @classmethod
    def _heartbeat(cls, value: float) -> float:
        if not 3.0 <= value <= 300.0:
            raise ValueError(f"state.heartbeat_ttl_seconds must be between 3 and 300, got {value}")
        return value

    def endpoints(self) -> list[tuple[str, int]]:
        """Where the gateway reaches its Redis (host, port), for Runtime.is_self: a sandbox is never relayed
        there, whatever its policy allows (with `allow_private` loopback and a `tcp` rule it could otherwise
        speak RESP to the store: reset its budget, un-revoke itself, FLUSHALL). A host name is kept as is
        (is_self then refuses that port on every address: it cannot tell). None for memory or unix://."""
        if self.backend != "redis" or self.url is None:
            return []
        parts = urlsplit(self.url)
        if parts.scheme == "unix" or parts.hostname is None:
            return []
        return [(parts.hostname, parts.port or 6379)]

    @model_validator(mode="after")
    def _backend_needs(self) -> StateConfig:
        if self.backend == "redis" and self.url is None:
            raise ValueError("state.url is required with state.backend: redis (e.g. redis://127.0.0.1:6379/0)")
        if self.backend == "memory" and self.url is not None:
            raise ValueError("state.url is set but state.backend is memory: set `backend: redis` to share "
                             "state through that Redis, or remove the url")
        if self.password_file is not None:
            if self.backend != "redis":
                raise ValueError("state.password_file is set but state.backend is memory: it is Redis's password")
            if urlsplit(self.url or "").password is not None:
                raise ValueError("state.password_file and a password in state.url: keep one (the file)")
        return self

    def connection_url(self) -> str:
        """`url` with the password of `password_file` spliced in (user kept, percent-encoded): what the
        clients connect with. Read at start; a missing, empty or world-readable file stops the gateway."""
        assert self.url is not None
        if self.password_file is None:
            return self.url
        path = Path(self.password_file)
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
            password = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise StatePasswordError(f"state.password_file {path}: cannot read it ({exc.strerror or exc})") from None
        if mode & 0o007:
            raise StatePasswordError(f"state.password_file {path}: mode {mode:04o} lets every local user read it; "
                                     "make it 0600 or 0440")
        if not password or any(c in password for c in "\r\n\0"):
            raise StatePasswordError(f"state.password_file {path}: empty, or more than one line")
        parts = urlsplit(self.url)
        user = quote(parts.username, safe="") if parts.username else ""
        netloc = f"{user}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
        return urlunsplit(parts._replace(netloc=netloc))


class StatePasswordError(RuntimeError):
    """state.password_file cannot be used (the message names the file and what to change)."""
