"""The gateway's system resolver: a short positive cache (getaddrinfo has no TTL), failures not cached."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from egressgate.gateway.resolver import ResolveError, SystemResolver


def test_cache_reuses_answers_briefly_and_never_caches_failures():
    now = [100.0]
    resolver = SystemResolver(timeout=2, clock=lambda: now[0])
    calls: list[str] = []
    answers = {"a.test": (ipaddress.ip_address("192.0.2.1"),)}

    async def lookup(host: str):
        calls.append(host)
        if host not in answers:
            raise ResolveError(f"no {host}")
        return answers[host]

    resolver._lookup = lookup  # the getaddrinfo call itself; loopback-only tests cannot vary it

    async def run():
        assert await resolver.resolve("a.test") == answers["a.test"]
        assert await resolver.resolve("a.test") == answers["a.test"]
        assert calls == ["a.test"]
        now[0] += SystemResolver.CACHE_SECONDS + 0.01
        answers["a.test"] = (ipaddress.ip_address("192.0.2.2"),)
        assert await resolver.resolve("a.test") == answers["a.test"]  # expired: asked again, new answer
        for _ in range(2):
            with pytest.raises(ResolveError):
                await resolver.resolve("missing.test")
        assert calls == ["a.test", "a.test", "missing.test", "missing.test"]

    asyncio.run(run())


def test_real_getaddrinfo_for_localhost():
    resolver = SystemResolver(timeout=5)
    addresses = asyncio.run(resolver.resolve("localhost"))
    assert ipaddress.ip_address("127.0.0.1") in addresses or ipaddress.ip_address("::1") in addresses
