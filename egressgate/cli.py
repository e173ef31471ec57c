"""`egressgate` console script entry point.

`egressgate sandbox run ... -- CMD` in its common, well-formed shape is run without importing click
(runtimes/fastargs.py): it starts every sandbox, its overhead over bare bubblewrap is a measured goal
(loadtests/RESULTS.md), and click alone costs ~40 ms. Everything else, including every malformed or
`--help` invocation of `sandbox run`, goes to the click group in egressgate/commands.py.
"""

from __future__ import annotations

import sys


def main() -> None:
    args = sys.argv[1:]
    if args[:2] == ["sandbox", "run"]:
        from egressgate.runtimes.fastargs import parse

        parsed = parse(args[2:])
        if parsed is not None:
            from egressgate.runtimes.run import run_from_args

            sys.exit(run_from_args(**parsed))
    from egressgate.commands import cli

    cli()
