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
