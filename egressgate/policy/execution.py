"""`execution.require_approval_for`: which actions need an operator's approval.

`network_expansion` is enforced by the gateway (a request outside the allowlist is refused with
`approval_required` and an approval an operator can grant: egressgate/approvals). `publish` is enforced by
the gateway too: a request recognised as publishing (policy/opclass.py: git push, npm publish, PyPI
uploads, OCI pushes, release uploads) waits for an approval of kind `publish` even when a network rule
allows it (policy/decide.py). `persistent_write` is recorded on the compiled policy and handed to runtime
adapters in the admission response (`runtime_policy.execution.require_approval_for`). A misspelt kind
must be a load error, never an approval silently not required.
"""

from __future__ import annotations

from egressgate.policy.model import Execution

APPROVAL_KINDS = ("network_expansion", "persistent_write", "publish")


def approval_kinds(execution: Execution, problems: list[tuple[str, str]]) -> frozenset[str]:
    seen: set[str] = set()
    for i, kind in enumerate(execution.require_approval_for):
        where = f"execution.require_approval_for[{i}]"
        if kind not in APPROVAL_KINDS:
            problems.append((where, f"unknown approval kind {kind!r}; known: {', '.join(APPROVAL_KINDS)}"))
        elif kind in seen:
            problems.append((where, f"{kind!r} is listed twice"))
        seen.add(kind)
    return frozenset(seen & set(APPROVAL_KINDS))
