"""Target resolution, shared by every decision path: resolve a name once, check every address, pin one
(`resolve_target` / `resolve_checked`), and bind a connection to an allowed, recorded target
(`bind_tunnel`). The decision stages stage the result (`FlowState.pinned`); pinning.py alone makes a
destination dialable and enforces the dial (its module docstring says why it is three steps).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from egressgate.gateway.service.resolver import ResolveError
from egressgate.gateway.shared.context import ConnState, PinnedTarget, Runtime
from egressgate.gateway.shared.deny import gateway_deny
from egressgate.policy.addr import METADATA_HOSTNAMES, AddrClass, check_address
from egressgate.policy.canon import parse_ip_literal
from egressgate.policy.facts import Decision, Facts, IPAddress
from egressgate.policy.reasons import Reason

logger = logging.getLogger(__name__)


def address_verdict(address: IPAddress, allow_private) -> Decision | None:
    verdict = check_address(address, allow_private)
    if verdict is None:
        return None
    if verdict.addr_class is AddrClass.METADATA:
        return gateway_deny(
            Reason.METADATA_ENDPOINT,
            "Cloud metadata endpoints are never reachable from a sandbox.",
            detail=str(verdict.addr_class),
        )
    return gateway_deny(
        Reason.ADDRESS_FORBIDDEN,
        f"The destination resolves to a {verdict.addr_class} address, which this sandbox may not reach.",
        detail=str(verdict.addr_class),
    )


async def resolve_target(rt: Runtime, policy, host: str, port: int) -> tuple[PinnedTarget | None, Decision | None]:
    """Resolve `host` (canonical) once and check every answer; deny if ANY answer is forbidden (a name
    that mixes a public and a private address is a rebinding setup, not a legitimate service)."""
    target, denied, _addresses = await resolve_checked(rt, policy, host, port)
    return target, denied


async def resolve_checked(
    rt: Runtime, policy, host: str, port: int
) -> tuple[PinnedTarget | None, Decision | None, tuple[IPAddress, ...]]:
    """`resolve_target`, plus every address the check read (empty when nothing was resolved). The address
    check is part of the decision, so its record must carry them (`with_addresses`): replay re-decides an
    `address_forbidden` deny from exactly these (docs/audit.md, "Replay")."""
    if host in METADATA_HOSTNAMES:
        return None, gateway_deny(Reason.METADATA_ENDPOINT, "Cloud metadata endpoints are never reachable."), ()
    literal = parse_ip_literal(host)
    if literal is not None:
        addresses: tuple[IPAddress, ...] = (literal,)
        sni = None
    else:
        try:
            addresses = await rt.resolver.resolve(host)
        except ResolveError as exc:
            logger.info("resolve failed: %s", exc)
            return (
                None,
                gateway_deny(Reason.UPSTREAM_UNRESOLVABLE, f"The name {host} could not be resolved by the gateway."),
                (),
            )
        sni = host
    for address in addresses:
        denied = address_verdict(address, policy.allow_private)
        if denied is not None:
            return None, denied, addresses
    chosen = addresses[0]
    if rt.is_self(chosen, port):
        return None, gateway_deny(Reason.SELF_CONNECTION), addresses
    return PinnedTarget(host=host, port=port, address=chosen, sni=sni), None, addresses


def with_addresses(facts: Facts, addresses: tuple[IPAddress, ...]) -> Facts:
    """`facts` as a refused decision read them: the addresses the gateway resolved and checked. Without
    them an `address_forbidden` record replays as an allow (a false flip in `audit replay`). Only on the
    deny path (dataclasses.replace costs µs per request): an allow's record names the address it dialed
    (`egressgate.pinned.address`), which replay reads instead."""
    return replace(facts, addresses=addresses) if addresses and facts.addresses != addresses else facts


def bind_tunnel(conn: ConnState, host: str, port: int, as_sent: str | None, target: PinnedTarget,
                dial_key: tuple[str, int] | None) -> None:
    """Commit an allowed, recorded name decision: the connection is now a tunnel to `target` (every
    request on it is decided against this name and dialed to this address) and `dial_key`, the address
    mitmproxy will ask to dial for it, becomes dialable. The one place a tunnel is bound (CONNECT here,
    a transparent connection's name in transparent_decide.py)."""
    conn.tunnel_host, conn.tunnel_port, conn.tunnel_as_sent = host, port, as_sent
    conn.tunnel_target = target
    if dial_key is not None:
        conn.approved[dial_key] = target
