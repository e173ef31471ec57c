"""Decisions a crash left without their `outcome` record, for `audit verify` (docs/audit.md, section 3).

Why: the gateway writes a decision record before it forwards a request (intent before effect) and the
`outcome` record after the response, behind it (write-behind: `FileSink.enqueue_after`). A gateway killed
with SIGKILL loses what was still in memory: outcomes waiting for their batch and every request in flight.
The decision records are durable, so the gap is exactly computable from the trail: every allowed decision
that expects an outcome and has none in any later record. `verify` reports them by request id at the crash
that caused them (a recovery checkpoint, or a `crash_tail_invalid` incident) — a recovered gap, never
silence. Outcomes the next run wrote from the retry spool (`egressgate.retry.after_restart`) close their
decision like any other outcome.

Which decisions expect an outcome: an allowed `http_request`; an allowed `connect` of a tunnel relayed
unread (`egressgate.intercept` false, `url.scheme` `tcp`, `egressgate.tls` `passthrough`: its bytes are the
request; an intercepted tunnel's requests have their own records); an allowed `mcp_tool_call`. A later deny
record under the same request id (a trailer refusal after the body, an internal error) also closes it.
Not covered: the second outcome of a WebSocket session (its 101 outcome already closed the decision).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from egressgate.audit.record import K_OPERATION

K_REQUEST_ID = "egressgate.request.id"


def expects_outcome(attrs: dict) -> bool:
    if attrs.get("egressgate.decision") != "allow":
        return False
    op = attrs.get(K_OPERATION)
    if op in ("http_request", "mcp_tool_call"):
        return True
    return op == "connect" and (
        attrs.get("egressgate.intercept") is False
        or attrs.get("url.scheme") == "tcp"
        or attrs.get("egressgate.tls") == "passthrough"
    )


@dataclass(slots=True)
class Gap:
    """The decisions (request ids, in log order) left without an outcome by the crash sealed at `path`:`line`."""

    path: str
    line: int
    request_ids: list[str] = field(default_factory=list)

    def message(self) -> str:
        ids = ", ".join(self.request_ids)
        return (
            f"line {self.line}: recovered gap: {len(self.request_ids)} allowed decision(s) made before this "
            f"crash have no outcome record (the gateway was killed before writing it; the request may have "
            f"been forwarded): request ids {ids}"
        )


@dataclass(slots=True)
class OutcomeTracker:
    """Fed every record of one chain in order (`verify_files`)."""

    open: dict[str, None] = field(default_factory=dict)  # request ids awaiting an outcome, in log order
    crashes: list[tuple[Gap, dict[str, None]]] = field(default_factory=list)

    def feed(self, attrs: dict) -> None:
        rid = attrs.get(K_REQUEST_ID)
        if not isinstance(rid, str):
            return
        if expects_outcome(attrs):
            self.open[rid] = None
            return
        if attrs.get(K_OPERATION) == "outcome" or attrs.get("egressgate.decision") == "deny":
            self.open.pop(rid, None)
            for _gap, waiting in self.crashes:
                waiting.pop(rid, None)  # written after the restart (retry spool)

    def crash(self, path: str, line: int) -> None:
        """The writer died here: whatever is open now can only be closed by an outcome the next run writes."""
        if self.open:
            self.crashes.append((Gap(path, line), self.open))
            self.open = {}

    def gaps(self) -> list[Gap]:
        out = []
        for gap, waiting in self.crashes:
            if waiting:
                gap.request_ids = list(waiting)
                out.append(gap)
        return out
