"""The `state:` section: valid forms load, and the factory builds the backend they name."""

from __future__ import annotations

import pytest

from egressgate.config import ConfigError, load_config
from egressgate.state import open_state
from egressgate.state.base import StateUnavailable
from egressgate.state.config import StateConfig
from egressgate.state.memory import MemoryState
from egressgate.state.redis import RedisState
from tests.state.helpers import record
from tests.support.redis import RedisServer


def _load(tmp_path, text: str):
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6390/0", "rediss://user:pw@redis.internal:6380/2",
                                 "unix:///run/redis/redis.sock"])
def test_redis_urls_load(tmp_path, url):
    cfg = _load(tmp_path, f"state: {{backend: redis, url: '{url}', key_prefix: 'team-a:'}}\n")
    assert (cfg.state.backend, cfg.state.url, cfg.state.key_prefix) == ("redis", url, "team-a:")


def test_errors_name_the_file_and_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, "state: {backend: redis, url: 'tcp://127.0.0.1:6390'}\n")
    assert f"{tmp_path / 'gateway.yaml'}: state.url:" in str(info.value) and "'tcp'" in str(info.value)


async def test_open_state_builds_the_named_backend(redis_server: RedisServer, tmp_path):
    assert isinstance(await open_state(load_config().state), MemoryState)  # the default
    cfg = _load(tmp_path, f"state: {{backend: redis, url: '{redis_server.url}', key_prefix: 'r12cfg:', "
                          "heartbeat_ttl_seconds: 6}\n")
    store = await open_state(cfg.state)
    try:
        assert isinstance(store, RedisState) and store.key("sbx", "x") == "r12cfg:sbx:x"
        assert store.heartbeat_ttl == 6.0 and load_config().state.heartbeat_ttl_seconds == 15.0  # default
        await store.ping()
    finally:
        await store.close()


async def test_password_and_unix_socket_urls_work_and_a_wrong_password_fails_closed(tmp_path):
    secret = "r12-" + "pw" * 8
    with RedisServer(tmp_path / "redis", password=secret, unixsocket=True) as server:
        for url in (server.url, server.unix_url):
            store = await open_state(StateConfig(backend="redis", url=url, key_prefix=server.prefix()))
            try:
                await store.admit(record())
                assert await store.reserve_out("sbx", 5, 5, 10) == 5
                assert (await store.snapshot("sbx")).bytes_out == 5 and (await store.get("sbx")) is not None
            finally:
                await store.close()
        wrong = await open_state(StateConfig(backend="redis", url=server.url.replace(secret, "nope"),
                                             key_prefix=server.prefix()))
        try:
            for op in (wrong.ping(), wrong.reserve_out("sbx", 1, 1, None), wrong.get("sbx")):
                with pytest.raises(StateUnavailable) as info:
                    await op
                assert "nope" not in str(info.value) and secret not in str(info.value)
            assert wrong.errors == 4  # and the ping open_state made at start
        finally:
            await wrong.close()


async def test_password_file_keeps_the_password_out_of_the_config(tmp_path):
    """`state.password_file`: the client authenticates with the file's password (positive control); without
    it, or with another one, Redis refuses and the store fails closed; a bad file stops before any connect."""
    secret = "pf-" + "s3cr3t/:@" * 3  # characters a URL must percent-encode
    pw_file = tmp_path / "redis.password"
    pw_file.write_text(secret + "\n")
    pw_file.chmod(0o440)
    with RedisServer(tmp_path / "redis", password=secret, unixsocket=True) as server:
        bare, bare_unix = server.url.replace(f":{server.password}@", ""), server.unix_url.replace(
            f":{server.password}@", "")
        for url in (bare, bare_unix):
            cfg = StateConfig(backend="redis", url=url, key_prefix=server.prefix(), password_file=str(pw_file))
            store = await open_state(cfg)
            try:
                await store.admit(record())
                assert await store.reserve_out("sbx", 5, 5, 10) == 5
            finally:
                await store.close()
        # the same url without the file: Redis says NOAUTH, the store denies
        store = await open_state(StateConfig(backend="redis", url=bare, key_prefix=server.prefix()))
        try:
            with pytest.raises(StateUnavailable):
                await store.get("sbx")
        finally:
            await store.close()
        pw_file.chmod(0o600)
        pw_file.write_text("wrong-password\n")
        store = await open_state(StateConfig(backend="redis", url=bare, key_prefix=server.prefix(),
                                             password_file=str(pw_file)))
        try:
            with pytest.raises(StateUnavailable) as info:
                await store.get("sbx")
            assert "wrong-password" not in str(info.value)
        finally:
            await store.close()


@pytest.mark.parametrize(("mode", "text", "why"), [
    (0o644, "pw\n", "lets every local user read it"),
    (0o600, "\n", "empty, or more than one line"),
    (0o600, "a\nb\n", "empty, or more than one line"),
])
def test_a_bad_password_file_is_named(tmp_path, mode, text, why):
    pw_file = tmp_path / "pw"
    pw_file.write_text(text)
    pw_file.chmod(mode)
    cfg = StateConfig(backend="redis", url="redis://127.0.0.1:6390/0", password_file=str(pw_file))
    with pytest.raises(RuntimeError, match=why) as info:
        cfg.connection_url()
    assert str(pw_file) in str(info.value)
    missing = StateConfig(backend="redis", url="redis://127.0.0.1:6390/0", password_file=str(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match="cannot read it"):
        missing.connection_url()


@pytest.mark.parametrize(("text", "why"), [
    ("state: {backend: memory, password_file: /x}\n", "it is Redis's password"),
    ("state: {backend: redis, url: 'redis://:pw@127.0.0.1:6390/0', password_file: /x}\n", "keep one"),
])
def test_password_file_conflicts_are_refused(tmp_path, text, why):
    with pytest.raises(ConfigError, match=why):
        _load(tmp_path, text)
