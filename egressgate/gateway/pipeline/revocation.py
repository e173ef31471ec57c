"""Revocation: a revoked sandbox loses its open connections, not just its future ones.

The state store notifies subscribers on revoke; we abort every client connection bound to that
sandbox (and with it the upstream connections mitmproxy opened for it). Requests that race the abort
are denied anyway: identity re-reads the record on every request inside a tunnel.
"""

from __future__ import annotations

import logging

from mitmproxy import connection

from egressgate.gateway.shared.context import Runtime

logger = logging.getLogger(__name__)


class Revocation:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        runtime.state.on_revoke(self.revoked)

    def revoked(self, sandbox_id: str) -> None:
        client_ids = list(self.rt.by_sandbox.get(sandbox_id, ()))
        for client_id in client_ids:
            conn = self.rt.conns.get(client_id)
            if conn is not None:
                conn.closed = True
                conn.approved.clear()
            if self.rt.abort_connection is not None:
                self.rt.abort_connection(client_id)
        if client_ids:
            logger.info("revoked sandbox %s: aborted %d connection(s)", sandbox_id, len(client_ids))

    def client_disconnected(self, client: connection.Client) -> None:
        self.rt.forget(client.id)
