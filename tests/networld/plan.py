"""The world's address plan: who lives where, which canary guards which forbidden address, what the
test resolver answers by default. Every address exists only inside the world's namespaces
(198.18.0.0/15 and 2001:2::/48 for the world itself; the forbidden ones as canaries)."""

from __future__ import annotations

from typing import Any

GW_NET, NET_GW = "198.18.0.1", "198.18.0.2"
GW_SBX, SBX = "198.18.3.1", "198.18.3.2"
GW_OPEN, OPEN = "198.18.4.1", "198.18.4.2"
DNS_ADDR = "198.18.0.53"
UPSTREAM = "198.18.1.10"
FORBIDDEN_UPSTREAM = "198.18.1.20"
V6 = {"gw_net": "2001:2:0:1::1", "net_gw": "2001:2:0:1::2", "gw_sbx": "2001:2:0:3::1", "sbx": "2001:2:0:3::2"}
V6.update({"gw_open": "2001:2:0:4::1", "open": "2001:2:0:4::2"})

# canary name -> (address, port, tls). Every one of these is forbidden to a sandbox.
NET_CANARIES: dict[str, tuple[str, int, bool]] = {
    "metadata": ("169.254.169.254", 80, False),
    "metadata-tls": ("169.254.169.254", 443, True),
    "private": ("10.0.0.5", 80, False),
    "private-tls": ("10.0.0.5", 443, True),
    "cgnat": ("100.100.100.200", 80, False),
    "wireserver": ("168.63.129.16", 80, False),
    "metadata-v6": ("fd00:ec2::254", 80, False),
    "nat64": ("64:ff9b::a9fe:a9fe", 80, False),
    "6to4": ("2002:a9fe:a9fe::1", 80, False),
    "teredo": ("2001:0:4136:e378:8000:63bf:5601:5601", 80, False),  # client 169.254.169.254 (xor'd)
    "v4compat": ("::a9fe:a9fe", 80, False),  # deprecated IPv4-compatible ::169.254.169.254
}
GW_SELF_CANARY_PORT = 81
GW_CANARIES: dict[str, tuple[str, int, bool]] = {
    "gateway-self": (GW_SBX, GW_SELF_CANARY_PORT, False),  # the gateway host's own address, other port
    "loopback": ("127.0.0.1", 80, False),
    "loopback-tls": ("127.0.0.1", 443, True),
    "loopback-v6": ("::1", 80, False),
    "loopback-2": ("127.0.0.2", 80, False),  # 127/8 is loopback, not just .1
}
# allowed upstream (policy allows it) and a second host that no policy allows (fronting target)
UPSTREAMS: list[dict[str, Any]] = [
    {"name": "upstream-tls", "host": UPSTREAM, "port": 443, "tls": True},
    {"name": "upstream-tls-cl", "host": UPSTREAM, "port": 8443, "tls": True, "framing": "cl"},
    {"name": "upstream-h2", "host": UPSTREAM, "port": 9443, "tls": True, "alpn": ["h2", "http/1.1"]},
    {"name": "upstream-http", "host": UPSTREAM, "port": 80, "framing": "te"},
    {"name": "upstream-http-cl", "host": UPSTREAM, "port": 8080, "framing": "cl"},
    {"name": "upstream-raw", "host": UPSTREAM, "port": 2222, "kind": "raw"},
    # server-first (speaks on accept): 2224 is allowed by a tcp rule in escape-transparent, 2225 is not
    {"name": "upstream-banner", "host": UPSTREAM, "port": 2224, "kind": "banner"},
    {"name": "upstream-banner-denied", "host": UPSTREAM, "port": 2225, "kind": "banner"},
    {"name": "forbidden-tls", "host": FORBIDDEN_UPSTREAM, "port": 443, "tls": True},
    {"name": "forbidden-http", "host": FORBIDDEN_UPSTREAM, "port": 80},
]
CERT_NAMES = [
    "api.allowed.test", "*.allowed.test", "forbidden.test", "*.forbidden.test", "*.evil.test",
    "metadata.google.internal", UPSTREAM, FORBIDDEN_UPSTREAM, "10.0.0.5", "169.254.169.254", "127.0.0.1",
]
DEFAULT_DNS: dict[str, dict[str, Any]] = {
    "api.allowed.test": {"A": [UPSTREAM]},
    "other.allowed.test": {"A": [UPSTREAM]},
    "forbidden.test": {"A": [FORBIDDEN_UPSTREAM]},
    "internal.allowed.test": {"A": ["10.0.0.5"]},
    "loopback.evil.test": {"A": ["127.0.0.1"]},
    "private.evil.test": {"A": ["10.0.0.5"]},
    "metadata.evil.test": {"A": ["169.254.169.254"]},
    "cgnat.evil.test": {"A": ["100.100.100.200"]},
    "wireserver.evil.test": {"A": ["168.63.129.16"]},
    "mapped.evil.test": {"AAAA": ["::ffff:169.254.169.254"]},
    "v6meta.evil.test": {"AAAA": ["fd00:ec2::254"]},
    "nat64.evil.test": {"AAAA": ["64:ff9b::a9fe:a9fe"]},
    "mixed.evil.test": {"A": [UPSTREAM, "169.254.169.254"]},
    "rebind.evil.test": {"A": {"rotate": [[UPSTREAM], ["169.254.169.254"]]}},
    "rebind-lo.evil.test": {"A": {"rotate": [[UPSTREAM], ["127.0.0.1"]]}},
    "metadata.google.internal": {"A": ["169.254.169.254"]},
}

