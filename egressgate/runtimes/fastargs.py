"""The command line of `egressgate sandbox run` parsed without click, for the common well-formed
invocation only (`... sandbox run [--opt VALUE]... -- CMD...`).

Importing click costs ~40 ms, a third of `sandbox run`'s start-up budget (loadtests/RESULTS.md). This
parser accepts exactly the options of runtimes/cli.py's `run` command and returns None for anything else
(`--help`, an unknown or malformed option, no `--`, a bad --label or --workspace): the caller then runs
the click command, which stays the one definition of the interface, its help and its error messages.
"""

from __future__ import annotations

from pathlib import Path

VALUED = {"--config", "--var-dir", "--policy", "--runtime", "--image", "--workspace", "--label"}


def parse(args: list[str]) -> dict | None:
    """`args` after `sandbox run`; the keyword arguments of runtimes/cli.py's run_cmd, or None."""
    if "--" not in args:
        return None
    split = args.index("--")
    options, command = args[:split], args[split + 1:]
    if not command:
        return None
    values: dict[str, str] = {}
    labels: list[str] = []
    i = 0
    while i < len(options):
        name, eq, value = options[i].partition("=")
        if name not in VALUED:
            return None
        if not eq:
            if i + 1 >= len(options):
                return None
            value = options[i + 1]
            i += 1
        i += 1
        if name == "--label":
            key, sep, _ = value.partition("=")
            if not sep or not key:
                return None
            labels.append(value)
        elif name in values:  # click: the last one wins; rare enough to leave to click
            return None
        else:
            values[name] = value
    if "--policy" not in values:
        return None
    workspace = values.get("--workspace")
    if workspace is not None and Path(workspace).exists() and not Path(workspace).is_dir():
        return None
    return {"config_file": values.get("--config"), "var_dir": values.get("--var-dir"),
            "policy": values["--policy"], "runtime": values.get("--runtime", "netns"),
            "image": values.get("--image"), "workspace": workspace,
            "labels": tuple(labels), "command": tuple(command), "accept_changes": False, "approval_ttl": None}
