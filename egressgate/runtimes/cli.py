"""`egressgate sandbox run` and `egressgate sandbox gc` (registered on the `sandbox` group).

Imports only click and the stdlib at start-up (the runtime modules are stdlib-only): `sandbox run`'s
overhead over bare bubblewrap is a measured goal (loadtests/RESULTS.md), and loading the gateway's config
models alone costs more than the whole budget. The gateway's settings come from its runtime file. The
common invocation of `sandbox run` does not even get here (egressgate/cli.py, runtimes/fastargs.py):
this command is its definition, help and error messages.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from egressgate.admin.cli import parse_labels


@click.command("run", context_settings={"ignore_unknown_options": False})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="the gateway's config (for var_dir)")
@click.option("--var-dir", "var_dir", type=click.Path(file_okay=False), help="the running gateway's var dir")
@click.option("--policy", required=True, help="Policy name (sandbox.name)")
@click.option("--runtime", default="netns", show_default=True, help="netns | docker | gvisor | microvm")
@click.option("--image", help="container image (docker, gvisor); microvm: root image (ext4 file or directory)")
@click.option("--workspace", type=click.Path(file_okay=False),
              help="NAME of a workspace the runtime keeps in its var dir (`egressgate workspaces`), or a host "
                   "directory (a path with a '/': ./work); mounted read-write at sandbox.workspace.path, kept "
                   "across runs")
@click.option("--accept-changes", is_flag=True,
              help="restore a workspace changed outside a run anyway (persistence: verify_manifest_hash; audited)")
@click.option("--approval-ttl", type=click.IntRange(1, 86400),
              help="seconds a staged persistent write waits for approval before it is discarded (default 3600)")
@click.option("--label", "labels", multiple=True, help="k=v, repeatable")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run_cmd(config_file: str | None, var_dir: str | None, policy: str, runtime: str, image: str | None,
            workspace: str | None, accept_changes: bool, approval_ttl: int | None, labels: tuple[str, ...],
            command: tuple[str, ...]) -> None:
    """Run COMMAND in a new sandbox whose only way out is the gateway; exit with its status.

    Exit codes: the workload's status (128+N if signal N killed it); 120 setup failed; 121 memory,
    122 pids, 123 workspace bytes, 124 wall time limit (docs/runtimes.md)."""
    from egressgate.runtimes.entry import run_from_args

    parse_labels(labels)  # k=v, else a usage error
    sys.exit(run_from_args(config_file, var_dir, policy, runtime, image, workspace, labels, tuple(command),
                           accept_changes=accept_changes, approval_ttl=approval_ttl))


@click.command("gc")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="the gateway's config (for var_dir)")
@click.option("--var-dir", "var_dir", type=click.Path(file_okay=False), help="the gateway's var dir")
@click.option("--state-dir", "state_dir", type=click.Path(file_okay=False),
              help="runtime.state_dir (default: from the running gateway, else /run/egressgate)")
@click.option("--grace", default=60.0, show_default=True, type=click.FloatRange(min=0),
              help="seconds an unrecorded netns/cgroup must exist before it counts as an orphan")
def gc_cmd(config_file: str | None, var_dir: str | None, state_dir: str | None, grace: float) -> None:
    """Remove what runs killed with SIGKILL left behind (namespaces, veths, nft tables, cgroups,
    containers, run records) and revoke their sandboxes when the gateway is reachable."""
    from egressgate.runtimes.entry import var_dir_of
    from egressgate.runtimes.gc import collect
    from egressgate.runtimes.workload import SetupFailed

    try:
        directory = var_dir_of(config_file, var_dir)
    except SetupFailed as exc:
        raise click.ClickException(str(exc)) from None
    removed, problems = collect(directory, Path(state_dir) if state_dir else None, grace)
    for line in removed:
        click.echo(f"removed {line}")
    for line in problems:
        click.echo(f"egressgate: gc: {line}", err=True)
    sys.exit(1 if problems else 0)


def register(group: click.Group) -> None:
    group.add_command(run_cmd)
    group.add_command(gc_cmd)
