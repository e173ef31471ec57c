"""What an MCP session keeps of the requests it forwarded and is waiting for the answers to
(egressgate/mcp/mediator.py states the rules: one request per id at a time, at most MAX_WAITING)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from egressgate.mcp.records import fold_outcome

if TYPE_CHECKING:
    from egressgate.audit.event import AuditEvent

_LONG_ID = 64  # a longer string id is kept as its sha256 in `outstanding` (bounded memory per id)


@dataclass(slots=True)
class HeldOutcome:
    """The outcome of a call whose decision record is its POST's (mcp/records.fold_network): held for the
    gateway flow, which writes it into the POST's own outcome record (one record per call) while `open`.
    When the POST ended before the call's answer came (HTTP+SSE: the answer travels on the stream), the
    POST's outcome record waits here instead (`waiting`) and the call's outcome is folded into it when it
    comes (records.fold_outcome). Neither: (the session closed first) it is written on its own."""

    event: AuditEvent | None = None
    open: bool = True
    waiting: AuditEvent | None = None  # the POST's outcome record, built when the POST ended

    def settle(self, event: AuditEvent) -> AuditEvent | None:
        """The call's outcome `event` is known: None while the flow holds it (it writes it), else the
        record to write now."""
        if self.open:
            self.event = event
            return None
        waiting, self.waiting = self.waiting, None
        return fold_outcome(waiting, event) if waiting is not None else event


@dataclass(slots=True)
class Pending:
    request_id: str
    tool: str
    started: float  # monotonic
    counted: tuple[str, ...] = ()  # budget keys the call consumed (given back if it is not forwarded)
    held: HeldOutcome | None = None


@dataclass(slots=True)
class Ticket:
    """The requests one client body forwarded, so the transport can free the ids of those its exchange
    ended without answering (`McpSession.release`). `serial` tells this body's reservations from a later
    body's reuse of the same id (after an answer freed it)."""

    serial: int
    calls: dict[int | str, Pending] = field(default_factory=dict)
    others: list[tuple[int | str, int | str | bytes]] = field(default_factory=list)  # (id, id_key)


def id_key(jsonrpc_id: int | str | None) -> int | str | bytes | None:
    """What `outstanding` keeps of an id: the id, or the sha256 of a long string id (a 1 MB id would
    otherwise be held for as long as its request waits; bytes never equal an int or a str id)."""
    if isinstance(jsonrpc_id, str) and len(jsonrpc_id) > _LONG_ID:
        return hashlib.sha256(jsonrpc_id.encode("utf-8")).digest()
    return jsonrpc_id
