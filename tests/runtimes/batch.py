"""Several programs in one sandbox or container run: one `sh -c` runs them one after another, each framed on
stdout and on stderr by marker lines that carry its exit status, and `split` reads each program's part back.
A container start (dockerd, runc, a gVisor boot) or a `sandbox run` costs more CPU than most probes it runs, so
tests that only read what their probes printed share one run (module fixtures) and still judge each program on
its own output and exit status."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

MARK = "@@egN-batch"


def batch(programs: dict[str, list[str]], bound: int | None = None) -> list[str]:
    """The argv of one `sh -c` running `programs` (name → argv) in order; `bound`: each under
    `timeout -s KILL bound` (a program that hangs is ended; its part then has that exit status)."""
    steps = []
    for name, argv in programs.items():
        assert name.isidentifier(), name
        words = ["timeout", "-s", "KILL", str(bound), *argv] if bound else argv
        command = " ".join(shlex.quote(a) for a in words)
        steps.append(f"echo {MARK} begin {name}; echo {MARK} begin {name} >&2; {command}; rc=$?; "
                     f"echo {MARK} end {name} $rc; echo {MARK} end {name} $rc >&2")
    return ["sh", "-c", "; ".join(steps) + "; exit 0"]


@dataclass
class Ran:
    """One program's part of a batch: its exit status (None: its end marker never came), stdout, stderr."""

    returncode: int | None
    stdout: str
    stderr: str

    def json(self) -> object:
        """The last stdout line as JSON (the probes print one object or list last)."""
        assert self.stdout.strip(), (self.returncode, self.stderr)
        return json.loads(self.stdout.strip().splitlines()[-1])


def _sections(text: str) -> dict[str, tuple[int | None, str]]:
    found: dict[str, tuple[int | None, str]] = {}
    current, body = None, []
    for line in text.splitlines():
        words = line.split()
        if words[:2] == [MARK, "begin"] and len(words) == 3:
            current, body = words[2], []
        elif words[:2] == [MARK, "end"] and len(words) == 4 and current == words[2]:
            found[current] = (int(words[3]), "\n".join(body))
            current = None
        elif current is not None:
            body.append(line)
    if current is not None:
        found[current] = (None, "\n".join(body))
    return found


def split(names: list[str] | tuple[str, ...], stdout: str, stderr: str) -> dict[str, Ran]:
    """A batch's output, per program name (a program that never started: returncode None, no output)."""
    out, err = _sections(stdout), _sections(stderr)
    return {name: Ran(out.get(name, (None, ""))[0], out.get(name, (None, ""))[1], err.get(name, (None, ""))[1])
            for name in names}
