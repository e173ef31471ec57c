"""`egressgate run --listen-proxy|--listen-transparent|--listen-dns|--listen-admin` and their environment
variables (EGRESSGATE_LISTEN_*): listener addresses without a config file, a flag over its variable over the
file. Real gateways on loopback, port 0 (parallel safe); each source gets its own 127.0.0.x address, so the
startup line shows which one won. The file's losing values are TEST-NET addresses (192.0.2.x): a gateway that
used one would fail to bind, never reach anything.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import cli, zygote
from tests.support.launcher import EGRESSGATE, drain, startup_info, stop_process, write_policies

NOT_LOCAL = "192.0.2.1:8080"  # TEST-NET-1: never a local address, so binding it fails


def _env(**listen: str) -> dict[str, str]:
    """The test's environment without inherited EGRESSGATE_LISTEN_* and with the given ones."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSGATE_LISTEN_")}
    env.update({f"EGRESSGATE_LISTEN_{kind.upper()}": value for kind, value in listen.items()})
    return {**env, "NO_PROXY": ""}


def _config(tmp: Path, listen: dict[str, str | None]) -> Path:
    policies = write_policies(tmp / "policies", {"p": {"sandbox": {"name": "p"}, "network": {}}})
    cfg = tmp / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({"listen": listen, "policy": str(policies), "var_dir": str(tmp / "var")}))
    return cfg


def _run(cfg: Path, args: list[str], env: dict[str, str], tmp: Path) -> tuple[subprocess.Popen, dict]:
    stderr_path = tmp / "gateway.stderr"
    with open(stderr_path, "w") as stderr:
        proc = zygote.popen([EGRESSGATE, "run", "--config", str(cfg), *args], stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env=env)
    info = startup_info(proc, stderr_path)
    drain(proc)
    return proc, info


def test_flag_beats_env_beats_file(tmp_path: Path) -> None:
    cfg = _config(tmp_path, {"proxy": NOT_LOCAL, "admin": "192.0.2.2:8081", "dns": "127.0.0.13:0",
                             "transparent": "192.0.2.3:8082"})
    env = _env(proxy="127.0.0.12:0", admin="127.0.0.12:0")
    proc, info = _run(cfg, ["--listen-proxy", "127.0.0.11:0", "--listen-transparent", "off"], env, tmp_path)
    try:
        assert info["proxy"].startswith("127.0.0.11:")  # flag over env over file
        assert info["admin"].startswith("127.0.0.12:")  # env over file
        assert info["dns"].startswith("127.0.0.13:")  # the file, where nothing overrides it
        assert "transparent" not in info  # `off`: the file's address is not used
        published = json.loads((tmp_path / "var" / "gateway.json").read_text())
        assert published["admin"] == info["admin"] and published["proxy"] == info["proxy"]
    finally:
        assert stop_process(proc) == 0


def test_env_alone_and_ipv6_in_brackets(tmp_path: Path) -> None:
    """No --config at all: the embedded defaults (8080-8082, 5353) are replaced by the variables, so a second
    gateway on one host needs no file."""
    policies = write_policies(tmp_path / "policies", {"p": {"sandbox": {"name": "p"}, "network": {}}})
    env = _env(proxy="127.0.0.1:0", admin="[::1]:0", dns="off", transparent="127.0.0.14:0")
    stderr_path = tmp_path / "gateway.stderr"
    with open(stderr_path, "w") as stderr:
        proc = zygote.popen([EGRESSGATE, "run", "--policy", str(policies)], stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env=env, cwd=tmp_path)
    info = startup_info(proc, stderr_path)
    drain(proc)
    try:
        assert info["admin"].startswith("[::1]:") and info["proxy"].startswith("127.0.0.1:")
        assert info["transparent"].startswith("127.0.0.14:") and "dns" not in info
        assert (tmp_path / "var" / "gateway.json").is_file()  # ./var of its working directory
    finally:
        assert stop_process(proc) == 0


@pytest.mark.parametrize(("args", "env", "named", "why"), [
    (["--listen-proxy", "localhost:8080"], {}, "'--listen-proxy'", "IP literal"),
    (["--listen-admin", "127.0.0.1"], {}, "'--listen-admin'", "host:port"),
    (["--listen-dns", "127.0.0.1:70000"], {}, "'--listen-dns'", "out of range"),
    (["--listen-transparent", "::1:8082"], {}, "'--listen-transparent'", "brackets"),
    (["--listen-admin", "off"], {}, "'--listen-admin'", "cannot be turned off"),
    ([], {"dns": "not-an-address"}, "'--listen-dns' (from $EGRESSGATE_LISTEN_DNS)", "host:port"),
])
def test_a_bad_address_is_refused_naming_its_flag(tmp_path: Path, args: list[str], env: dict[str, str],
                                                  named: str, why: str) -> None:
    res = cli.run([EGRESSGATE, "run", "--policy", str(tmp_path), *args], env=_env(**env), cwd=tmp_path,
                  timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert named in res.stderr and why in res.stderr, res.stderr
    assert not (tmp_path / "var").exists()  # refused before anything was created


def test_a_valid_flag_still_meets_the_config_rules(tmp_path: Path) -> None:
    """The flag goes through the same model as the file: transparent equal to proxy is refused at once."""
    cfg = _config(tmp_path, {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None})
    res = cli.run([EGRESSGATE, "run", "--config", str(cfg), "--listen-transparent", "127.0.0.1:0"],
                  env=_env(), timeout=60)
    assert res.returncode == 1 and "listen.transparent must differ" in res.stderr, res.stderr
