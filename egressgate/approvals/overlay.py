"""The pure overlay rules: which requests an operator's approval may let through, and when.

An approval only ever widens the host/port/method/path allowlist of ONE sandbox. decide() consults it
last, after every check that must hold whatever an operator said (metadata and non-global addresses,
the sandbox's byte budget, deny rules, path ambiguity), and only when the allow rules refused the
request for where it goes (`EXPANDABLE`): a failed `when` condition or a spent rule budget is a
decision the policy made, not a gap in the allowlist. A grant never carries a credential, never opens
raw TCP or a passthrough tunnel (a covered CONNECT is intercepted, so every request inside it is
decided again), and is dead from `expires_at` on — `now` is passed in, never read here.
"""

from __future__ import annotations

from collections.abc import Iterable

from egressgate.approvals.grant import KIND_NETWORK, MCP_SCHEME, SCOPE_HOST, SCOPE_HOST_PATH, Grant
from egressgate.policy.facts import Facts, Operation
from egressgate.policy.reasons import Reason

NETWORK_EXPANSION = "network_expansion"
# Denials an approval may turn into an allow: the request is simply outside the allowlist.
EXPANDABLE = frozenset({
    Reason.HOST_NOT_ALLOWED, Reason.SCHEME_NOT_ALLOWED, Reason.PORT_NOT_ALLOWED,
    Reason.METHOD_NOT_ALLOWED, Reason.PATH_NOT_ALLOWED,
})
APPROVABLE_SCHEMES = ("https", "http")  # never tcp: raw bytes cannot be checked per request


def approvable(facts: Facts, reason: Reason) -> bool:
    """Could an approval cover this refused request at all? (CONNECT or an HTTP(S) request on a port.)"""
    if reason not in EXPANDABLE or facts.port is None:
        return False
    return facts.operation is Operation.CONNECT or (
        facts.operation is Operation.HTTP_REQUEST and facts.scheme in APPROVABLE_SCHEMES)


def covers(grant: Grant, facts: Facts, sandbox_id: str, now: float) -> bool:
    if grant.sandbox_id != sandbox_id or now >= grant.expires_at:
        return False
    if grant.scheme == MCP_SCHEME or grant.kind != KIND_NETWORK:
        return False  # an approved MCP tool, package install or publish never widens the network allowlist
    if facts.host != grant.host or facts.port != grant.port:
        return False
    if facts.operation is Operation.CONNECT:
        return True  # intercepted: each request inside is decided against the grant again
    if facts.operation is not Operation.HTTP_REQUEST or facts.scheme not in APPROVABLE_SCHEMES:
        return False
    if grant.scheme is not None and facts.scheme != grant.scheme:
        return False
    if grant.scope == SCOPE_HOST:
        return True
    return grant.scope == SCOPE_HOST_PATH and facts.method == grant.method and facts.path == grant.path


def covering(grants: Iterable[Grant], facts: Facts, sandbox_id: str, now: float) -> Grant | None:
    for grant in grants:
        if covers(grant, facts, sandbox_id, now):
            return grant
    return None


def class_covering(grants: Iterable[Grant], facts: Facts, kind: str, sandbox_id: str, now: float) -> Grant | None:
    """A live grant of operation class `kind` (package_install, publish) for this sandbox that covers the
    request: same scheme://host:port (scope host), or also the same method and canonical path (host+path).
    Such a grant only lets through a request the network rules (or a network approval) already allow."""
    for grant in grants:
        if grant.kind != kind or grant.sandbox_id != sandbox_id or now >= grant.expires_at:
            continue
        if facts.host != grant.host or facts.port != grant.port:
            continue
        if grant.scheme is not None and facts.scheme != grant.scheme:
            continue
        if grant.scope == SCOPE_HOST or (
                grant.scope == SCOPE_HOST_PATH and facts.method == grant.method and facts.path == grant.path):
            return grant
    return None
