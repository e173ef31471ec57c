"""`runtime render compose`: the repository's compose.yaml is exactly what the renderer writes (so the
file the docker-compose test brings up is the file the code vouches for), its addresses stay inside
198.18.0.0/15, and the agent sits only on internal networks whose one other member is the gateway."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
import yaml

from egressgate.config import GatewayConfig
from tests.support.cli import POLICIES, ROOT, cli

BENCH = ipaddress.ip_network("198.18.0.0/15")


def rendered(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "out"
    res = cli("runtime", "render", "compose", "--policies", str(POLICIES), "--policy", "example-agent",
              "--out", str(out), *args)
    assert res.returncode == 0, res.stderr
    return out


def test_repository_compose_files_are_the_rendered_ones(tmp_path):
    out = rendered(tmp_path)
    for name in ("compose.yaml", "deploy/compose/gateway.yaml", "deploy/compose/policies/example-agent.yaml"):
        assert (ROOT / name).read_text() == (out / name).read_text(), (
            f"{name} is stale: egressgate runtime render compose --policy example-agent --out .")
    GatewayConfig.model_validate(yaml.safe_load((ROOT / "deploy/compose/gateway.yaml").read_text()))


def test_agent_only_way_out_is_the_gateway(tmp_path):
    doc = yaml.safe_load((rendered(tmp_path) / "compose.yaml").read_text())
    services, networks = doc["services"], doc["networks"]
    for name, net in networks.items():
        for cfg in net["ipam"]["config"]:
            assert ipaddress.ip_network(cfg["subnet"]).subnet_of(BENCH), name
    agent_nets = set(services["agent"]["networks"])
    assert agent_nets and all(networks[n]["internal"] is True for n in agent_nets)
    # the internal bridges carry no host address: no default route to the daemon's namespace either
    assert all(networks[n]["driver_opts"]["com.docker.network.bridge.inhibit_ipv4"] == "true" for n in agent_nets)
    members = {n: {s for s, spec in services.items() if n in spec.get("networks", {})} for n in agent_nets}
    assert all(m == {"agent", "gateway"} for m in members.values()), members
    outside = [s for s, spec in services.items() if any(not networks[n]["internal"] for n in spec.get("networks", {}))]
    assert outside == ["gateway"]
    agent = services["agent"]
    assert agent["cap_drop"] == ["ALL"] and "no-new-privileges:true" in agent["security_opt"]
    assert agent["read_only"] is True and agent["user"] == "65532:65532"
    assert "network_mode" not in agent and "privileged" not in agent
    # the admin API is not published anywhere; only `admit` shares the gateway's namespace
    assert not any("ports" in spec for spec in services.values())
    assert {s: spec["network_mode"] for s, spec in services.items() if "network_mode" in spec} == {
        "admit": "service:gateway", "secrets": "none"}


@pytest.mark.parametrize(("args", "message"), [
    (["--subnet", "10.0.0.0/22"], "--subnet must be a /22 or larger inside 198.18.0.0/15"),
    (["--subnet", "198.18.64.0/24"], "--subnet must be a /22 or larger"),
    (["--subnet", "nonsense"], "--subnet 'nonsense' is not a network"),
    (["--config-dir", "../elsewhere"], "--config-dir must be a relative path below the compose file"),
])
def test_bad_inputs_fail_clearly(tmp_path, args, message):
    res = cli("runtime", "render", "compose", "--policies", str(POLICIES), "--policy", "example-agent",
              "--out", str(tmp_path / "out"), *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()


def test_gateway_workers_share_state_in_redis(tmp_path):
    """The compose gateway runs `--workers 2` on the rendered Redis (the config the gateway would refuse with
    the memory backend passes), and Redis keeps its append-only file on a volume (a restart of Redis or of
    the gateway keeps sandboxes and spent budgets); Redis sits only on the internal backend network."""
    from egressgate.gateway.service.workers import check_workers

    out = rendered(tmp_path)
    doc = yaml.safe_load((out / "compose.yaml").read_text())
    services = doc["services"]
    cmd = services["gateway"]["command"]
    workers = int(cmd[cmd.index("--workers") + 1])
    assert workers == 2
    cfg = GatewayConfig.model_validate(yaml.safe_load((out / "deploy/compose/gateway.yaml").read_text()))
    redis_ip = services["redis"]["networks"]["backend"]["ipv4_address"]
    assert cfg.state.backend == "redis" and cfg.state.url == f"redis://{redis_ip}:6379/0"
    check_workers(cfg, workers)
    redis = services["redis"]["command"]
    assert redis[redis.index("--appendonly") + 1] == "yes" and redis[redis.index("--dir") + 1] == "/data"
    assert "redis-data:/data" in services["redis"]["volumes"] and "redis-data" in doc["volumes"]
    assert list(services["redis"]["networks"]) == ["backend"] and doc["networks"]["backend"]["internal"] is True


def test_redis_requires_a_password_generated_inside_the_stack(tmp_path):
    """No `--protected-mode no` and no password in any file the operator keeps: the one-shot `secrets` service
    writes it once into a volume only Redis and the gateway mount. Its script is run here for real (twice:
    the second `up` keeps the password), then a real redis-server started from the redis.conf it wrote refuses
    a client without the password and serves the gateway's state store configured as compose configures it."""
    import asyncio
    import stat
    import subprocess

    from egressgate.runtimes.render.compose import SECRETS_DIR, SECRETS_INIT
    from egressgate.state import open_state
    from egressgate.state.base import StateUnavailable
    from egressgate.state.config import StateConfig
    from tests.support.env import free_port

    out = rendered(tmp_path)
    doc = yaml.safe_load((out / "compose.yaml").read_text())
    services = doc["services"]
    redis = services["redis"]
    assert "--protected-mode" not in redis["command"] and redis["command"][1] == f"{SECRETS_DIR}/redis.conf"
    assert redis["depends_on"] == {"secrets": {"condition": "service_completed_successfully"}}
    assert services["gateway"]["depends_on"]["secrets"] == {"condition": "service_completed_successfully"}
    mounts = {s: [v for v in spec.get("volumes", []) if v.startswith("egressgate-secrets:")]
              for s, spec in services.items()}
    assert {s: m for s, m in mounts.items() if m} == {"secrets": [f"egressgate-secrets:{SECRETS_DIR}"],
                                                     "redis": [f"egressgate-secrets:{SECRETS_DIR}:ro"],
                                                     "gateway": [f"egressgate-secrets:{SECRETS_DIR}:ro"]}
    cfg = GatewayConfig.model_validate(yaml.safe_load((out / "deploy/compose/gateway.yaml").read_text()))
    assert cfg.state.password_file == f"{SECRETS_DIR}/redis.password" and "@" not in (cfg.state.url or "")
    text = (out / "compose.yaml").read_text() + (out / "deploy/compose/gateway.yaml").read_text()
    assert "requirepass" not in text.replace("'requirepass '", "")  # the script's literal, never a value

    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    script = SECRETS_INIT.replace(repr(SECRETS_DIR), repr(str(secrets_dir)))
    for _ in range(2):
        subprocess.run(["python3", "-c", script], check=True, timeout=30)
    password = (secrets_dir / "redis.password").read_text().strip()
    assert len(password) >= 32 and (secrets_dir / "redis.conf").read_text() == f"requirepass {password}\n"
    assert {stat.S_IMODE(p.stat().st_mode) for p in secrets_dir.iterdir()} == {0o600}
    assert sorted(p.name for p in secrets_dir.iterdir()) == ["redis.conf", "redis.password"]  # no .tmp left

    port = free_port()
    proc = subprocess.Popen(["redis-server", str(secrets_dir / "redis.conf"), "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        async def check() -> None:
            url = f"redis://127.0.0.1:{port}/0"
            with_file = StateConfig(backend="redis", url=url, password_file=str(secrets_dir / "redis.password"))
            without = StateConfig(backend="redis", url=url)
            for _ in range(100):  # until redis-server listens
                store = await open_state(with_file)
                try:
                    await store.ping()
                    break
                except StateUnavailable:
                    await asyncio.sleep(0.1)
                finally:
                    await store.close()
            store = await open_state(with_file)
            try:
                assert await store.get("nobody") is None  # authenticated: a real answer (positive control)
            finally:
                await store.close()
            store = await open_state(without)
            try:
                with pytest.raises(StateUnavailable):
                    await store.get("nobody")  # NOAUTH: protected by the password, not by protected mode
            finally:
                await store.close()

        asyncio.run(check())
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_gateway_container_has_limits(tmp_path):
    services = yaml.safe_load((rendered(tmp_path) / "compose.yaml").read_text())["services"]
    gateway = services["gateway"]
    assert gateway["mem_limit"] == gateway["memswap_limit"] == "1g" and gateway["cpus"] == 2.0
    assert gateway["pids_limit"] == 512
    assert services["redis"]["mem_limit"] == "256m"
