"""`egressgate mcp run --policy NAME --server NAME -- CMD...`: a local stdio MCP server in a sandbox.

The gateway decides first (`POST /v1/mcp/local-start`): a policy with `execution.local_mcp_servers: deny`,
or a server name that is not a `local: true` entry of its `mcp.servers`, is refused before anything is
created or started — one sentence on stderr, exit 126, and the refusal is in the audit trail (written by
the gateway, never by this process). Otherwise this is `sandbox run` (a new admission, the netns runtime,
the same network policy, the same teardown and revocation) with the workload's stdio relayed through the
gateway's tool-call decisions (egressgate/mcp/local.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import click

from egressgate.admin.cli import parse_labels

EXIT_SETUP_FAILED = 120  # runtimes/base.py (not imported here: that module is the start-up path of sandbox run)


def _log(message: str) -> None:
    print(f"egressgate: {message}", file=sys.stderr, flush=True)


def run_local(config_file: str | None, var_dir: str | None, policy: str, server: str, runtime: str,
              workspace: Path | None, labels: dict[str, str], command: tuple[str, ...]) -> int:
    """The whole command; returns the exit status (see `run_cmd`)."""
    from egressgate.mcp.local import EXIT_MCP_REFUSED, McpRun
    from egressgate.runtimes import endpoints
    from egressgate.runtimes.adminapi import AdminUnreachable, call
    from egressgate.runtimes.entry import var_dir_of
    from egressgate.runtimes.run import RunRequest
    from egressgate.runtimes.workload import SetupFailed

    if runtime != "netns":
        _log(f"setup failed: egressgate mcp run supports --runtime netns only, not {runtime!r}")
        return EXIT_SETUP_FAILED
    try:
        directory = var_dir_of(config_file, var_dir)
        info = endpoints.load(directory)
        token = info.admin_token_file.read_text(encoding="utf-8").strip()
        status, data = call(info.endpoints.admin, "POST", "/v1/mcp/local-start", token,
                            {"policy": policy, "server": server, "labels": labels})
    except (SetupFailed, endpoints.GatewayNotRunning, AdminUnreachable) as exc:
        _log(f"setup failed: {exc}")
        return EXIT_SETUP_FAILED
    except OSError as exc:
        _log(f"setup failed: cannot read the admin token: {exc.strerror}")
        return EXIT_SETUP_FAILED
    if status == 403:
        _log(str(data.get("message") or "the gateway refused to start this local MCP server"))
        return EXIT_MCP_REFUSED
    limit = data.get("max_message_bytes")
    if status != 200 or type(limit) is not int or limit <= 0:
        _log(f"setup failed: the gateway answered {status} to the local MCP start: "
             f"{data.get('message') or data.get('error') or data}")
        return EXIT_SETUP_FAILED
    req = RunRequest(policy=policy, runtime=runtime, command=tuple(command), var_dir=directory,
                     workspace=workspace.absolute() if workspace else None, labels=labels)
    return McpRun(req, server, limit).execute()


@click.group("mcp")
def mcp() -> None:
    """MCP servers: local stdio servers run in a sandbox, their tool calls decided by the gateway."""


@mcp.command("run", context_settings={"ignore_unknown_options": False})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="the gateway's config (for var_dir)")
@click.option("--var-dir", "var_dir", type=click.Path(file_okay=False), help="the running gateway's var dir")
@click.option("--policy", required=True, help="Policy name (sandbox.name)")
@click.option("--server", required=True, help="the `local: true` entry of the policy's mcp.servers")
@click.option("--runtime", default="netns", show_default=True, help="netns (the only one with stdio relaying)")
@click.option("--workspace", type=click.Path(file_okay=False, path_type=Path),
              help="host directory mounted read-write at the policy's sandbox.workspace.path (kept across runs)")
@click.option("--label", "labels", multiple=True, help="k=v, repeatable")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run_cmd(config_file: str | None, var_dir: str | None, policy: str, server: str, runtime: str,
            workspace: Path | None, labels: tuple[str, ...], command: tuple[str, ...]) -> None:
    """Run the stdio MCP server COMMAND in a new sandbox; relay its stdio through the gateway.

    Give this command line to an MCP client as the server to spawn. Exit codes: the server's status
    (128+N if signal N killed it, e.g. on revocation); 120 setup failed; 126 the policy refuses this
    local MCP server; 121-124 resource limits (docs/runtimes.md)."""
    code = run_local(config_file, var_dir, policy, server, runtime, workspace, parse_labels(labels),
                     tuple(command))
    # no interpreter finalization: a relay thread may still be blocked reading the client's stdin, and
    # finalizing with it would abort ("could not acquire lock for stdin"); every cleanup is done already
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
