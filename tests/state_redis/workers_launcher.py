"""`egressgate run ... --workers N` (N from $EGRESSGATE_TEST_WORKERS, default 2): the unmodified CLI, for
the shared launcher (tests/support/launcher.py), which builds `run --config CFG --log-level DEBUG` itself."""

from __future__ import annotations

import os
import sys

from egressgate.cli import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        sys.argv.extend(["--workers", os.environ.get("EGRESSGATE_TEST_WORKERS", "2")])
    main()
