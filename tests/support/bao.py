"""A real OpenBao dev server on a free loopback port, configured the way the gateway expects.

Not a mock: the `bao` binary from .venv/bin (OpenBao, Vault-API compatible), in-memory, listening on
127.0.0.1 only. `configure()` provisions what production operators provision: a transit ed25519 key, a
KV v2 secret, a least-privilege policy for the gateway, AppRole roles, and an identity OIDC key + role.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import hvac
from pydantic import TypeAdapter

from egressgate.broker.config import BrokerConfig, Capability
from tests.support.env import free_port
from tests.support.launcher import stop_process

BAO = str(Path(sys.executable).parent / "bao")
KV_SECRET = "sk-kv-" + secrets.token_urlsafe(24)
GW_POLICY = """
path "secret/data/egressgate/*" { capabilities = ["read"] }
path "transit/sign/egressgate-jwt" { capabilities = ["update"] }
path "transit/sign/egressgate-jwt/*" { capabilities = ["update"] }
path "transit/keys/egressgate-jwt" { capabilities = ["read"] }
path "transit/sign/egressgate-audit" { capabilities = ["update"] }
path "transit/keys/egressgate-audit" { capabilities = ["read"] }
path "transit/keys/not-ed25519" { capabilities = ["read"] }
path "identity/oidc/token/sbx-api" { capabilities = ["read"] }
path "identity/oidc/token/sbx-long" { capabilities = ["read"] }
"""


@dataclass
class BaoServer:
    addr: str = ""
    root_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    proc: subprocess.Popen[bytes] | None = None
    role_id: str = ""
    secret_id: str = ""
    oidc_client_id: str = ""

    def start(self) -> BaoServer:
        """Start on a free port. A merely-free port can be taken before bao binds it (by an outgoing
        connection, or another test worker's server): then bao exits, or the health check would reach
        the other server. So a start counts only when *our* root token works there; else retry."""
        for _ in range(5):
            if self._start_once(free_port()):
                return self
        raise RuntimeError("bao did not become healthy on any of 5 free ports")

    def _start_once(self, port: int) -> bool:
        self.addr = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [
                BAO,
                "server",
                "-dev",
                f"-dev-root-token-id={self.root_token}",
                f"-dev-listen-address=127.0.0.1:{port}",
                "-dev-no-store-token",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.addr}/v1/sys/health", timeout=1) as r:  # noqa: S310
                    if r.status == 200 and self.proc.poll() is None and self.root().is_authenticated():
                        return True
            except (OSError, hvac.exceptions.VaultError):
                pass
            time.sleep(0.05)
        self.stop()
        return False

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=5)

    def root(self) -> hvac.Client:
        return hvac.Client(url=self.addr, token=self.root_token, timeout=5)

    def configure(self) -> BaoServer:
        c = self.root()
        c.sys.enable_secrets_engine("transit")
        c.secrets.transit.create_key("egressgate-jwt", key_type="ed25519")
        c.secrets.transit.create_key("egressgate-audit", key_type="ed25519")
        c.secrets.transit.create_key("not-ed25519", key_type="ecdsa-p256")
        c.secrets.kv.v2.create_or_update_secret(
            path="egressgate/openai", secret={"api_key": KV_SECRET}, mount_point="secret"
        )
        c.secrets.kv.v2.create_or_update_secret(
            path="outside/other", secret={"api_key": "not-for-the-gateway"}, mount_point="secret"
        )
        c.sys.create_or_update_policy("egressgate-gw", GW_POLICY)
        c.sys.enable_auth_method("approle")
        c.auth.approle.create_or_update_approle(
            "egressgate", token_policies=["egressgate-gw"], token_ttl="1h", token_max_ttl="4h"
        )
        self.role_id = c.auth.approle.read_role_id("egressgate")["data"]["role_id"]
        self.secret_id = c.auth.approle.generate_secret_id("egressgate")["data"]["secret_id"]
        # identity OIDC: a key may sign only for the client ids it lists (empty list = none)
        c.secrets.identity.create_named_key("egk", allowed_client_ids=["placeholder"], algorithm="EdDSA")
        c.secrets.identity.create_or_update_role("sbx-api", key="egk", ttl="120")
        c.secrets.identity.create_or_update_role("sbx-long", key="egk", ttl="3600")
        ids = [c.secrets.identity.read_role(r)["data"]["client_id"] for r in ("sbx-api", "sbx-long")]
        self.oidc_client_id = ids[0]
        c.secrets.identity.create_named_key("egk", allowed_client_ids=ids, algorithm="EdDSA")
        return self

    def approle(self, name: str, token_ttl: str, token_max_ttl: str) -> tuple[str, str]:
        c = self.root()
        c.auth.approle.create_or_update_approle(
            name, token_policies=["egressgate-gw"], token_ttl=token_ttl, token_max_ttl=token_max_ttl
        )
        role_id = c.auth.approle.read_role_id(name)["data"]["role_id"]
        secret_id = c.auth.approle.generate_secret_id(name)["data"]["secret_id"]
        return role_id, secret_id


# Capabilities and broker config the broker tests (and the audit transit tests) use against a BaoServer.
CAP = TypeAdapter(Capability)
KV_CAP = CAP.validate_python(
    {
        "type": "static",
        "source": {"vault": {"path": "egressgate/openai", "field": "api_key"}},
        "placement": {"header": "Authorization", "format": "Bearer {value}"},
    }
)
JWT_CAP = CAP.validate_python({"type": "jwt", "ttl_seconds": 120})
OIDC_CAP = CAP.validate_python({"type": "vault_oidc", "role": "sbx-api"})


def vault_config(bao: BaoServer, **kw) -> BrokerConfig:
    base = {"backend": "vault", "vault_addr": bao.addr, "role_id": bao.role_id, "secret_id": bao.secret_id}
    return BrokerConfig(**(base | kw))
