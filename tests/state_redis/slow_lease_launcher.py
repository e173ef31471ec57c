"""The real `egressgate` CLI whose state store is slow to grant byte leases for some sandboxes.

`python tests/state_redis/slow_lease_launcher.py run --config ...` runs the unmodified gateway, except that
the in-memory store's `reserve_out` takes SLOW_SECONDS before it answers the *second* reservation of each
sandbox admitted with the label `slow=lease` — for a chunked upload, the first is the request head's
exact reservation and the second the body's first lease — what a Redis round trip near its timeout
looks like.
Other sandboxes are untouched (the positive control).
"""

from __future__ import annotations

import asyncio

from egressgate.cli import main
from egressgate.state.memory import MemoryState

SLOW_SECONDS = 2.0
_reserve_out = MemoryState.reserve_out
_calls: dict[str, int] = {}


async def _slow_reserve_out(self: MemoryState, sandbox_id: str, want: int, minimum: int, limit: int | None) -> int:
    record = await self.get(sandbox_id)
    if record is not None and record.labels.get("slow") == "lease":
        _calls[sandbox_id] = _calls.get(sandbox_id, 0) + 1
        if _calls[sandbox_id] == 2:
            await asyncio.sleep(SLOW_SECONDS)
    return await _reserve_out(self, sandbox_id, want, minimum, limit)


MemoryState.reserve_out = _slow_reserve_out  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
