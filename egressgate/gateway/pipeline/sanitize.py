"""The Sanitize stage: strip what must never go upstream before the decision (layers/hop_by_hop.py holds the rules,
shared with the upstream side of the HTTP layers)."""

from __future__ import annotations

from mitmproxy import http

from egressgate.gateway.layers.hop_by_hop import strip_hop_by_hop


class Sanitize:
    """Addon: strip before the decision, so byte counting and the audit see what is actually sent."""

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        strip_hop_by_hop(flow.request)
