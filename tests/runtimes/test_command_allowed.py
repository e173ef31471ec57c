"""`execution.commands`: exact basenames, plus version suffixes of an allowed name (python → python3.12)."""

import pytest

from egressgate.runtimes.workload import SetupFailed, check_command, command_allowed

ALLOWED = ["python", "node", "git"]


@pytest.mark.parametrize("name", ["python", "python3", "python3.12", "node", "git", "node20"])
def test_allowed_names(name: str) -> None:
    assert command_allowed(name, ALLOWED)


@pytest.mark.parametrize("name", ["sh", "python3-config", "pythonw", "python3.", "python3..1", "python.3", "gitk",
                                  "xpython", "py", "", "python3 ", "python3\x00"])
def test_stretched_names_refused(name: str) -> None:
    assert not command_allowed(name, ALLOWED)


def test_check_command_uses_the_basename_and_names_the_refusal() -> None:
    check_command(("/usr/bin/python3.11", "-c", "1"), {"commands": ALLOWED})
    check_command(("anything",), {"commands": []})  # an empty list allows every command
    with pytest.raises(SetupFailed, match=r"'bash' is not one of them"):
        check_command(("/bin/bash",), {"commands": ALLOWED})
    with pytest.raises(SetupFailed):
        check_command(("/opt/python/bin/python3-config",), {"commands": ALLOWED})
