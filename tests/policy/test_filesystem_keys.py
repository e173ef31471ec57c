"""`filesystem.allow` entries no runtime can honour as written are refused at load (policy/filesystem.py):
no key accepted and silently ignored. The seed policy's entries (the workspace and /tmp, read-write) load."""

from __future__ import annotations

import textwrap

import pytest

from egressgate.policy.errors import PolicyError
from egressgate.policy.loader import parse_policy

HEAD = """
sandbox:
  name: t
  workspace: {path: /workspace}
filesystem:
  allow:
"""


def problems(entry: str) -> list[tuple[str, str]]:
    with pytest.raises(PolicyError) as info:
        parse_policy(textwrap.dedent(HEAD) + f"    - {entry}\n", "p.yaml")
    return info.value.problems


@pytest.mark.parametrize(("entry", "fragment"), [
    ("{path: data, read: true}", "absolute"),
    ("{path: /srv/../etc, read: true}", "normalized"),
    ("{path: /srv/data}", "read: true is required"),
    ("{path: /srv/data, write: true}", "read: true is required"),
    ("{path: /workspace, read: true}", "always read-write"),
    ("{path: /tmp, read: true}", "always read-write"),
    ("{path: /workspace/sub, read: true}", "inside the sandbox's own"),
    ("{path: /tmp/x, read: true, write: true}", "inside the sandbox's own"),
    ("{path: /, read: true}", "never given"),
    ("{path: /run/user, read: true}", "never given"),
    ("{path: /var/run, read: true}", "never given"),
    ("{path: /dev, read: true, write: true}", "never given"),
])
def test_unhonourable_allow_entries_are_refused(entry: str, fragment: str) -> None:
    found = problems(entry)
    assert any(path.startswith("filesystem.allow[0]") and fragment in msg for path, msg in found), found


@pytest.mark.parametrize("entry", ["{path: /srv/data, read: true}", "{path: /srv/data, read: true, write: true}",
                                   "{path: /workspace, read: true, write: true}",
                                   "{path: /tmp, read: true, write: true}"])
def test_honourable_entries_load(entry: str) -> None:
    policy = parse_policy(textwrap.dedent(HEAD) + f"    - {entry}\n", "p.yaml")
    assert len(policy.model.filesystem.allow) == 1
