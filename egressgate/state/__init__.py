"""The state store: the sandbox registry and the counters budgets read (protocol in state/base.py)."""

from __future__ import annotations

import logging

from egressgate.state.base import StateStore, StateUnavailable
from egressgate.state.config import StateConfig

logger = logging.getLogger(__name__)


async def open_state(cfg: StateConfig) -> StateStore:
    """The one factory (gateway/service/app.py). A Redis that does not answer at start does not stop the gateway:
    requests are denied `state_unavailable` (and /readyz says so) until it does, then it recovers."""
    if cfg.backend == "memory":
        from egressgate.state.memory import MemoryState

        return MemoryState()
    from egressgate.state.redis import RedisState

    assert cfg.url is not None  # StateConfig refuses redis without a url
    store = RedisState(cfg.connection_url(), cfg.key_prefix, heartbeat_ttl=cfg.heartbeat_ttl_seconds)
    await store.start()
    try:
        await store.ping()
    except StateUnavailable as exc:
        logger.warning("state: Redis does not answer at start (%s); requests are denied until it does", exc)
    return store
