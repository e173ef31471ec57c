"""The `persistence` section (the seed article's "preserve state without preserving authority"): what of a
persistent workspace survives a run and what a restore checks. Enforced by `sandbox run`
(runtimes/persist.py); the gateway only records it.

    persistence:
      save: [/workspace/src, /workspace/tests, /workspace/results, /workspace/manifest.json]
      discard: [/tmp, /run, /workspace/.credentials, process_state, shell_history]
      restore_checks: [verify_manifest_hash, rescan_dependencies, reapply_current_policy,
                       reissue_short_lived_credentials]

Why the load-time checks below: every entry must mean something a runtime does. A `save` path outside the
workspace could never be kept (only the workspace survives a run), so it is refused rather than silently
not saved; `process_state` and `shell_history` are never carried over whatever the policy says, so they may
only appear under `discard`; a `save` path inside a `discard` path would be void. A `discard` path outside
the workspace (/tmp, /run) is accepted: nothing outside the workspace survives a run, so it is discarded by
construction. `persistence` without a persistent workspace would be a section nothing reads: refused.
"""

from __future__ import annotations

import posixpath
from typing import Literal

from pydantic import BaseModel, ConfigDict

KEYWORDS = ("process_state", "shell_history")  # never carried over (runtimes/persist.py)
RESTORE_CHECKS = (
    "verify_manifest_hash",
    "rescan_dependencies",
    "reapply_current_policy",
    "reissue_short_lived_credentials",
)


class Persistence(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    save: list[str] | None = None  # None: the whole workspace (minus `discard`)
    discard: list[str] = []
    restore_checks: list[
        Literal[
            "verify_manifest_hash", "rescan_dependencies", "reapply_current_policy", "reissue_short_lived_credentials"
        ]
    ] = []


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _normal(path: str) -> bool:
    return path.startswith("/") and "//" not in path and posixpath.normpath(path) == (path.rstrip("/") or "/")


def persistence_problems(
    section: Persistence | None, workspace_path: str | None, persistent: bool
) -> list[tuple[str, str]]:
    """(key path, message) for every entry no runtime could honour as written."""
    if section is None:
        return []
    problems: list[tuple[str, str]] = []
    if workspace_path is None or not persistent:
        problems.append(
            (
                "persistence",
                "the sandbox has no persistent workspace (sandbox.workspace with "
                "persistent: true): nothing would be saved or restored",
            )
        )
        return problems
    ws = posixpath.normpath(workspace_path)
    saves: list[str] = []
    for i, path in enumerate(section.save or []):
        key = f"persistence.save[{i}]"
        if path in KEYWORDS:
            problems.append((key, f"{path} is never carried over; list it under persistence.discard"))
        elif not _normal(path):
            problems.append((key, f"{path!r}: an absolute, normalized path (no '.', '..' or '//')"))
        elif not _under(path, ws):
            problems.append((key, f"{path} is outside the workspace {ws}: only the workspace survives a run"))
        elif path in saves:
            problems.append((key, f"{path} is listed twice"))
        else:
            saves.append(path)
    discards: list[str] = []
    for i, path in enumerate(section.discard):
        key = f"persistence.discard[{i}]"
        if path in KEYWORDS:
            continue
        if not _normal(path):
            problems.append((key, f"{path!r}: an absolute, normalized path, or one of {', '.join(KEYWORDS)}"))
            continue
        if path == ws:
            problems.append((key, f"{path} is the whole workspace: drop persistent: true instead"))
        for saved in saves:
            if _under(saved, path):
                problems.append((key, f"{path} would discard the saved path {saved}"))
        discards.append(path)
    seen: set[str] = set()
    for i, check in enumerate(section.restore_checks):
        if check in seen:
            problems.append((f"persistence.restore_checks[{i}]", f"{check!r} is listed twice"))
        seen.add(check)
    return problems
