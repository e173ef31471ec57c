"""Every repository file the README's commands and links name exists (`policies/tickets.yaml` did not: its
learn and MCP examples failed on a fresh clone). Paths under var/ and files the examples write themselves
(`-o learned.yaml`) are not repository files; everything under the repository's own top-level folders is."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("policies", "docs", "scripts", "deploy", "loadtests", "egressgate", "tests", ".ci")
PATH = re.compile(r"(?<![\w/.$-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*\w)")


def _referenced(text: str) -> set[str]:
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)  # commands and config examples
    links = re.findall(r"\]\(([^)#\s]+)", text)  # markdown links to repository files
    inline = re.findall(r"`([^`\n]+)`", text)  # `policies/x.yaml` in prose
    found = set()
    for chunk in [*blocks, *inline, *links]:
        found.update(PATH.findall(chunk))
    return found


def test_readme_names_only_files_that_exist() -> None:
    refs = _referenced((ROOT / "README.md").read_text())
    assert "policies/tickets.yaml" in refs  # the check sees the examples at all
    missing = sorted(r for r in refs if not (ROOT / r).exists() and not any(ch in r for ch in "*…"))
    assert not missing, missing


def test_the_check_catches_a_missing_file() -> None:
    """Negative control: a made-up path in a command block is reported."""
    refs = _referenced("```sh\negressgate policy check policies/no-such.yaml\n```\n")
    assert refs == {"policies/no-such.yaml"} and not (ROOT / "policies/no-such.yaml").exists()
