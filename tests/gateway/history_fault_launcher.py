"""The real `egressgate` CLI whose state store cannot write request history for some sandboxes.

`python tests/gateway/history_fault_launcher.py run --config ...` runs the unmodified gateway, except that
the in-memory state store's `record_request` raises StateUnavailable (what a Redis outage raises) for
sandboxes admitted with the label `fault=history`. Sandboxes without the label are untouched (the
positive control). Used by test_passthrough_faults.py: a relayed tunnel whose history cannot be written
must be refused, not relayed unrecorded.
"""

from __future__ import annotations

from egressgate.cli import main
from egressgate.state.base import StateUnavailable
from egressgate.state.memory import MemoryState

_record_request = MemoryState.record_request


async def _faulty_record_request(self: MemoryState, sandbox_id: str, host: str, rule_id, nbytes: int,
                                 **budget) -> bool:
    record = await self.get(sandbox_id)
    if record is not None and record.labels.get("fault") == "history":
        raise StateUnavailable("planted outage: request history cannot be written")
    return await _record_request(self, sandbox_id, host, rule_id, nbytes, **budget)


MemoryState.record_request = _faulty_record_request  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
