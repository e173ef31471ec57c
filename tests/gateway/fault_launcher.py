"""The real `egressgate` CLI with one real bug planted in a component, for fail-closed tests.

`python tests/gateway/fault_launcher.py run --config ...` runs the unmodified gateway (real mitmproxy, real
sockets, real audit file), except that the in-memory state store's `snapshot` raises an unexpected
exception for sandboxes admitted with the label `fault=snapshot`: the kind of bug (not a StateUnavailable
the addons expect) that failclosed.py must turn into a 500 `internal_error` deny - with a request id that
leads to an audit record. Sandboxes without the label are untouched (the positive control).
"""

from __future__ import annotations

from egressgate.cli import main
from egressgate.state.memory import MemoryState

_snapshot = MemoryState.snapshot


async def _faulty_snapshot(self: MemoryState, sandbox_id: str, **hints):
    record = await self.get(sandbox_id)
    if record is not None and record.labels.get("fault") == "snapshot":
        raise RuntimeError("planted bug: the state store failed in an unexpected way")
    return await _snapshot(self, sandbox_id, **hints)


MemoryState.snapshot = _faulty_snapshot  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
