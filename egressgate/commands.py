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


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="egressgate")
def cli() -> None:
    """Network chokepoint for AI-agent sandboxes: egress gateway, DNS resolver, credential broker, audit."""
