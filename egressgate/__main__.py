"""`python -m egressgate` = the `egressgate` command."""

from egressgate.cli import main

main()
