"""A real OpenBao server with on-disk (raft) storage that can be stopped and started again.

Why not the dev server: `bao server -dev` keeps everything in memory, so a restarted dev server has no
transit key, no AppRole and no tokens - that is a new Vault, not an outage. This one is initialized once
(one unseal key), unsealed after every start, and provisioned exactly like tests/support/bao.py's
BaoServer (it reuses its `configure`), so an outage test can really stop the process and bring the same
Vault back. Loopback only.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import hvac

from tests.support.bao import BAO, BaoServer
from tests.support.env import free_port


@dataclass
class PersistentBao(BaoServer):
    home: Path | None = None
    unseal_key: str = ""
    port: int = 0
    cluster_port: int = 0

    def start(self) -> PersistentBao:
        assert self.home is not None
        first = not (self.home / "data").exists()
        if first:
            (self.home / "data").mkdir(parents=True)
            self.port, self.cluster_port = free_port(), free_port()
            self.addr = f"http://127.0.0.1:{self.port}"
            (self.home / "bao.hcl").write_text(
                f'storage "raft" {{\n  path = "{self.home / "data"}"\n  node_id = "n1"\n}}\n'
                f'listener "tcp" {{\n  address = "127.0.0.1:{self.port}"\n'
                f'  cluster_address = "127.0.0.1:{self.cluster_port}"\n  tls_disable = true\n}}\n'
                f'api_addr = "{self.addr}"\ncluster_addr = "http://127.0.0.1:{self.cluster_port}"\n'
            )
        log = open(self.home / "bao.log", "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen([BAO, "server", f"-config={self.home / 'bao.hcl'}"], stdout=log, stderr=log)
        client = hvac.Client(url=self.addr, timeout=60)  # init takes seconds (raft, key generation)
        self._wait(lambda: client.sys.is_initialized() is not None)
        if first:
            init = client.sys.initialize(1, 1)
            self.unseal_key, self.root_token = init["keys"][0], init["root_token"]
        client.sys.submit_unseal_key(self.unseal_key)
        client.token = self.root_token
        self._wait(lambda: _active(client.sys.read_health_status(method="GET")))
        return self

    def configure(self) -> PersistentBao:
        """The dev server mounts KV v2 at `secret/` by itself; a real server needs it mounted first."""
        self.root().sys.enable_secrets_engine("kv", path="secret", options={"version": "2"})
        self._wait(lambda: self.root().secrets.kv.v2.read_configuration(mount_point="secret") is not None)
        super().configure()
        return self

    def _wait(self, ready, timeout: float = 40) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"bao exited with {self.proc.returncode}")
            try:
                if ready():
                    return
            except Exception:  # noqa: S110 - not up yet
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("bao did not become ready")


def _active(health) -> bool:
    """hvac returns the JSON body for 200 (active, unsealed) and the raw response otherwise."""
    return isinstance(health, dict) and not health.get("sealed") and not health.get("standby")
