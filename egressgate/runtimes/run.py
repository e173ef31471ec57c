"""`egressgate sandbox run`: admission → adapter.prepare → plumbing → limits → start → wait → teardown →
revocation with the outcome. Every run is a NEW admission (new id, token, phantom credentials); only the
workspace directory survives ("preserve state without preserving authority").

Fail closed: any failure before the workload starts ends the run with EXIT_SETUP_FAILED (120) and one
sentence on stderr; teardown runs whatever happened (each step idempotent), and the run record names
every host object before it is created so the run's watchdog (runtimes/watchdog.py), or `sandbox gc`
if the watchdog is gone too, can clean up after a SIGKILL. Stdlib only at
import time: the CLI's start-up is measured (loadtests/).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from egressgate.runtimes import addressing, endpoints, records
from egressgate.runtimes.base import (
    ExitInfo,
    Limit,
    RunSpec,
)
from egressgate.runtimes.workload import (
    SetupFailed,
    check_command,
    inside_env,
    prepare_workspace,
    resolve_workspace,
)


class RunRequest(NamedTuple):  # not a dataclass: start-up budget (runtimes/base.py)
    policy: str
    runtime: str
    command: tuple[str, ...]
    var_dir: Path
    workspace: Path | None = None
    image: str | None = None
    labels: Mapping[str, str] = MappingProxyType({})  # read-only: a NamedTuple default is shared
    workspace_name: str | None = None  # --workspace NAME: kept by the runtime (runtimes/workspaces.py)
    accept_changes: bool = False  # --accept-changes: a workspace changed outside a run is restored anyway
    approval_ttl: int | None = None  # --approval-ttl: how long a staged persistent write waits (seconds)


def log(message: str) -> None:
    print(f"egressgate: {message}", file=sys.stderr, flush=True)


# EGRESSGATE_RUN_TIMING=1: one stderr line with the milliseconds of each phase (loadtests/RESULTS.md)
TIMING = os.environ.get("EGRESSGATE_RUN_TIMING") == "1"


class Run:
    """One `sandbox run` (see the module docstring)."""

    def __init__(self, req: RunRequest) -> None:
        self.req = req
        self.info: endpoints.GatewayInfo | None = None
        self.run_id = records.new_run_id()
        self.sandbox_id: str | None = None
        self.adapter: Any = None
        self.plumbing: Any = None
        self.limits: Any = None
        self.watch: Any = None
        self.disks: Any = None
        self.started = False
        self.signal: int | None = None
        self.temp_workspace: Path | None = None
        self.uid: int | None = None  # the run's own host uid/gid (runtimes/identity.py)
        self.workspace: Path | None = None  # a persistent --workspace (given back to root at teardown)
        self.persist: Any = None  # persistence and restore of a persistent workspace (runtimes/persist.py)
        self.lock_fd: int | None = None  # the run's host-wide liveness lock (runtimes/runlock.py)
        self._marks: list[tuple[str, float]] = [("start", time.monotonic())]

    def mark(self, phase: str) -> None:
        if TIMING:
            self._marks.append((phase, time.monotonic()))

    # ------------------------------------------------------------------------------ admin API
    def _admin(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        from egressgate.runtimes.adminapi import AdminUnreachable, call

        assert self.info is not None
        try:
            token = self.info.admin_token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise SetupFailed(f"cannot read the admin token {self.info.admin_token_file}: {exc.strerror}") from None
        try:
            return call(self.info.endpoints.admin, method, path, token, body)
        except AdminUnreachable as exc:
            raise SetupFailed(str(exc)) from None

    # ------------------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, _frame: object) -> None:
        """SIGINT/SIGTERM/SIGHUP: kill the sandbox now; the main flow tears down and revokes."""
        self.signal = signum
        if self.adapter is not None and self.started:
            self.adapter.kill()

    def _interrupted(self) -> None:
        if self.signal is not None:
            raise SetupFailed(f"interrupted by signal {self.signal} before the workload started")

    # ------------------------------------------------------------------------------ the run
    def execute(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        begin = time.monotonic()
        exit_info: ExitInfo | None = None
        try:
            exit_info = self._run()
        except SetupFailed as exc:
            log(f"setup failed: {exc}")
        except Exception as exc:  # any other failure before/while starting is a setup failure too
            log(f"setup failed: {type(exc).__name__}: {exc}")
        finally:
            code = self._teardown(exit_info, int((time.monotonic() - begin) * 1000))
        return code

    def make_adapter(self, runtime: str) -> Any:
        """The runtime's adapter (`egressgate mcp run` subclasses the netns one to relay its stdio)."""
        from egressgate.runtimes import registry

        return registry.adapter(runtime)

    def _run(self) -> ExitInfo:
        from egressgate.runtimes import registry

        req = self.req
        try:
            self.info = info = endpoints.load(req.var_dir)
        except endpoints.GatewayNotRunning as exc:
            raise SetupFailed(str(exc)) from None
        try:
            self.adapter = self.make_adapter(req.runtime)
        except registry.UnknownRuntime as exc:
            raise SetupFailed(str(exc)) from None
        if info.docker_host and hasattr(self.adapter, "host"):  # docker/gvisor: the configured daemon wins
            self.adapter.host = info.docker_host
        from egressgate.runtimes import runlock
        from egressgate.runtimes.identity import UidsExhausted

        try:  # before the first host object: gc counts the run as live, whatever state dir it reads
            self.lock_fd = runlock.hold(self.run_id)
        except runlock.LockFailed as exc:
            raise SetupFailed(str(exc)) from None
        try:
            address, uid = addressing.allocate_run(
                info.state_dir, info.subnet, self.run_id,
                {"owner_pid": os.getpid(), "runtime": req.runtime, "created": time.time(),
                 "var_dir": str(req.var_dir.absolute())}, info.uid_range)
        except (addressing.AddressesExhausted, UidsExhausted) as exc:
            raise SetupFailed(str(exc)) from None
        assert uid is not None
        self.uid = uid
        self.mark("allocate")
        # from here on host objects exist: the watchdog cleans them up if this process dies by SIGKILL
        from egressgate.runtimes import watchdog

        watchdog_pid = watchdog.start(info.state_dir, self.run_id, req.var_dir.absolute(), self.lock_fd)
        self.mark("watchdog")
        status, data = self._admin("POST", "/v1/sandboxes", {"policy": req.policy, "labels": req.labels,
                                                             "addresses": [address.sandbox_ip]})
        if status != 201:
            raise SetupFailed(f"admission refused ({status}): {data.get('message') or data.get('error')}")
        self.sandbox_id = data["id"]
        records.update(info.state_dir, self.run_id, sandbox_id=self.sandbox_id, watchdog_pid=watchdog_pid)
        audit = info.audit_file or "the gateway's OTLP collector (audit.file is off)"
        log(f"sandbox {self.sandbox_id} (run {self.run_id}, {req.runtime}, {address.sandbox_ip}); "
            f"audit records: {audit}")
        policy = data.get("runtime_policy")
        if not isinstance(policy, dict):
            raise SetupFailed("the gateway's admission has no runtime_policy; upgrade the gateway")
        self._check_keys(policy)
        check_command(req.command, policy.get("execution") or {})
        sandbox = policy.get("sandbox") or {}
        ws_policy = sandbox.get("workspace") or {}
        workspace = req.workspace
        if (workspace is not None or req.workspace_name) and not ws_policy.get("path"):
            raise SetupFailed(f"--workspace given but policy {req.policy!r} has no sandbox.workspace.path")
        if (workspace is not None or req.workspace_name) and not ws_policy.get("persistent"):
            # persistent: false means every run starts from an empty workspace: a kept one would carry state
            raise SetupFailed(f"--workspace keeps a workspace across runs but policy {req.policy!r} has "
                              "sandbox.workspace.persistent: false; drop --workspace or set persistent: true")
        kinds = (policy.get("execution") or {}).get("require_approval_for") or []
        if req.workspace_name or (workspace is not None and (policy.get("persistence")
                                                             or "persistent_write" in kinds)):
            from egressgate.runtimes.persist import Persist

            self.persist = Persist(self, policy, data)
            path = resolve_workspace(workspace, info.uid_range) if workspace is not None else None
            workspace = self.persist.open(req.workspace_name, path)
        if workspace is None and ws_policy.get("path"):
            (info.state_dir / "workspaces").mkdir(mode=0o711, exist_ok=True)
            info.state_dir.chmod(0o711)  # traversable (not listable) by the sandbox uid; records stay 0700
            workspace = self.temp_workspace = info.state_dir / "workspaces" / self.run_id
            records.update(info.state_dir, self.run_id, temp_workspace=str(workspace))
        if workspace is not None:
            # checked (and resolved) before anything is mounted on it; no owner changes yet
            workspace = resolve_workspace(workspace, info.uid_range)
            if self.temp_workspace is None:  # persistent: handed back to root at the end (release_workspace)
                # named before its entries change hands: the teardown, watchdog or gc gives them back
                self.workspace = workspace
                records.update(info.state_dir, self.run_id, workspace=str(workspace))
        tmp_dir = self._disks(workspace, ws_policy, sandbox)
        if self.persist is not None and workspace is not None:
            self.persist.restore(workspace)  # the content as the last run left it, before anyone owns it
            if req.workspace_name:  # the var dir stays 0700: the sandbox gets the data through a bind mount
                workspace = self.persist.expose(self.disks, info.state_dir, workspace)
        if workspace is not None:
            # the run's uid takes over the workspace as the sandbox will see it: the bounded tmpfs or the
            # mounted ext4 image's root and content when max_bytes is set, else the directory itself
            workspace = prepare_workspace(workspace, uid, info.uid_range)
        if getattr(self.adapter, "nosuid_binds", False):  # a container runtime binds host paths as they are:
            self.adapter.nosuid_bind = self._nosuid_bind  # read-write ones from a nosuid,nodev bind (diskfs.py)
            if workspace is not None and self.disks.workspace_mount is None:  # (a bounded one is such a mount)
                workspace = self._nosuid_bind(workspace)
        env, bundle = inside_env(data, address, info.endpoints.proxy[1],
                                 ws_policy.get("path") or "/tmp")  # noqa: S108 - HOME inside
        spec = RunSpec(run_id=self.run_id, sandbox_id=self.sandbox_id, runtime=req.runtime, command=req.command,
                       env=env, policy=policy, address=address, ca_bundle=bundle, workspace=workspace,
                       workspace_persistent=workspace is not None and self.temp_workspace is None,
                       image=req.image, labels=dict(req.labels), state_dir=info.state_dir, tmp_dir=tmp_dir,
                       uid=uid, gid=uid)
        self._interrupted()
        self.mark("admission")
        self.adapter.prepare(spec)
        self._interrupted()
        self.mark("prepare")
        from egressgate.runtimes.plumbing import Plumbing

        self.plumbing = Plumbing(self.run_id, address, info.endpoints)
        records.update(info.state_dir, self.run_id, **self.plumbing.host_objects())
        self.plumbing.attach(self.adapter.netns_path())
        self.mark("plumbing")
        resources = sandbox.get("resources") or {}
        self._limits(resources)
        self._interrupted()
        wall = resources.get("wall_time_seconds")
        self.adapter.start()
        self.started = True
        deadline = time.monotonic() + wall if wall else None
        self.watch = self.disks.watch(self.adapter.kill)  # the kernel refuses the bytes; this ends the run
        if self.signal is not None:  # arrived between start() and here
            self.adapter.kill()
        self.mark("start")
        result = self.adapter.wait(deadline)
        self.mark("wait")
        limit = result.limit
        if limit is None and self.limits is not None:
            limit = self.limits.hit()
        if limit is None and ((self.watch is not None and self.watch.exceeded) or self.disks.full()):
            limit = Limit.WORKSPACE_BYTES
        if limit is not None and limit is not result.limit:
            result = ExitInfo(status=result.status, signal=result.signal, limit=limit)
        return result

    def enforced_keys(self) -> frozenset[str]:
        """The runtime keys this run's runtime declares it enforces (runtimes/registry.py)."""
        from egressgate.runtimes.registry import ENFORCES

        return ENFORCES.get(self.req.runtime, frozenset())

    def _check_keys(self, policy: dict[str, Any]) -> None:
        """Refuse (exit 120) before anything is prepared when the policy sets a key this runtime does not
        enforce, or one nothing enforces (policy/enforcement.py): never a sandbox with a silent key."""
        from egressgate.policy.enforcement import refusal, unenforced

        keys = policy.get("keys")
        if not isinstance(keys, list):
            raise SetupFailed("the gateway's admission does not list the policy's runtime keys; upgrade the gateway")
        enforces = {self.req.runtime: self.enforced_keys()}
        missing = unenforced(keys, self.req.runtime, enforces)
        if missing:
            from egressgate.runtimes.registry import ENFORCES

            raise SetupFailed(refusal(missing, self.req.runtime, {**ENFORCES, **enforces}))

    def _disks(self, workspace: Path | None, ws_policy: dict[str, Any], sandbox: dict[str, Any]) -> Path | None:
        """Kernel-bounded file systems (diskfs.py): the workspace when max_bytes is set (a tmpfs for a
        temporary one, the loop-mounted ext4 image of a persistent one) and, for netns, /tmp; returns the
        host dir of that /tmp. Docker and gVisor size their own /tmp (docker.py)."""
        from egressgate.runtimes.diskfs import DEFAULT_TMP_MAX_BYTES, DiskLimitError, DiskLimits

        assert self.info is not None and self.uid is not None
        uid = self.uid  # every mount is the run's own (runtimes/identity.py), never the shared 65534
        self.disks = DiskLimits(self.run_id, self.info.state_dir)
        if self.req.runtime == "microvm":  # the workspace is an image of max_bytes, /tmp the guest's tmpfs
            return None
        try:
            max_bytes = ws_policy.get("max_bytes")
            if max_bytes and workspace is not None:
                if self.temp_workspace is not None:
                    self.disks.temporary_workspace(workspace, int(max_bytes), uid)
                else:
                    self.disks.persistent_workspace(workspace, int(max_bytes), uid)
            if self.req.runtime == "netns":
                from egressgate.runtimes.workload import unreachable_parent

                self.info.state_dir.chmod(0o711)  # traversable (not listable) by the sandbox uid; records 0700
                if unreachable_parent(self.info.state_dir / "tmp", uid) is None:  # else bwrap --size tmpfs
                    tmp_bytes = int((sandbox.get("tmp") or {}).get("max_bytes") or DEFAULT_TMP_MAX_BYTES)
                    return self.disks.tmp(tmp_bytes, uid, uid)
        except DiskLimitError as exc:
            raise SetupFailed(str(exc)) from None
        return None

    def _nosuid_bind(self, source: Path) -> Path:
        from egressgate.runtimes.diskfs import DiskLimitError

        try:
            return self.disks.nosuid_bind(source)
        except DiskLimitError as exc:
            raise SetupFailed(str(exc)) from None

    def _limits(self, resources: dict[str, Any]) -> None:
        wanted = {k: v for k, v in resources.items() if k in ("memory_mb", "pids_max", "cpu_millis") and v}
        if self.req.runtime == "microvm":  # QEMU's own cgroup, always (the guest enforces the workload's)
            from egressgate.runtimes.microvm.guest import host_limits

            wanted = host_limits(resources)
        elif not wanted or self.req.runtime != "netns":  # containers get docker flags from their adapter
            return
        try:
            from egressgate.runtimes.limits import LimitsUnavailable, ResourceLimits
        except ImportError as exc:
            raise SetupFailed(f"the policy sets resources {sorted(wanted)} but resource limits are not "
                              f"available in this build ({exc})") from None
        assert self.info is not None
        try:
            self.limits = ResourceLimits.create(self.run_id, wanted)
        except LimitsUnavailable as exc:
            raise SetupFailed(str(exc)) from None
        records.update(self.info.state_dir, self.run_id, cgroups=self.limits.paths())
        self.adapter.preexec = self.limits.preexec()
        if hasattr(self.adapter, "on_kill"):
            self.adapter.on_kill = self.limits.kill_all

    def _teardown(self, exit_info: ExitInfo | None, duration_ms: int) -> int:
        from egressgate.runtimes.run_end import end_run

        return end_run(self, exit_info, duration_ms)


def run(req: RunRequest) -> int:
    return Run(req).execute()
