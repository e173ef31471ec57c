"""`egressgate` command line. Each component contributes its own click group."""

from __future__ import annotations

import click

from egressgate.admin.cli import sandbox
from egressgate.audit.cli import audit
from egressgate.gateway.cli import ca_group, run_cmd
from egressgate.policy.cli import policy
from egressgate.runtimes.render.cli import runtime


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="egressgate")
def main() -> None:
    """Network chokepoint for AI-agent sandboxes: egress gateway, DNS resolver, credential broker, audit."""


main.add_command(policy)
main.add_command(audit)
main.add_command(run_cmd)
main.add_command(sandbox)
main.add_command(ca_group)
main.add_command(runtime)
