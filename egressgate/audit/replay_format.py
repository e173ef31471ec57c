"""The auditor's view of a replay: a terminal-safe table of the decisions that change."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from egressgate.audit.replay import ReplayResult


def printable(text: str) -> str:
    """Terminal-safe: a recorded hostile target must not drive the auditor's terminal (ANSI, CR)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def format_table(result: ReplayResult) -> str:
    rows = [
        ("TIME (UTC)", "SANDBOX", "OPERATION", "TARGET", "CHANGE", "OLD RULE / REASON", "NEW RULE / REASON")
    ]
    for c in result.changes:
        when = datetime.fromtimestamp(c.time_ns / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        rows.append(
            (
                when,
                c.sandbox_id,
                c.operation,
                c.target,
                c.direction,
                f"{c.old_rule or '-'} / {c.old_reason or '-'}",
                f"{c.new_rule or '-'} / {c.new_reason}",
            )
        )
    rows = [tuple(printable(cell) for cell in row) for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    summary = f"{len(result.changes)} changed, {result.unchanged} unchanged, {result.replayed} replayed" + (
        f", {result.approximated_state} with state reconstructed from the log"
        if result.approximated_state
        else ""
    )
    for approval_id, n in sorted(result.by_approval.items()):
        summary += (f"\n{n} allowed by operator approval {printable(approval_id)} (approval_granted, not a rule; the "
                    "`approval` audit records say who granted it, its scope and expiry)")
    if result.arguments_unchecked:
        summary += (f"\n{result.arguments_unchecked} MCP tool calls allowed without their arguments (not "
                    "recorded; mcp.record_arguments): argument constraints not checked")
    for why, n in sorted(result.skipped.items()):
        summary += f"\nskipped {n}: {why}"
    return ("\n".join(lines) + "\n" if result.changes else "") + summary
