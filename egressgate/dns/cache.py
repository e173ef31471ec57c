"""TTL cache of upstream answers, keyed by (canonical name, qtype).

What is cached is the upstream answer *before* filtering, because the filter depends on the asking sandbox's
`allow_private`; the filtered view is memoised per `allow_private` value inside the entry so a hot name costs
one dict lookup. Lifetimes: positive answers live for the smallest record TTL clamped to [min_ttl, max_ttl];
negative answers (NXDOMAIN, NODATA) for the SOA's negative TTL (min of its TTL and MINIMUM field, RFC 2308) or
the configured negative TTL when there is no SOA, clamped the same way. Failures (SERVFAIL, timeouts) are
never cached: a transient upstream problem must not pin a denial. Bounded size, least recently used evicted
first.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from egressgate.dns.upstream import UpstreamAnswer
from egressgate.dns.wire import NXDOMAIN

T_SOA = 6


@dataclass(slots=True)
class CacheEntry:
    answer: UpstreamAnswer
    expires: float
    filtered: dict[Any, Any] = field(default_factory=dict)  # allow_private -> filter result
    packed: dict[Any, tuple[int, bytes]] = field(default_factory=dict)  # see Resolver._pack

    def remaining(self, now: float) -> int:
        """Whole seconds left, at least 1 while the entry is alive (a TTL of 0 would disable client caching
        in a way that multiplies queries for no security gain)."""
        return max(1, math.ceil(self.expires - now))


def answer_ttl(answer: UpstreamAnswer, min_ttl: int, max_ttl: int, negative_ttl: int) -> int:
    if answer.rcode != NXDOMAIN and answer.answers:
        ttl = min(rr.ttl for rr in answer.answers)
    else:
        soas = [rr for rr in answer.authority if rr.rtype == T_SOA]
        if soas:
            soa = soas[0]
            ttl = min(soa.ttl, getattr(soa.rdata, "times", (negative_ttl,) * 5)[-1])
        else:
            ttl = negative_ttl
    return max(min_ttl, min(max_ttl, ttl))


class AnswerCache:
    def __init__(self, size: int, min_ttl: int, max_ttl: int, negative_ttl: int) -> None:
        self.size = size
        self.min_ttl = min_ttl
        self.max_ttl = max_ttl
        self.negative_ttl = negative_ttl
        self._entries: OrderedDict[tuple[str, int], CacheEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, int], now: float) -> CacheEntry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires <= now:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple[str, int], answer: UpstreamAnswer, now: float) -> CacheEntry:
        ttl = answer_ttl(answer, self.min_ttl, self.max_ttl, self.negative_ttl)
        entry = CacheEntry(answer, now + ttl)
        if self.size <= 0 or ttl <= 0:
            return entry  # caching disabled: the entry still serves this one query
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return entry

    def clear(self) -> None:
        self._entries.clear()
