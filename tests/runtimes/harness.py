"""The real gateway inside a test world, with loopback listeners (as `make run` binds them), and the real
`egressgate sandbox run` next to it in the world's gw namespace.

Each sandbox is a new network namespace hanging off gw through the run's veth; gw forwards to the net
namespace (canaries, upstreams, the world's DNS server), so a direct route WOULD reach the canaries: the
world's `open` namespace (same position, no egressgate rules) is the positive control.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tests.networld as nw
from tests.networld import World
from tests.runtimes.runids import RunIds
from tests.support.launcher import (
    EGRESSGATE,
    audit_records,
    launch_in_namespace,
    stop_process,
    write_policies,
)
from tests.support.replay_check import assert_config_replays

CALLER_SECRET = "AKIAEGNCALLERSECRET0123456789"  # in the caller's env: must never reach a sandbox
DENIED_FILE_NAME = "egN-denied.txt"  # a host file the runtime policies deny (the host_files fixture)


# Safety net of every `sandbox run` a test starts, independent of the code under test (PREAMBLE: no fork
# bomb or memory hog without one): limits set on `sandbox run` itself and inherited by the workload. The
# workload runs as its run's own uid (runtime.uid_range), for which RLIMIT_NPROC is enforced per run (it
# is not for root), and RLIMIT_AS caps every process of the tree. Far above the cgroup limits under test,
# far below what hurts the machine.
SAFETY_NPROC = 400
SAFETY_AS = 1536 * 2**20


def safety_net() -> None:
    resource.setrlimit(resource.RLIMIT_NPROC, (SAFETY_NPROC, SAFETY_NPROC))
    resource.setrlimit(resource.RLIMIT_AS, (SAFETY_AS, SAFETY_AS))


# a workspace `sandbox run --workspace` may keep across runs (persistent: false refuses --workspace)
KEPT_WORKSPACE = {"path": "/workspace", "persistent": True}


def runtime_policy(name: str, **extra: object) -> dict:
    """The runtime tests' base policy (workspace, denied host files, one allowed API) with `section__key=value`
    overrides, e.g. `sandbox__resources={"pids_max": 32}`."""
    body: dict = {
        "sandbox": {"name": name, "workspace": KEPT_WORKSPACE},
        "filesystem": {"deny": ["/etc/shadow", "/var/run/docker.sock"]},
        "network": {
            "allow_private": ["198.18.1.0/24"],
            "dns": {"allow": ["api.allowed.test"]},
            "https": {"allow": [{"id": "allowed-api", "host": "api.allowed.test"}]},
        },
    }
    for key, value in extra.items():
        section, _, field = key.partition("__")
        body.setdefault(section, {})[field] = value
    return body


@contextlib.contextmanager
def sandbox_world(tmp: Path) -> Iterator[World]:
    """A closed network world with the way back from the canaries to the sandboxes' subnet
    (runtime.subnet's default): without it no TCP handshake from a sandbox could complete even if the
    plumbing let it out, and the tests that prove nothing gets out would prove nothing."""
    w = World.create(tmp)
    try:
        w.exec(w.net, "ip", "route", "add", "198.18.128.0/17", "via", nw.GW_NET)
        yield w
    finally:
        w.close()


@contextlib.contextmanager
def running_gateway(world: World, policies: dict[str, dict[str, Any]],
                    runtime: dict[str, Any] | None = None, launcher: list[str] | None = None) -> Iterator[Gateway]:
    """The real gateway in the world's gw namespace, in a base_dir() removed afterwards (also when the
    gateway does not start); `runtime`: more keys of its runtime section (e.g. uid_range); `launcher`: the
    command that starts `egressgate` (launcher.launch_in_namespace)."""
    base = base_dir()
    try:
        gw = Gateway.start(world, base, policies, runtime, launcher)
    except BaseException:
        remove(base)
        raise
    finished = False
    try:
        yield gw
        finished = True
    finally:
        gw.stop()
        try:
            if finished:  # every decision its runs made replays the same under its policies (issue 23, item 1)
                assert_config_replays(gw.config)
        finally:
            remove(base)


def base_dir(parent: str | None = None) -> Path:
    """A temp dir any sandbox uid can traverse (pytest's tmp_path is under a 0700 dir): bwrap runs as that uid
    and opens the workspace by path."""
    path = Path(tempfile.mkdtemp(prefix="egN-", dir=parent))
    path.chmod(0o711)
    return path


@dataclass
class Gateway:
    world: World
    base: Path
    proc: subprocess.Popen[str]
    config: Path
    info: dict[str, Any]
    _stderr: Any = None
    extra: list[Any] = field(default_factory=list)
    # product netns that existed when the current test started (conftest.py): a run of an earlier test
    # still being torn down by its watchdog is not this test's leftover (runs.leftovers)
    netns_baseline: set[str] = field(default_factory=set)
    cgroup_baseline: set[str] = field(default_factory=set)  # the same for `egressgate/<id>` cgroups
    # every run id this gateway's runs wrote a record for (runids.py): leftover checks look only at those
    run_ids: RunIds | None = None

    @classmethod
    def start(cls, world: World, base: Path, policies: dict[str, dict[str, Any]],
              runtime: dict[str, Any] | None = None, launcher: list[str] | None = None) -> Gateway:
        pdir = write_policies(base / "policies", policies)
        config = {
            "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": "127.0.0.1:0",
                       "transparent": "127.0.0.2:0"},
            "dns": {"upstreams": [f"{nw.DNS_ADDR}:53"], "cache_min_ttl": 0},
            "policy": str(pdir),
            "var_dir": str(base / "var"),
            "upstream": {"resolver": f"{nw.DNS_ADDR}:53", "ca_bundle": str(world.ca_pem)},
            "runtime": {"state_dir": str(base / "state"), **(runtime or {})},
        }
        run_ids = RunIds(Path(config["runtime"]["state_dir"]) / "runs")  # before any run can start
        try:  # stderr: closed in stop()
            proc, info, cfg, stderr = launch_in_namespace(world, world.gw, base, config, launcher)
        except BaseException:
            run_ids.close()
            raise
        gw = cls(world=world, base=base, proc=proc, config=cfg, info=info, run_ids=run_ids)
        gw._stderr = stderr
        return gw

    def stop(self) -> None:
        stop_process(self.proc, timeout=10)
        if self._stderr is not None:
            self._stderr.close()
        if self.run_ids is not None:
            self.run_ids.close()

    def own_run_ids(self) -> set[str]:
        """The ids of every run this gateway's state dir has seen (runids.py)."""
        return self.run_ids.seen() if self.run_ids is not None else set()

    @property
    def state_dir(self) -> Path:
        return self.base / "state"

    @property
    def uid_range(self) -> tuple[int, int]:
        """The runtime.uid_range this gateway hands its runs' uids from (a test-private slice: launcher.py)."""
        first, last = json.loads((self.base / "var" / "gateway.json").read_text())["runtime"]["uid_range"].split("-")
        return int(first), int(last)

    @property
    def audit_path(self) -> Path:
        return self.base / "var" / "audit.jsonl"

    def cmd(self, *args: str) -> list[str]:
        """`egressgate ARGS` in the gw network namespace. nsenter, not `ip netns exec`: the latter also
        gives the command a private mount namespace, so the `ip netns add` of `sandbox run` would mount
        the sandbox's /run/netns entry where no other process (gc, the test) sees it."""
        return ["nsenter", f"--net=/run/netns/{self.world.gw}", EGRESSGATE, *args]

    def run_argv(self, *command: str, policy: str, workspace: Path | None = None,
                 labels: tuple[str, ...] = ()) -> list[str]:
        extra = ["--workspace", str(workspace)] if workspace else []
        for label in labels:
            extra += ["--label", label]
        return self.cmd("sandbox", "run", "--config", str(self.config), "--policy", policy, *extra, "--", *command)

    @staticmethod
    def caller_env() -> dict[str, str]:
        """The caller's environment, with secrets and proxy settings that must NOT reach the sandbox."""
        return {**os.environ, "AWS_SECRET_ACCESS_KEY": CALLER_SECRET, "HTTP_PROXY": "http://198.18.0.2:1",
                "NO_PROXY": "*"}

    def run(self, *command: str, policy: str, workspace: Path | None = None, timeout: float = 60,
            labels: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.run_argv(*command, policy=policy, workspace=workspace, labels=labels),
                              capture_output=True, text=True, timeout=timeout, env=self.caller_env(), check=False,
                              preexec_fn=safety_net)

    def popen_run(self, *command: str, policy: str, **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(self.run_argv(*command, policy=policy), text=True, env=self.caller_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=safety_net, **kw)

    def records(self, timeout: float = 5.0, predicate: Any = None) -> list[dict[str, Any]]:
        """Flattened audit records; waits (batched writer) until one matches `predicate` if given."""
        deadline = time.monotonic() + timeout
        while True:
            out = audit_records(self.audit_path) if self.audit_path.exists() else []
            if predicate is None or any(predicate(r) for r in out) or time.monotonic() > deadline:
                return out
            time.sleep(0.1)


def sandbox_id(stderr: str) -> str:
    for word in stderr.split():
        if word.startswith("sbx-"):
            return word
    raise AssertionError(f"no sandbox id in: {stderr}")


class Canary:
    """A TCP or UDP canary the test owns inside a world namespace: records every accept/datagram."""

    def __init__(self, world: World, ns: str, host: str, port: int, udp: bool = False) -> None:
        self.hits: list[tuple[str, int]] = []
        kind = socket.SOCK_DGRAM if udp else socket.SOCK_STREAM

        def make() -> socket.socket:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            if not udp:
                sock.listen(16)
            return sock

        self.sock = world.in_ns(ns, make)
        self.sock.settimeout(0.2)
        self.udp = udp
        self.closed = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.closed:
            try:
                if self.udp:
                    _, peer = self.sock.recvfrom(65536)
                else:
                    conn, peer = self.sock.accept()
                    conn.close()
            except TimeoutError:
                continue
            except OSError:
                return
            self.hits.append(peer[:2])

    def close(self) -> None:
        self.closed = True
        self.thread.join(2)
        self.sock.close()


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
