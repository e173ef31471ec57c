"""The JSON-RPC methods a client may send on an MCP route, and the protocol versions that have batches.

Why a list (deny by default): the mediator decides `tools/call` and forwards other methods as they are.
A method name the gateway does not know — `Tools/Call`, `tools/call ` or any other spelling — would be
forwarded undecided and unrecorded, and a lenient server may well run it as a tool call. So every request
and notification whose method is not one of the MCP client methods below, spelled exactly (names are
case-sensitive), is refused whole (`mcp_malformed`, detail `unknown_method`, an `mcp_message` record).

The list is the union over the protocol versions the gateway mediates (2024-11-05 .. 2026-07-28; the
python SDK's `ClientRequest` / `ClientNotification` unions, plus the 2025-11-25 task methods). Answers the
client sends to the server's own requests (roots/list, sampling, elicitation) are responses: no method.

Batches (a JSON array of messages) exist only in protocol 2025-03-26 (added there, removed in 2025-06-18):
a batch is refused unless the session's server answered `initialize` with that version. A session that
began before a gateway restart (no initialize seen by this gateway) takes the version from the request's
`MCP-Protocol-Version` header, which streamable HTTP clients send with every request after initialize; a
client claiming 2025-03-26 to a server that negotiated a later version gains nothing (every message of a
batch is decided on its own, and the server refuses the batch). Without either (the 2026-07-28 discovery
handshake, a client that sends no header) the version is unknown: no batches.
"""

from __future__ import annotations

from collections.abc import Iterable

from egressgate.mcp.jsonrpc import McpMalformed, Message

CLIENT_REQUESTS = frozenset(
    {
        "initialize",
        "ping",
        "server/discover",
        "subscriptions/listen",
        "tools/list",
        "tools/call",
        "resources/list",
        "resources/templates/list",
        "resources/read",
        "resources/subscribe",
        "resources/unsubscribe",
        "prompts/list",
        "prompts/get",
        "completion/complete",
        "logging/setLevel",
        "tasks/get",
        "tasks/list",
        "tasks/result",
        "tasks/cancel",
    }
)
CLIENT_NOTIFICATIONS = frozenset(
    {
        "notifications/initialized",
        "notifications/cancelled",
        "notifications/progress",
        "notifications/roots/list_changed",
        "notifications/tasks/status",
    }
)
BATCH_VERSIONS = frozenset({"2025-03-26"})


def check_client_methods(messages: Iterable[Message]) -> None:
    """McpMalformed("unknown_method") for the first request or notification whose method is not an MCP
    client method of its kind."""
    for msg in messages:
        if msg.kind == "response":
            continue
        known = CLIENT_REQUESTS if msg.kind == "request" else CLIENT_NOTIFICATIONS
        if msg.method not in known:
            kind = "request" if msg.kind == "request" else "notification"
            raise McpMalformed(
                "unknown_method",
                f"{str(msg.method)[:64]!r} is not an MCP client {kind} method (method names are case-sensitive)",
            )


def check_batch(version: str | None) -> None:
    """McpMalformed("batch_not_supported") unless the session's protocol version has JSON-RPC batches."""
    if version not in BATCH_VERSIONS:
        raise McpMalformed(
            "batch_not_supported",
            f"protocol version {version or 'unknown'} has no JSON-RPC batches: send one message per request",
        )
