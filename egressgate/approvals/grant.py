"""An approved, time-limited widening of one sandbox's allowlist, as the decision engine sees it.

Kept free of imports so `policy.facts.SandboxState` can carry grants without a package cycle: the
decision engine stays pure (the caller hands it the sandbox's live grants and `now`).
"""

from __future__ import annotations

from dataclasses import dataclass

SCOPE_HOST = "host"  # any method and path on scheme://host:port
SCOPE_HOST_PATH = "host+path"  # only the approved method on the approved canonical path
SCOPES = (SCOPE_HOST, SCOPE_HOST_PATH)
# The scheme of an approved MCP tool (approvals/model.py KIND_MCP_TOOL): such a grant names a server and a
# tool, never a network target (overlay.covers refuses it for every request)
MCP_SCHEME = "mcp"
KIND_NETWORK = "network_expansion"


@dataclass(frozen=True, slots=True)
class Grant:
    id: str
    sandbox_id: str
    scope: str
    scheme: str | None  # None: asked for at CONNECT (the tunnel's requests are http or https)
    host: str  # canonical
    port: int
    method: str | None
    path: str | None  # canonical, no query
    expires_at: float  # unix seconds; the grant is dead from this instant on
    # what was approved: "network_expansion" (widens the allowlist), "package_install" / "publish" (lets
    # requests of that operation class through that the rules allow: policy/opclass.py), "mcp_tool"
    kind: str = KIND_NETWORK

    def to_json(self) -> dict:
        out = {"id": self.id, "sandbox_id": self.sandbox_id, "scope": self.scope, "scheme": self.scheme,
               "host": self.host, "port": self.port, "method": self.method, "path": self.path,
               "expires_at": self.expires_at}
        if self.kind != KIND_NETWORK:  # network grants keep the shape they were stored and audited in
            out["kind"] = self.kind
        return out

    @classmethod
    def from_json(cls, raw: dict) -> Grant:
        """Strict: a malformed grant (a corrupt store entry, a hand-edited audit record) is a ValueError,
        never a grant wider than what was approved."""
        def opt_str(key: str) -> str | None:
            value = raw.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"grant {key}: not a string")
            return value

        port, expires = raw.get("port"), raw.get("expires_at")
        if raw.get("scope") not in SCOPES:
            raise ValueError("grant scope")
        if type(port) is not int or not isinstance(expires, int | float) or isinstance(expires, bool):
            raise ValueError("grant port/expires_at")
        for key in ("id", "sandbox_id", "host"):
            if not isinstance(raw.get(key), str) or not raw[key]:
                raise ValueError(f"grant {key}")
        kind = raw.get("kind", KIND_NETWORK)
        if not isinstance(kind, str) or not kind:
            raise ValueError("grant kind")
        grant = cls(id=raw["id"], sandbox_id=raw["sandbox_id"], scope=raw["scope"], scheme=opt_str("scheme"),
                    host=raw["host"], port=port, method=opt_str("method"), path=opt_str("path"),
                    expires_at=float(expires), kind=kind)
        if grant.scope == SCOPE_HOST_PATH and (grant.method is None or grant.path is None):
            raise ValueError("a host+path grant needs a method and a path")
        return grant
