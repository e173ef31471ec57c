"""The click-free parser of `sandbox run` (runtimes/fastargs.py) agrees with the click command on
every invocation it accepts, and hands everything else to click (None)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from egressgate.runtimes import cli as runtime_cli
from egressgate.runtimes.fastargs import parse

ACCEPTED = [
    ["--policy", "p", "--", "true"],
    ["--policy=p", "--runtime", "docker", "--image", "img:1", "--", "sh", "-c", "echo --policy"],
    ["--config", "g.yaml", "--var-dir", "v", "--workspace", "/tmp/egN-ws", "--label", "a=b", "--label",
     "c=d=e", "--policy", "p", "--", "python3", "--", "-x"],
]
REFUSED = [
    ["--policy", "p", "true"],  # no `--`: click decides where the command starts
    ["--policy", "p", "--"],  # no command
    ["--help", "--", "true"],
    ["--policy", "p", "--verbose", "--", "true"],  # unknown option
    ["--policy", "p", "--label", "novalue", "--", "true"],  # click's BadParameter says why
    ["--policy", "p", "--policy", "q", "--", "true"],
    ["--runtime", "netns", "--", "true"],  # --policy is required
    ["--policy", "p", "--workspace", "/etc/hostname", "--", "true"],  # a file: click refuses it
    ["--policy", "--", "true"],  # the option's value would be `--`
]


def click_kwargs(args: list[str]) -> dict:
    ctx = runtime_cli.run_cmd.make_context("run", list(args))
    return dict(ctx.params)


@pytest.mark.parametrize("args", ACCEPTED, ids=range(len(ACCEPTED)))
def test_same_result_as_click(args: list[str]) -> None:
    fast = parse(args)
    assert fast is not None
    slow = click_kwargs(args)
    assert fast == slow


@pytest.mark.parametrize("args", REFUSED, ids=range(len(REFUSED)))
def test_anything_else_goes_to_click(args: list[str]) -> None:
    assert parse(args) is None


def test_the_fast_path_does_not_import_click(tmp_path: Path) -> None:
    """The start-up saving is real: a well-formed `sandbox run` never loads click (nor pydantic,
    mitmproxy or the audit stack; nor dataclasses, which pulls in inspect and ast: ~20 ms, see
    runtimes/base.py). The fast path ends with os._exit: it is intercepted here to look at
    sys.modules at that moment."""
    code = ("import os, sys; sys.argv = ['egressgate', 'sandbox', 'run', '--var-dir', sys.argv[1], '--policy', 'p', "
            "'--', 'true']\nfrom egressgate.cli import main\n"
            "def report(code):\n    print(code, sorted(m for m in sys.modules if m.split('.')[0] in "
            "('click', 'pydantic', 'mitmproxy', 'yaml', 'dataclasses', 'inspect') "
            "or m.startswith('egressgate.audit')), flush=True)\n"
            "    os.abort()\n"
            "os._exit = report\nmain()")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False,
                         timeout=60)
    assert res.stdout.strip() == "120 []", res.stdout + res.stderr  # 120: no gateway runs in tmp_path


def test_the_fast_path_exit_keeps_code_and_messages(tmp_path: Path) -> None:
    """os._exit skips interpreter finalization (start-up budget) but not the exit code nor the buffered
    stderr/stdout lines: a pipe makes stderr block-buffered-like, so an unflushed message would be lost."""
    code = ("import sys; sys.argv = ['egressgate', 'sandbox', 'run', '--var-dir', sys.argv[1], '--policy', 'p', "
            "'--', 'true']\nprint('buffered stdout line', end='')\nfrom egressgate.cli import main\nmain()")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as for an operator
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False,
                         timeout=60, env=env)
    assert res.returncode == 120, res.stderr
    assert "gateway.json does not exist" in res.stderr
    assert res.stdout == "buffered stdout line"


def test_click_still_parses_what_the_fast_path_refuses() -> None:
    with pytest.raises(click.exceptions.BadParameter):
        click_kwargs(["--policy", "p", "--workspace", "/etc/hostname", "--", "true"])
