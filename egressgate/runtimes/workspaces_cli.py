"""`egressgate workspaces list|show|rm`: the persistent workspaces the runtime keeps (runtimes/workspaces.py).

Reads the var dir directly (as root, like `sandbox run`); `rm` is recorded in the audit chain through the
running gateway (operation `workspace`, action `removed`) and refused when that record cannot be written, when
a run uses the workspace or while a write waits for approval.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import click

from egressgate.runtimes.workspaces import Store, WorkspaceError, all_stores, is_name

_config_option = click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), help="the gateway's config (for var_dir)"
)
_var_option = click.option("--var-dir", "var_dir", type=click.Path(file_okay=False), help="the gateway's var dir")


def _var(config_file: str | None, var_dir: str | None) -> Path:
    from egressgate.runtimes.entry import var_dir_of
    from egressgate.runtimes.workload import SetupFailed

    try:
        return var_dir_of(config_file, var_dir).absolute()
    except SetupFailed as exc:
        raise click.ClickException(str(exc)) from None


def _store(var: Path, workspace: str) -> Store:
    try:
        store = Store(var, name=workspace) if is_name(workspace) else Store(var, path=Path(workspace).resolve())
    except WorkspaceError as exc:
        raise click.ClickException(str(exc)) from None
    if not store.state_file.exists() and not (store.name and store.dir.is_dir()):
        raise click.ClickException(f"no workspace {workspace!r} in {var}")
    return store


def summary(store: Store) -> dict[str, Any]:
    try:
        state = store.load() or {}
    except WorkspaceError as exc:
        return {"workspace": store.label, "error": str(exc)}
    pending = state.get("pending") or {}
    return {
        "workspace": store.label,
        "kind": "named" if store.name else "directory",
        "data": str(store.data),
        "entries": len(state.get("entries") or {}),
        "manifest_hash": state.get("manifest_hash"),
        "saved_at": state.get("saved_at"),
        "policy": state.get("policy"),
        "policy_hash": state.get("policy_hash"),
        "last_sandbox": state.get("sandbox_id"),
        "pending_write": (
            {"approval_id": pending.get("approval_id"), "changes": pending.get("count")} if pending else None
        ),
        "dependencies": len(state.get("inventory") or {}),
    }


@click.group("workspaces")
def workspaces() -> None:
    """Persistent workspaces kept by the runtime (`sandbox run --workspace NAME`)."""


@workspaces.command("list")
@_config_option
@_var_option
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def list_cmd(config_file: str | None, var_dir: str | None, fmt: str) -> None:
    """Every workspace with its manifest hash, last save and pending write."""
    rows = [summary(s) for s in all_stores(_var(config_file, var_dir))]
    if fmt == "json":
        click.echo(json.dumps({"workspaces": rows}, indent=2))
        return
    table = [("WORKSPACE", "ENTRIES", "MANIFEST", "SAVED", "POLICY", "PENDING")]
    for r in rows:
        saved = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r["saved_at"])) if r.get("saved_at") else "-"
        pending = (r.get("pending_write") or {}).get("approval_id") or "-"
        table.append(
            (
                r["workspace"],
                str(r.get("entries", "-")),
                (r.get("manifest_hash") or "-")[:19],
                saved,
                r.get("policy") or "-",
                pending,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    click.echo("\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table))


@workspaces.command("show")
@_config_option
@_var_option
@click.argument("workspace")
@click.option("--files", is_flag=True, help="also print the manifest (every kept path with size and sha256)")
def show(config_file: str | None, var_dir: str | None, workspace: str, files: bool) -> None:
    """One workspace as JSON: manifest hash, dependency inventory, last run, pending write."""
    store = _store(_var(config_file, var_dir), workspace)
    out = summary(store)
    state = store.load() or {}
    out["inventory"] = state.get("inventory") or {}
    if files:
        out["manifest"] = state.get("entries") or {}
    click.echo(json.dumps(out, indent=2))


@workspaces.command("rm")
@_config_option
@_var_option
@click.argument("workspace")
def rm(config_file: str | None, var_dir: str | None, workspace: str) -> None:
    """Remove a named workspace (its data and record) or forget a host directory's record (the directory
    stays). Recorded in the audit chain first."""
    var = _var(config_file, var_dir)
    store = _store(var, workspace)
    try:
        store.lock()
    except WorkspaceError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        state = store.load() or {}
        if state.get("pending"):
            raise click.ClickException(
                f"the workspace {store.label} has a write waiting for approval "
                f"{state['pending'].get('approval_id')}; decide it first"
            )
        from egressgate.runtimes.diskfs import IMAGE, loops_of, mounted

        if mounted(store.data) is not None or loops_of(store.data / IMAGE):
            raise click.ClickException(f"the workspace {store.label} is mounted (a run uses it)")
        _record(var, store, state)
        shutil.rmtree(store.dir)  # a host directory's bookkeeping only: the directory itself stays
    finally:
        store.unlock()
    click.echo(f"removed workspace {store.label}")


def _record(var: Path, store: Store, state: dict[str, Any]) -> None:
    from egressgate.runtimes import endpoints
    from egressgate.runtimes.adminapi import AdminUnreachable, call

    try:
        info = endpoints.load(var)
        token = info.admin_token_file.read_text(encoding="utf-8").strip()
        status, data = call(
            info.endpoints.admin,
            "POST",
            "/v1/workspaces/records",
            token,
            {
                "action": "removed",
                "workspace": store.label,
                "decision": "allow",
                "attributes": {
                    k: v
                    for k, v in (
                        ("manifest_hash", state.get("manifest_hash")),
                        ("entries", len(state.get("entries") or {})),
                    )
                    if v is not None
                },
            },
        )
    except (endpoints.GatewayNotRunning, AdminUnreachable, OSError) as exc:
        raise click.ClickException(
            f"the removal cannot be recorded (the gateway is not reachable: {exc}); start it and retry"
        ) from None
    if status != 200:
        print(data, file=sys.stderr)
        raise click.ClickException(f"the removal was not recorded ({status}); nothing was removed")
