"""The `egressgate` click group. Each component contributes its own click group.

Groups are imported when invoked, not at start-up: `egressgate sandbox run` is on the path of every
sandbox start (its overhead is measured, loadtests/RESULTS.md), and importing every group up front loads
mitmproxy, pydantic and the audit stack for nothing. The console script enters through egressgate/cli.py.
"""

from __future__ import annotations

import importlib
import importlib.util

import click

# name -> "module:attribute" of the click command or group
COMMANDS = {
    "policy": "egressgate.policy.cli:policy",
    "audit": "egressgate.audit.cli:audit",
    "run": "egressgate.gateway.service.cli:run_cmd",
    "sandbox": "egressgate.admin.cli:sandbox",
    "approvals": "egressgate.approvals.cli:approvals",
    "workspaces": "egressgate.runtimes.workspaces_cli:workspaces",  # persistent workspaces (runtimes/workspaces.py)
    "mcp": "egressgate.mcp.cli:mcp",  # `mcp run`: local stdio MCP servers (egressgate/mcp/local.py)
    "ca": "egressgate.gateway.service.cli:ca_group",
    "runtime": "egressgate.runtimes.render.cli:runtime",  # `runtime render` (branch h10-render)
}


# name -> the command's own help (its first paragraph is all `egressgate --help` shows), so the top-level
# help lists the commands without importing them: loading every group for its one-line summary took ~0.5 s
# (the gateway's config and DNS stack among them). tests/test_cli_help.py checks each against the command.
SUMMARIES = {
    "policy": "Check, explain and test policies.",
    "audit": "Verify, search and replay the audit trail.",
    "run": "Start the gateway (proxy + admin API). Prints one JSON line with the bound addresses.",
    "sandbox": "Admit, run and revoke sandboxes on the running gateway.",
    "approvals": "List, approve and deny sandbox requests outside their allowlist (execution.require_approval_for).",
    "workspaces": "Persistent workspaces kept by the runtime (`sandbox run --workspace NAME`).",
    "mcp": "MCP servers: local stdio servers run in a sandbox, their tool calls decided by the gateway.",
    "ca": "The gateway CA that signs intercepted TLS (private key stays in ca_dir).",
    "runtime": "Deployment files for Kubernetes, compose and Firecracker; admission for a containerised agent.",
}


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def _load(name: str) -> click.Command | None:
    module, _, attr = COMMANDS[name].partition(":")
    try:
        command = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name):  # a missing dependency, not a missing group
            raise
        return None
    if name == "sandbox":
        from egressgate.runtimes.cli import register

        register(command)
    if name == "runtime":  # `runtime image build`: the microvm runtime's artifacts
        from egressgate.runtimes.microvm.cli import register as register_image

        register_image(command)
    return command


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if _exists(COMMANDS[name].partition(":")[0]))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return _load(cmd_name) if cmd_name in COMMANDS else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's listing, from SUMMARIES instead of the loaded commands (same shortening, same layout)."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = [(name, click.Command(name, help=SUMMARIES[name]).get_short_help_str(limit)) for name in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="egressgate")
def cli() -> None:
    """Network chokepoint for AI-agent sandboxes: egress gateway, DNS resolver, credential broker, audit."""
