"""The real `egressgate` CLI with the memory-backend refusal of `run --workers N` lifted, for the supervisor's
own tests (signals, restarts, shared listeners, per-worker audit files) without a Redis server.

Several workers on the memory backend do not share sandboxes or budgets, which is exactly why `run` refuses
them (gateway/service/workers.py: check_workers; tests/gateway/test_supervisor.py shows the refusal with the
unmodified CLI). These tests use no sandbox, so what they check does not depend on shared state; the
tests with shared state run on Redis (tests/state_redis/test_workers.py).
"""

from __future__ import annotations

from egressgate.cli import main
from egressgate.gateway.service import workers


def _no_refusal(cfg, n: int) -> None:
    return None


workers.check_workers = _no_refusal  # type: ignore[assignment]

if __name__ == "__main__":
    main()
