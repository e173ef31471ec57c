"""`egressgate approvals list|show|approve|deny`: the operator's side of approvals.

Talks to the running gateway's admin API (admin/cli.py's helpers: the address the gateway recorded, its
0600 token file, stdlib HTTP without any proxy), so it needs no access to the state store itself.
`--by` defaults to the operator's login name: the audit record says who approved.
"""

from __future__ import annotations

import getpass
import json
import re
from datetime import UTC, datetime
from urllib.parse import quote

import click

from egressgate.admin.cli import _call, _config, _token, admin_url

_DURATION = re.compile(r"^(\d+)([smhd]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_STATES = ("pending", "approved", "denied", "expired")


def parse_duration(text: str) -> int:
    """`90`, `90s`, `10m`, `2h`, `1d` -> seconds (the API takes 1..86400)."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise click.BadParameter(f"expected a duration like 90s, 10m, 2h or 1d, got {text!r}", param_hint="--for")
    seconds = int(match.group(1)) * _UNIT[match.group(2)]
    if not 1 <= seconds <= 86400:
        raise click.BadParameter("between 1 second and 1 day", param_hint="--for")
    return seconds


def _when(value: float | None) -> str:
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if value else "-"


def _target(a: dict) -> str:
    if a.get("kind") == "mcp_tool":  # an MCP tool approval (approvals/model.py KIND_MCP_TOOL)
        return f"mcp tool {a['host']}/{a['path']}"
    if a.get("kind") == "persistent_write":  # a run's staged workspace changes (`approvals show` lists them)
        count = (a.get("details") or {}).get("count")
        return f"persistent write {a['host'].removeprefix('workspace:')} ({count} changes)"
    where = f"{a['scheme']}://{a['host']}:{a['port']}" if a.get("scheme") else f"{a['host']}:{a['port']}"
    target = f"{a['method']} {where}{a['path']}" if a.get("method") else where
    kind = a.get("kind")
    return f"{kind}: {target}" if kind in ("package_install", "publish") else target


def _printable(text: str) -> str:
    """A target was chosen by a sandbox: it must not drive the operator's terminal (ANSI, CR)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def format_table(approvals: list[dict]) -> str:
    rows = [("ID", "STATE", "SANDBOX", "POLICY", "TARGET", "REQUESTED", "SCOPE", "EXPIRES", "BY")]
    for a in approvals:
        rows.append((a["id"], a["state"], a["sandbox_id"], a["policy"], _target(a), _when(a["requested_at"]),
                     a.get("scope") or "-", _when(a.get("expires_at")), a.get("decided_by") or "-"))
    rows = [tuple(_printable(str(cell)) for cell in row) for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _request(config_file: str | None, admin: str | None, method: str, path: str, body: dict | None = None):
    cfg = _config(config_file)
    status, data = _call(method, admin_url(cfg, admin) + path, _token(cfg), body)
    if status != 200:
        raise click.ClickException(f"{method} {path} failed ({status}): {json.dumps(data)}")
    return data


_config_option = click.option("--config", "config_file", type=click.Path(dir_okay=False))
_admin_option = click.option("--admin", "admin", help="Admin API base URL (default: from the running gateway)")


@click.group("approvals")
def approvals() -> None:
    """List, approve and deny sandbox requests outside their allowlist (execution.require_approval_for)."""


@approvals.command("list")
@_config_option
@_admin_option
@click.option("--state", type=click.Choice(_STATES), help="Only approvals in this state")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def list_cmd(config_file: str | None, admin: str | None, state: str | None, fmt: str) -> None:
    """Approvals, newest first."""
    data = _request(config_file, admin, "GET", "/v1/approvals" + (f"?state={state}" if state else ""))
    click.echo(json.dumps(data, indent=2) if fmt == "json" else format_table(data["approvals"]))


@approvals.command("show")
@_config_option
@_admin_option
@click.argument("approval_id")
def show(config_file: str | None, admin: str | None, approval_id: str) -> None:
    """One approval as JSON."""
    click.echo(json.dumps(_request(config_file, admin, "GET", f"/v1/approvals/{quote(approval_id, safe='')}"),
                          indent=2))


@approvals.command("approve")
@_config_option
@_admin_option
@click.argument("approval_id")
@click.option("--for", "duration", default="10m", show_default=True, help="How long the grant lives (90s, 10m, 2h, 1d)")
@click.option("--scope", type=click.Choice(["host", "host+path"]), default="host", show_default=True,
              help="host: any method and path on that scheme://host:port; host+path: only the requested method "
                   "and path")
@click.option("--by", default=None, help="Who approves (default: your login name)")
def approve(config_file: str | None, admin: str | None, approval_id: str, duration: str, scope: str,
            by: str | None) -> None:
    """Grant a pending approval: a time-limited overlay rule for that one sandbox."""
    body = {"for_seconds": parse_duration(duration), "scope": scope, "by": by or getpass.getuser()}
    click.echo(json.dumps(_request(config_file, admin, "POST",
                                   f"/v1/approvals/{quote(approval_id, safe='')}/approve", body)))


@approvals.command("deny")
@_config_option
@_admin_option
@click.argument("approval_id")
@click.option("--by", default=None, help="Who denies (default: your login name)")
def deny(config_file: str | None, admin: str | None, approval_id: str, by: str | None) -> None:
    """Refuse a pending approval; the sandbox's retries of that target get the denial back."""
    click.echo(json.dumps(_request(config_file, admin, "POST", f"/v1/approvals/{quote(approval_id, safe='')}/deny",
                                   {"by": by or getpass.getuser()})))
