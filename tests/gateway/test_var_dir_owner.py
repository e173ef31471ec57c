"""One gateway per var dir (egressgate/gateway/service/varlock.py): a second `egressgate run` on a var dir a gateway
runs on refuses to start *and changes nothing there*.

Why it matters: it used to refuse (at its audit writer lock) but on its way out it removed the running
gateway's `var/gateway.json`, so every later CLI command (`sandbox admit|list`, `approvals`, ...) aimed at the
admin port of the config instead of the one the gateway bound. Ports are 0 here: without gateway.json the CLI
cannot find the running gateway at all, which is exactly the failure.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.cli import cli, run
from tests.support.launcher import EGRESSGATE, drain, launch_loopback, stop_process, write_policies


def _files(var: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under the var dir: (size, mtime_ns, content) by relative path."""
    out: dict[str, tuple[int, int, bytes]] = {}
    for path in sorted(var.rglob("*")):
        if path.is_file():
            st = path.stat()
            out[str(path.relative_to(var))] = (st.st_size, st.st_mtime_ns, path.read_bytes())
    return out


def test_a_refused_second_gateway_changes_nothing_the_running_one_owns(tmp_path: Path) -> None:
    policies = write_policies(tmp_path / "policies", {"p": {"sandbox": {"name": "p"}, "network": {}}})
    var = tmp_path / "var"
    config = {"listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
              "policy": str(policies), "var_dir": str(var)}
    first = launch_loopback(tmp_path, config)
    drain(first["proc"])
    try:
        before = _files(var)
        assert "gateway.json" in before and "audit.jsonl" in before
        second = run([EGRESSGATE, "run", "--config", str(first["config"])], timeout=60,
                 stdin=subprocess.DEVNULL)
        assert second.returncode != 0, second.stdout
        after = _files(var)
        assert after == before, {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        message = second.stderr.strip().splitlines()[-1]
        assert "another gateway" in message and str(var.absolute()) in message, second.stderr[-2000:]
        assert f"pid {first['proc'].pid}" in message and first["admin"] in message, message
        assert second.stdout == ""  # never announced listeners
        assert first["proc"].poll() is None  # the first gateway still runs
        # the CLI still finds the running gateway through its gateway.json (the config says port 0)
        listed = cli("sandbox", "list", "--config", str(first["config"]))
        assert listed.returncode == 0, listed.stdout + listed.stderr
    finally:
        assert stop_process(first["proc"]) == 0
    assert not (var / "gateway.json").exists()  # the first removed what it wrote
    verified = cli("audit", "verify", "--public-key", str(var / "audit-signing.key.pub"), str(var / "audit.jsonl"))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    # positive control: once the first gateway is gone the var dir is free, and the same command starts
    again = launch_loopback(tmp_path, config)
    try:
        assert (var / "gateway.json").is_file()
        listed = cli("sandbox", "list", "--config", str(again["config"]))
        assert listed.returncode == 0, listed.stdout + listed.stderr
    finally:
        assert stop_process(again["proc"]) == 0
