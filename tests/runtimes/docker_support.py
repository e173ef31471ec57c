"""Building blocks for the docker/gvisor adapter tests: a RunSpec without a gateway (the adapter alone,
no plumbing), and one call that runs it to the end and always tears down."""

from __future__ import annotations

import os
import time
from pathlib import Path

import trustme

from egressgate.runtimes.base import SANDBOX_UID, ExitInfo, RunSpec, SandboxAddress
from egressgate.runtimes.docker import DockerAdapter, GvisorAdapter
from tests.support.dockerd import Dockerd

ADAPTERS = {"docker": DockerAdapter, "gvisor": GvisorAdapter}


def make_spec(tmp: Path, image: str, command: list[str], *, sandbox: dict | None = None,
              deny: list[str] | None = None, env: dict[str, str] | None = None, runtime: str = "docker") -> RunSpec:
    ws = tmp / "ws"
    ws.mkdir(exist_ok=True)
    os.chown(ws, SANDBOX_UID, SANDBOX_UID)
    ca = tmp / "ca.pem"
    if not ca.exists():
        trustme.CA().cert_pem.write_to_path(str(ca))
    box = {"name": "egd-test", "root_fs": "read_only", "workspace": {"path": "/workspace"}, **(sandbox or {})}
    run_id = os.urandom(5).hex()
    return RunSpec(
        run_id=run_id, sandbox_id=f"sbx-{run_id}", runtime=runtime, command=tuple(command),
        env=env if env is not None else {"PATH": "/bin:/usr/bin", "HOME": "/workspace", "EGRESSGATE_SANDBOX_ID": "x"},
        policy={"sandbox": box, "filesystem": {"deny": deny if deny is not None else ["/etc/shadow"]},
                "execution": {}},
        address=SandboxAddress("198.18.200.1", "198.18.200.2", 30, f"egDh{run_id[:8]}", f"egDs{run_id[:8]}"),
        ca_bundle=ca, workspace=ws, image=image, state_dir=tmp / "state",
    )


def adapter(dockerd: Dockerd, runtime: str) -> DockerAdapter:
    return ADAPTERS[runtime](host=dockerd.host)


def run(dockerd: Dockerd, runtime: str, spec: RunSpec, wall: float | None = 60) -> ExitInfo:
    a = adapter(dockerd, runtime)
    try:
        a.prepare(spec)
        a.start()
        return a.wait(time.monotonic() + wall if wall else None)
    finally:
        a.teardown()
