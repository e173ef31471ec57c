"""The contract between `egressgate sandbox run` and the runtimes that host a workload.

A run is: admission (new sandbox id, token, phantom credentials) → `adapter.prepare()` (the workload's
network namespace exists, the workload has NOT started) → network plumbing attached to that namespace
(runtimes/plumbing.py: veth + nftables, the same for every runtime) → limits → `adapter.start()` →
`adapter.wait()` → teardown (plumbing, limits, the adapter's leftovers, revocation). Splitting "create the
namespace" from "start the workload" is what lets one plumbing serve every runtime without a window in
which the workload runs before its only way out is in place.

Everything a run creates on the host is recorded in a `RunRecord` file before it is created, so
`sandbox gc` can remove the leftovers of a run killed with SIGKILL.

The value types below are immutable `typing.NamedTuple`s, not frozen dataclasses: importing dataclasses
pulls in inspect and ast, ~20 ms of every `sandbox run` start-up (loadtests/RESULTS.md).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple, Protocol


class Limit(enum.StrEnum):
    """A resource limit that ended a run; each has its own exit status (documented in docs/runtimes.md)."""

    MEMORY = "memory"
    PIDS = "pids"
    WALL_TIME = "wall_time"
    WORKSPACE_BYTES = "workspace_bytes"


# where every runtime mounts the sandbox CA bundle (read-only); admission's CA variables point here
CA_PATH_IN_SANDBOX = "/etc/egressgate/ca.pem"
# `nobody`: the uid/gid a netns workload SEES itself as inside its user namespace (every /etc/passwd
# knows it), and the host uid of a RunSpec built outside `sandbox run` (adapter tests). `sandbox run`
# gives every run its own HOST uid/gid from runtime.uid_range (runtimes/identity.py, RunSpec.uid): never
# root, so owner-only host files stay unreadable, and never another sandbox's, so sandboxes cannot read,
# signal or trace each other
SANDBOX_UID = 65534

# `sandbox run` exits with the workload's status (128+N when a signal N killed it) unless one of these
# says egressgate itself ended the run. 124 is what coreutils `timeout` uses for the same event.
EXIT_SETUP_FAILED = 120  # gateway unreachable, admission refused, runtime or plumbing failed to start
EXIT_BY_LIMIT: dict[Limit, int] = {
    Limit.MEMORY: 121,
    Limit.PIDS: 122,
    Limit.WORKSPACE_BYTES: 123,
    Limit.WALL_TIME: 124,
}


class GatewayEndpoints(NamedTuple):
    """Where the running gateway listens (from its runtime file `var_dir/gateway.json`)."""

    proxy: tuple[str, int]  # explicit proxy (HTTP_PROXY)
    # transparent listener: every other TCP connection is sent here; None when the gateway runs none
    # (`listen.transparent: null`): then every other TCP connection is refused (fail closed)
    transparent: tuple[str, int] | None
    dns: tuple[str, int]  # the DNS resolver (UDP and TCP)
    admin: tuple[str, int]


class SandboxAddress(NamedTuple):
    """The point-to-point link between the host and one sandbox (a /30 of the runtime subnet)."""

    host_ip: str  # the host end of the veth: the sandbox's default gateway, resolver and proxy address
    sandbox_ip: str  # the sandbox end: the source address the gateway identifies the sandbox by
    prefix_len: int
    host_if: str  # interface names (≤ 15 bytes), derived from the run id
    sandbox_if: str


class RunSpec(NamedTuple):
    """What the operator asked for plus what admission handed out (the policy's runtime sections come
    from the gateway, so the runtime enforces the same policy version the gateway decides with)."""

    run_id: str  # short, unique on this host; names every host object of the run
    sandbox_id: str
    runtime: str  # netns | docker | gvisor | microvm
    command: tuple[str, ...]
    env: dict[str, str]  # ONLY what admission handed out (rewritten for inside the sandbox); nothing inherited
    policy: dict  # admission's `runtime_policy`: {"sandbox": ..., "filesystem": ..., "execution": ...}
    address: SandboxAddress
    ca_bundle: Path  # host path of the sandbox CA bundle; mounted read-only inside
    workspace: Path | None = None  # host directory bind-mounted read-write at sandbox.workspace.path
    workspace_persistent: bool = False  # --workspace (a name or a directory): kept after the run, not temporary
    image: str | None = None  # docker/gvisor: the container image; microvm: the root image (ext4 file or dir)
    labels: Mapping[str, str] = MappingProxyType({})  # read-only: a NamedTuple default is shared
    state_dir: Path = Path("/run/egressgate")  # run records, barrier files, generated resolv.conf/hosts
    tmp_dir: Path | None = None  # netns: host dir of the run's bounded /tmp tmpfs (diskfs.py), bound at /tmp
    uid: int = SANDBOX_UID  # the workload's HOST uid and gid: the run's own, from runtime.uid_range
    gid: int = SANDBOX_UID


class ExitInfo(NamedTuple):
    """How the workload ended."""

    status: int | None  # exit status when it exited
    signal: int | None = None  # the signal that killed it
    limit: Limit | None = None  # the limit that made egressgate (or the kernel) kill it

    def exit_code(self) -> int:
        if self.limit is not None:
            return EXIT_BY_LIMIT[self.limit]
        if self.signal is not None:
            return 128 + self.signal
        return self.status if self.status is not None else EXIT_SETUP_FAILED


class RuntimeAdapter(Protocol):
    """One runtime. Methods are called in this order; `teardown` is called whatever happened before it
    (also after a failed `prepare`) and must be idempotent."""

    name: str

    def prepare(self, spec: RunSpec) -> None:
        """Create the sandbox (namespace, container, mounts) without starting the workload."""

    def netns_path(self) -> str:
        """The sandbox's network namespace (`/run/netns/NAME` or `/proc/PID/ns/net`), valid after prepare."""

    def start(self) -> None:
        """Let the workload run (the plumbing is in place)."""

    def wait(self, deadline: float | None) -> ExitInfo:
        """Block until the workload ends or `deadline` (time.monotonic()) passes; past it, kill the whole
        process tree and report Limit.WALL_TIME."""

    def kill(self) -> None:
        """Kill every process of the sandbox now (used on limits and on SIGINT/SIGTERM of `sandbox run`)."""

    def teardown(self) -> None:
        """Remove everything prepare created."""
