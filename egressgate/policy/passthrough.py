"""Load-time checks of `tls:` and of passthrough rules (called by compiler.py).

A passthrough tunnel is spliced unread, so a rule that needs to read a request cannot be one, and no
other rule may be made weaker by one: an L7 deny rule it would hide requests from, or a credential rule
it would always win over (the first allowing rule sets a CONNECT's mode). Each problem names the key to
change, in compiler.py's `(key path, message)` form. docs/policy.md, "Passthrough routes".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from egressgate.policy.globs import HostPattern
from egressgate.policy.model import HttpRule, TcpRule
from egressgate.policy.reasons import Effect

if TYPE_CHECKING:
    from egressgate.policy.compile import CompiledPolicy


# What a passthrough tunnel cannot enforce, because it never sees a request: each is refused at load
# with the key that asks for it (the gateway splices TLS bytes it cannot read).
_NEEDS_HTTP = {
    "methods": "a passthrough route never sees the request method (TLS is not intercepted)",
    "paths": "a passthrough route never sees the request path (TLS is not intercepted)",
    "query": "a passthrough route never sees the request's query (TLS is not intercepted)",
    "credential": "credentials are injected into intercepted HTTPS only; a passthrough route never sees a request",
}


def tls_problems(raw: HttpRule | TcpRule, scheme: str, effect: Effect, path: str) -> Iterator[tuple[str, str]]:
    """`tls:` is a property of an https allow rule; `passthrough` only on one that needs no HTTP. A
    relayed tunnel (tcp rule or passthrough) is its own one request: `budget.requests` counts tunnels,
    but its bytes are not per rule (the ledger is per sandbox), so `budget.bytes` is refused."""
    tls = raw.tls if isinstance(raw, HttpRule) else None
    relayed = isinstance(raw, TcpRule) or tls == "passthrough"
    if relayed and effect is Effect.ALLOW and raw.budget is not None and raw.budget.bytes is not None:
        yield (f"{path}.budget.bytes", "per-rule byte budgets count HTTP requests, which a relayed tunnel (tcp "
               "rule or tls: passthrough) never shows; use budget.requests (tunnels) or "
               "sandbox.resources.outbound_bytes_max")
    if tls is None:
        return
    if scheme != "https":
        yield f"{path}.tls", "tls applies to network.https rules only"
        return
    if effect is Effect.DENY:
        yield f"{path}.tls", "deny rules have no tls mode (a deny refuses the whole tunnel)"
        return
    if tls != "passthrough":
        return
    for key, why in _NEEDS_HTTP.items():
        if getattr(raw, key) is not None:
            yield f"{path}.{key}", f"{why}; drop `{key}` or `tls: passthrough`"


def covers(outer: HostPattern, inner: HostPattern) -> bool:
    """True when every host `inner` matches is also matched by `outer` (exact, or conservatively False)."""
    if outer.kind == "any":
        return True
    if inner.kind == "exact":
        return outer.matches(inner.value)
    if outer.kind == "suffix" and inner.kind == "suffix":
        return inner.value == outer.value or inner.value.endswith("." + outer.value)
    return False


def hosts_overlap(a: HostPattern, b: HostPattern) -> bool:
    """Conservative: True when some host could match both patterns (`except_hosts` are not considered
    here; the caller drops a deny whose `except_hosts` cover the whole passthrough pattern)."""
    if a.kind == "any" or b.kind == "any":
        return True
    if a.kind == "exact" or b.kind == "exact":
        exact, other = (a, b) if a.kind == "exact" else (b, a)
        return other.matches(exact.value)
    return a.value == b.value or a.value.endswith("." + b.value) or b.value.endswith("." + a.value)


def passthrough_problems(policy: CompiledPolicy) -> Iterator[tuple[str, str]]:
    """A https deny rule with methods or paths is enforced per request inside an intercepted tunnel; a
    passthrough tunnel to a host it covers would carry those requests unseen, so the deny would read
    narrower than it is. Refused at load (conservatively: any host and port overlap counts). So is a
    credential rule that an earlier passthrough rule always wins over (first match sets the mode)."""
    passthrough = [r for r in policy.rules if r.passthrough]
    if not passthrough:
        return
    for allow in passthrough:  # a credential rule after a passthrough rule that covers it is dead
        assert allow.ports is not None
        for rule in policy.rules:
            if (rule.credential is None or rule.index < allow.index or allow.when is not None
                    or not allow.host.matches(rule.host.value) or rule.ports is None
                    or not rule.ports <= allow.ports or any(p.matches(rule.host.value) for p in allow.except_hosts)):
                continue
            yield (
                f"{rule.key_path}.credential",
                f"passthrough rule {allow.id!r} ({allow.key_path}) comes first and splices every tunnel to "
                f"{rule.host}, so this credential would never be injected; move this rule above it",
            )
    l7_denies = [r for r in policy.rules if r.effect is Effect.DENY and r.scheme == "https"
                 and (r.methods is not None or r.paths is not None)]
    for allow in passthrough:
        assert allow.ports is not None  # allow rules always have ports
        for deny in l7_denies:
            if not hosts_overlap(allow.host, deny.host):
                continue
            if any(covers(excepted, allow.host) for excepted in deny.except_hosts):
                continue  # the deny never applies to a host this rule splices
            if deny.ports is not None and not (deny.ports & allow.ports):
                continue
            yield (
                f"{allow.key_path}.tls",
                f"deny rule {deny.id!r} ({deny.key_path}) restricts methods/paths on hosts this passthrough "
                f"rule splices unseen, so it could not be enforced; narrow one of the hosts or drop "
                f"`tls: passthrough`",
            )
