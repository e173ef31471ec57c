"""The real `egressgate` CLI for test_round_trips.py, with two test-only changes that touch no decision.

`python roundtrip_launcher.py PAUSE_DIR run --config ...`:

- Only request-driven traffic reaches Redis during a test: the ledger's sweep and the reconcile rounds
  (time-driven: at most one write a second each, whatever the request rate; gateway/service/reconcile.py) run
  once an hour instead of every second, so the commands a test sees are the ones its requests cost.
  Settles and bytes in still go out with the requests' own writes (gateway/shared/ledger.py).
- A pause between a request's two round trips: for a sandbox admitted with the label `pause=1`,
  `RedisState.reserve_request` (the second round trip, after the snapshot decide() read) first writes
  PAUSE_DIR/paused-<sandbox id> and waits until PAUSE_DIR/go-<sandbox id> exists; then it runs the
  real script. The label is read from the record cache only (never a Redis call of its own).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from egressgate.cli import main
from egressgate.gateway.service import reconcile
from egressgate.state.redis import RedisState

PAUSE_DIR = Path(sys.argv.pop(1))
reconcile.run.__defaults__ = (3600.0, 3600.0)  # (sweep_interval, reconcile_interval)
_reserve_request = RedisState.reserve_request


async def _paused_reserve_request(self: RedisState, sandbox_id: str, *args, **kwargs):
    record = self._cache.record(sandbox_id)
    if record is not None and record.labels.get("pause") == "1":
        (PAUSE_DIR / f"paused-{sandbox_id}").write_text("")
        while not (PAUSE_DIR / f"go-{sandbox_id}").exists():
            await asyncio.sleep(0.02)
    return await _reserve_request(self, sandbox_id, *args, **kwargs)


RedisState.reserve_request = _paused_reserve_request  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
