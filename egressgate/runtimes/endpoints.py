"""Where the running gateway listens and what it publishes for runtimes (`var_dir/gateway.json`).

`sandbox run` reads this file instead of the gateway config: the file holds the addresses the gateway
actually bound (port 0 safe) and the settings it validated at start-up, and reading JSON keeps the
CLI's start-up free of the config models (pydantic), which is most of `sandbox run`'s overhead budget.
Stdlib only.
"""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import NamedTuple

from egressgate.runtimes.base import GatewayEndpoints
from egressgate.runtimes.identity import MIN_UID, parse_range


class GatewayNotRunning(RuntimeError):
    """No usable runtime file: the gateway is not running with this var dir (or is too old)."""


class GatewayInfo(NamedTuple):  # not a dataclass: start-up budget (runtimes/base.py)
    endpoints: GatewayEndpoints
    pid: int
    subnet: str  # runtime.subnet: the address pool of sandbox links
    state_dir: Path  # runtime.state_dir: run records
    admin_token_file: Path
    audit_file: Path | None  # the local audit file, None when audit goes only to a collector
    docker_host: str | None = None  # runtime.docker_host: the daemon of --runtime docker|gvisor
    uid_range: tuple[int, int] = (MIN_UID, 99999)  # runtime.uid_range: each run's own host uid/gid


def split_hostport(value: str) -> tuple[str, int]:
    """"127.0.0.1:8080" / "[::1]:8080" → (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected host:port, got {value!r}")
    host = host.strip("[]")
    ipaddress.ip_address(host)
    return host, int(port)


def load(var_dir: Path) -> GatewayInfo:
    """Read `var_dir/gateway.json`; GatewayNotRunning (with what to do) when it is missing, unreadable,
    written by a gateway that no longer runs, or lacks a listener a runtime needs."""
    path = var_dir / "gateway.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GatewayNotRunning(f"{path} does not exist: start the gateway (`egressgate run`) with this "
                                "var dir, or pass --config/--var-dir of the running one") from None
    except (OSError, ValueError) as exc:
        raise GatewayNotRunning(f"cannot read {path}: {exc}") from None
    try:
        pid = int(data["pid"])
        runtime = data["runtime"]
        if data.get("dns") is None:
            raise GatewayNotRunning(f"the gateway of {path} runs no DNS resolver (listen.dns is null): a "
                                    "sandbox would have no way to resolve names; set listen.dns")
        transparent = data.get("transparent")
        info = GatewayInfo(
            endpoints=GatewayEndpoints(
                proxy=split_hostport(data["proxy"]),
                transparent=split_hostport(transparent) if transparent else None,
                dns=split_hostport(data["dns"]),
                admin=split_hostport(data["admin"]),
            ),
            pid=pid,
            subnet=str(runtime["subnet"]),
            state_dir=Path(runtime["state_dir"]),
            admin_token_file=Path(data["admin_token_file"]),
            audit_file=Path(data["audit_file"]) if data.get("audit_file") else None,
            docker_host=str(runtime["docker_host"]) if runtime.get("docker_host") else None,
            uid_range=parse_range(runtime["uid_range"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise GatewayNotRunning(f"{path} lacks {exc} (written by an older gateway? restart it)") from None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise GatewayNotRunning(f"{path} names gateway pid {pid}, which is not running: "
                                "start the gateway") from None
    except PermissionError:
        pass
    return info
