"""Gateway config: every default works without a file; mistakes name the key path."""

from __future__ import annotations

import pytest

from egressgate.config import ConfigError, load_config


def write(tmp_path, text: str):
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


def test_defaults_without_a_file(tmp_path):
    cfg = load_config(None)
    assert cfg.listen.proxy == "127.0.0.1:8080" and cfg.listen.dns == "127.0.0.1:5353"
    assert cfg.audit.on_failure == "deny" and cfg.audit.signer == "auto"
    assert cfg.dns.resolver_config().upstreams is None  # /etc/resolv.conf at start
    assert str(cfg.audit_path()).endswith("var/audit.jsonl")
    assert cfg.websocket.max_message_bytes == 4 * 1024 * 1024  # documented in docs/operations.md


def test_sections_map_to_components(tmp_path):
    cfg = load_config(write(tmp_path, """
listen: {dns: null}
upstream: {connect_timeout: 3}
dns: {upstreams: ["127.0.0.1:5300", "[::1]:53"], upstream_timeout: 1, unknown_client_policy: guest}
audit: {path: /tmp/x.jsonl, on_failure: allow-and-alert, checkpoint_every: 10}
"""))
    assert cfg.listen.dns is None
    assert cfg.upstream.connect_timeout == 3.0
    dns = cfg.dns.resolver_config()
    assert dns.upstreams == (("127.0.0.1", 5300), ("::1", 53)) and dns.upstream_timeout == 1.0
    assert dns.unknown_client_policy == "guest"
    assert str(cfg.audit_path()) == "/tmp/x.jsonl" and cfg.audit.checkpoint_every == 10


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("dns: {upstreamz: [1.1.1.1]}\n", "dns.upstreamz: Extra inputs"),
        ("dns: {upstreams: [resolver.example:53]}\n", "dns.upstreams"),
        ("upstream: {connect_timeout: 0}\n", "upstream.connect_timeout: Input should be greater than 0"),
        ("audit: {on_failure: allow}\n", "audit.on_failure"),
        ("audit: {local_file: false}\n", "otlp_endpoint"),
        ("listen: {proxy: 'localhost:8080'}\n", "listen.proxy"),
        ("state: {backend: memroy}\n", "state.backend"),
        ("state: {backend: redis, url: 'http://127.0.0.1:6379'}\n", "state.url must start with redis://"),
        ("state: {backend: redis}\n", "state.url is required"),
        ("state: {url: 'redis://127.0.0.1:6379/0'}\n", "state.backend is memory"),
        ("state: {backend: redis, url: 'redis://127.0.0.1/0', key_prefix: 'a b'}\n", "state.key_prefix"),
        ("state: {backend: redis, url: 'redis://127.0.0.1/0', pasword: x}\n", "state.pasword: Extra inputs"),
        ("state: {backend: redis, url: 'redis://127.0.0.1/0', heartbeat_ttl_seconds: 1}\n",
         "state.heartbeat_ttl_seconds must be between 3 and 300"),
        ("websocket: {max_message_bytes: 0}\n", "websocket.max_message_bytes"),
    ],
)
def test_errors_name_the_key(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert fragment in str(info.value)
    assert str(tmp_path / "gateway.yaml") in str(info.value)


def test_limits_defaults_and_validation(tmp_path):
    cfg = load_config()
    assert cfg.limits.header_timeout == 30.0 and cfg.limits.max_pending_per_source == 256
    assert cfg.limits.max_client_hello_bytes == 64 * 1024  # documented in docs/operations.md
    path = tmp_path / "gw.yaml"
    path.write_text("limits: {header_timeout: 5, max_connections_per_sandbox: 8}\n")
    cfg = load_config(path)
    assert cfg.limits.header_timeout == 5.0 and cfg.limits.max_connections_per_sandbox == 8
    for bad, key in (("header_timeout: 0", "limits.header_timeout"), ("max_pending_per_source: -1",
                                                                       "limits.max_pending_per_source"),
                     ("heder_timeout: 5", "limits.heder_timeout"),
                     # above OpenSSL's own ClientHello cap: a setting that would only pretend
                     ("max_client_hello_bytes: 16777216", "limits.max_client_hello_bytes")):
        path.write_text(f"limits: {{{bad}}}\n")
        with pytest.raises(ConfigError, match=f"{path}: {key}"):
            load_config(path)


def test_transparent_listener_default_off_and_distinct(tmp_path):
    """listen.transparent (gateway/pipeline/transparent.py): on by default on loopback, null turns it off, and it
    may not share listen.proxy's address (mitmproxy would refuse the second listener at start)."""
    assert load_config(None).listen.transparent == "127.0.0.1:8082"
    assert load_config(write(tmp_path, "listen: {transparent: null}\n")).listen.transparent is None
    assert load_config(write(tmp_path, "listen: {transparent: '127.0.0.2:0', proxy: '127.0.0.1:0'}\n"))
    for bad, fragment in (("listen: {transparent: '127.0.0.1:8080'}\n", "must differ from listen.proxy"),
                          ("listen: {transparent: 'nonsense'}\n", "listen.transparent")):
        with pytest.raises(ConfigError) as exc:
            load_config(write(tmp_path, bad))
        assert fragment in str(exc.value)
