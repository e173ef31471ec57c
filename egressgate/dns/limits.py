"""Per-sandbox query rate (token bucket), kept in process.

Why in process and not in the state store: the rate is a flood guard for this resolver instance (a second
replica has its own buckets, so the effective limit is per replica), and a store round trip per query would
cost more than the query. Query-count and name-byte budgets, which bound total exfiltration, are in the state
store. The table is bounded: the least recently used buckets are dropped (a dropped bucket restarts full,
which only ever errs by one burst).
"""

from __future__ import annotations

from collections import OrderedDict


class RateLimiter:
    def __init__(self, max_keys: int = 65536) -> None:
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # key -> [tokens, last refill]

    def allow(self, key: str, rate: float, now: float) -> bool:
        """Take one token from `key`'s bucket (capacity: one second's worth, at least 1). False when empty."""
        capacity = max(1.0, rate)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = [capacity, now]
            self._buckets[key] = bucket
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            bucket[0] = min(capacity, bucket[0] + (now - bucket[1]) * rate)
            bucket[1] = now
        if bucket[0] >= 1.0:
            bucket[0] -= 1.0
            return True
        return False
