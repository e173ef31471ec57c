"""A relayed tunnel is a request to its host: it enters the sandbox's request history.

`when: {after_request_to: ..., unless_request_to: ...}` conditions and per-rule request budgets read the
sandbox's history (`state.record_request`), which the HTTP path writes for every allowed request
(enforce.py). A tunnel the gateway relays without reading it (`tls: passthrough`, a `network.tcp` rule)
carries requests nobody sees, so the tunnel itself is the request: it is written before the first byte
goes upstream. Without it, a sandbox could read `secrets.example.com` through a passthrough tunnel and
still pass `unless_request_to: [secrets.example.com]` on its way to an upload host.

Fail closed: a history that cannot be written refuses the tunnel (`state_unavailable`), since every
later condition would be judged on a history that misses this contact.
"""

from __future__ import annotations

import logging

from egressgate.gateway.context import Runtime
from egressgate.gateway.deny import gateway_deny
from egressgate.policy.facts import Decision
from egressgate.policy.reasons import Reason
from egressgate.state.base import StateUnavailable

logger = logging.getLogger(__name__)


async def record_contact(rt: Runtime, sandbox_id: str | None, host: str | None,
                         rule_id: str | None) -> Decision | None:
    """Write the tunnel's host (and its rule's use) into the sandbox's history; the deny if it failed."""
    if sandbox_id is None or host is None:
        return gateway_deny(Reason.STATE_UNAVAILABLE)
    try:
        await rt.state.record_request(sandbox_id, host, rule_id, 0)
    except (StateUnavailable, KeyError):
        logger.error("could not record the tunnel to %s in the history of %s", host, sandbox_id)
        return gateway_deny(Reason.STATE_UNAVAILABLE)
    return None
