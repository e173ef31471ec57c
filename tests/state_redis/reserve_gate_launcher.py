"""The real `egressgate` CLI with a gate that holds one request's store step (`reserve_request`) in flight.

`python tests/state_redis/reserve_gate_launcher.py GATE_DIR run --config ...` runs the unmodified gateway,
except that once GATE_DIR/arm exists, the next `reserve_request` (memory or Redis backend) consumes it,
writes GATE_DIR/arrived and waits for GATE_DIR/go before it runs the store's own step: what a Redis round
trip does on a loaded machine, forced. The ledger has already taken the request's share of this process's
pool when the step starts (ledger.ByteLedger.reserve_request), so the test can change that pool meanwhile
(another flow's top-up lands) and then let the store check run.

While a step is held, the ledger's sweep waits too (it would otherwise give an idle pool back to the store
one to two seconds later: a test that waits for the gate on a loaded machine would depend on that time).
Nothing else is changed; every wait is on a file the test writes, never on time.
Used by test_budget_refusal_record.py.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from egressgate.cli import main
from egressgate.gateway.shared.ledger import ByteLedger
from egressgate.state.memory import MemoryState
from egressgate.state.redis import RedisState

GATE_DIR = Path(sys.argv.pop(1)) if __name__ == "__main__" else Path(".")
_held = 0


def say(name: str, text: str) -> None:
    """Write GATE_DIR/<name> whole (tmp + rename): the test polls for the name and reads it at once."""
    tmp = GATE_DIR / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, GATE_DIR / name)


def _gated(original):
    async def reserve_request(self, sandbox_id: str, *args, **kwargs):
        global _held
        arm = GATE_DIR / "arm"
        if not arm.exists():
            return await original(self, sandbox_id, *args, **kwargs)
        arm.unlink()
        _held += 1
        try:
            say("arrived", sandbox_id)
            while not (GATE_DIR / "go").exists():
                await asyncio.sleep(0.01)
            return await original(self, sandbox_id, *args, **kwargs)
        finally:
            _held -= 1

    return reserve_request


_sweep = ByteLedger.sweep


def _sweep_unless_held(self: ByteLedger) -> None:
    if not _held:
        _sweep(self)


MemoryState.reserve_request = _gated(MemoryState.reserve_request)  # type: ignore[method-assign]
RedisState.reserve_request = _gated(RedisState.reserve_request)  # type: ignore[method-assign]
ByteLedger.sweep = _sweep_unless_held  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
