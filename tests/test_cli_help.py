"""`egressgate --help` lists the commands from egressgate/commands.py's SUMMARIES without importing them
(loading every group for its one-line summary took ~0.5 s). The listing must stay what click prints from the
loaded commands themselves: a summary that drifts from its command's docstring fails here."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

from egressgate.commands import COMMANDS, SUMMARIES, _load, cli

LIMITS = (20, 30, 45, 60, 80, 200)


def listing(ctx: click.Context, width: int, *, loaded: bool) -> str:
    """The "Commands" section as `egressgate --help` prints it: from SUMMARIES, or (`loaded`) the way
    click's own Group.format_commands builds it from every loaded command."""
    formatter = click.HelpFormatter(width=width)
    if loaded:
        click.Group.format_commands(cli, ctx, formatter)
    else:
        cli.format_commands(ctx, formatter)
    return formatter.getvalue()


def test_every_command_has_a_summary() -> None:
    assert set(SUMMARIES) == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_summary_is_the_commands_own_help(name: str) -> None:
    command = _load(name)
    assert command is not None and not command.hidden
    for limit in LIMITS:
        assert click.Command(name, help=SUMMARIES[name]).get_short_help_str(limit) == command.get_short_help_str(
            limit
        ), (name, limit)


@pytest.mark.parametrize("width", [60, 80, 120])
def test_the_listing_is_what_click_prints_from_the_loaded_commands(width: int) -> None:
    with click.Context(cli, info_name="egressgate") as ctx:
        lazy, full = listing(ctx, width, loaded=False), listing(ctx, width, loaded=True)
    assert lazy == full
    assert all(f"  {name} " in lazy for name in COMMANDS)


def test_positive_control_a_stale_summary_changes_the_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SUMMARIES, "policy", "Check policies.")
    with click.Context(cli, info_name="egressgate") as ctx:
        assert listing(ctx, 80, loaded=False) != listing(ctx, 80, loaded=True)


PROBE = """
import json, sys
from egressgate.commands import COMMANDS, cli
try:
    cli(sys.argv[1:], prog_name="egressgate")
except SystemExit:
    pass
mods = sorted({spec.partition(":")[0] for spec in COMMANDS.values()})
print(json.dumps([m for m in mods if m in sys.modules]))
"""


def loaded_command_modules(*args: str) -> list[str]:
    res = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_top_level_help_imports_no_command() -> None:
    assert loaded_command_modules("--help") == []


def test_positive_control_a_commands_help_imports_that_command() -> None:
    assert loaded_command_modules("policy", "--help") == ["egressgate.policy.cli"]
