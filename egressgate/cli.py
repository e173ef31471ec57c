"""`egressgate` console script entry point.

`egressgate sandbox run ... -- CMD` in its common, well-formed shape is run without importing click
(runtimes/fastargs.py): it starts every sandbox, its overhead over bare bubblewrap is a measured goal
(loadtests/RESULTS.md), and click alone costs ~40 ms. Everything else, including every malformed or
`--help` invocation of `sandbox run`, goes to the click group in egressgate/commands.py.
"""

from __future__ import annotations

import contextlib
import os
import sys


def _exit_now(code: int) -> None:
    """End `sandbox run` without interpreter finalization (module teardown, GC of every object: ~10 ms
    of the start-up budget, loadtests/RESULTS.md). Safe here because run.py has already done all its
    cleanup (teardown, revocation, run record) before returning and registers no atexit work; only the
    stdio buffers still need flushing."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed/broken pipe must not change the exit code
            stream.flush()
    os._exit(code)


def main() -> None:
    args = sys.argv[1:]
    if args[:2] == ["sandbox", "run"]:
        from egressgate.runtimes.fastargs import parse

        parsed = parse(args[2:])
        if parsed is not None:
            from egressgate.runtimes.entry import run_from_args

            _exit_now(run_from_args(**parsed))
    from egressgate.commands import cli

    cli()
