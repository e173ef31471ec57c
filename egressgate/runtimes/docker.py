"""`--runtime docker` and `--runtime gvisor`: the workload in a Docker container (runc, or gVisor's
`runsc` as Docker runtime), attached to the network only through the shared plumbing.

How the workload is held until `start()`: the container is created AND started in `prepare`, because
its network namespace exists only while it runs, but its entrypoint is the host's static busybox
(mounted read-only), looping until a file appears in a read-only bind-mounted directory, then
exec-ing the command. A FIFO would wake it sooner but gVisor's gofer refuses to open host FIFOs
(EPERM); a polled file works under both runc and runsc (verified), for a start latency of ≤ 10 ms.
Nothing of the image runs before the file exists, and only root on the host can create it.

Isolation (each rule enforced here, in the containers/create request of the Engine API, sent over the
daemon's unix socket by runtimes/dockerapi.py; no docker CLI is forked):
* NetworkMode `none`: the container's namespace has only `lo` until the plumbing adds its veth;
* CapDrop ALL, SecurityOpt no-new-privileges, User <the run's own uid>:<gid> (RunSpec.uid, from
  runtime.uid_range; no user-namespace remapping, so host-visible files in the bound workspace are owned
  per sandbox), Init: no capability (no raw sockets, no route or nftables changes), setuid binaries do
  not raise privileges, never root, never another sandbox's uid, and a PID 1 that forwards signals and reaps;
* SecurityOpt seccomp=<the profile of seccompjson.py> instead of the daemon's default: socket families
  by allowlist (no vsock), no io_uring, bpf, keyrings, ptrace, namespaces (the netns runtime's table;
  gVisor applies it only with runsc's --oci-seccomp, so the gvisor adapter refuses a daemon without it);
  runc gives the container a new session keyring of its own (the caller's is not reachable);
* ReadonlyRootfs when `sandbox.root_fs: read_only`; tmpfs `/tmp` owned by the run's uid/gid; the workspace
  read-write at `sandbox.workspace.path`, bound from a nosuid,nodev mount (`sandbox run` makes one when the
  workspace is not already: diskfs.nosuid_bind; Docker's binds have no such option); the CA bundle (at every
  system trust path and as the OpenSSL hashed directory /etc/ssl/certs: truststore.py), `/etc/resolv.conf`
  (`nameserver <host_ip>`) and `/etc/hosts` bind-mounted read-only;
* `filesystem.deny` paths and the docker/containerd sockets are covered by an empty read-only file or
  directory (mode 000 / 555, owned by root); no docker.sock is ever mounted;
* resources from `sandbox.resources` (runtimes/limits.py `docker_flags`, translated to HostConfig by
  `host_config_limits`); the environment is exactly RunSpec.env, in the request body (never on a
  command line other users can read in /proc).

Every container carries the label `egressgate.run=<run_id>` and is named `egressgate-<run_id>`, so
`sandbox gc` finds leftovers by label even when the run record is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from egressgate.runtimes import dockermasks, records, sandbox_fs, seccompjson, truststore
from egressgate.runtimes.base import ExitInfo, Limit, RunSpec
from egressgate.runtimes.diskfs import DEFAULT_TMP_MAX_BYTES, tmpfs_options
from egressgate.runtimes.dockerapi import (
    DEFAULT_DOCKER_HOST,
    DockerAPI,
    DockerError,
    bind,
    host_config_limits,
    write_all,
)
from egressgate.runtimes.dockerwatch import CgroupWatch

__all__ = ["DEFAULT_DOCKER_HOST", "DockerAdapter", "DockerError", "GvisorAdapter", "docker_host"]

BUSYBOX = "/usr/bin/busybox"  # Debian busybox-static: runs in any image
LABEL = "egressgate.run"
NAME_PREFIX = "egressgate-"
INSIDE = "/.egressgate"  # where the holder and its barrier directory are mounted
HOLD = f'while [ ! -e {INSIDE}/hold/go ]; do usleep 10000; done; exec "$@"'
ALWAYS_MASKED = ("/var/run/docker.sock", "/run/docker.sock", "/run/containerd/containerd.sock")


def docker_host() -> str:
    """The daemon `sandbox run` talks to: $DOCKER_HOST, else Docker's default socket (run.py puts the
    gateway's runtime.docker_host first)."""
    return os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST


class DockerAdapter:
    """One container per run; see the module docstring for what it isolates and how it is held."""

    name = "docker"
    oci_runtime: str | None = None  # None = the daemon's default (runc)
    nosuid_binds = True  # `sandbox run` hands over the workspace as a nosuid,nodev mount (diskfs.nosuid_bind)

    def __init__(self, host: str | None = None) -> None:
        self.host = host or docker_host()
        self.container: str | None = None
        self.pid: int | None = None
        self.run_dir: Path | None = None
        self._cgroups: CgroupWatch | None = None
        self._killed_by: Limit | None = None
        self._logs: threading.Thread | None = None
        self._close_logs = lambda: None
        self._api: DockerAPI | None = None
        # set by `sandbox run` (diskfs.nosuid_bind): a read-write host path is bound from a nosuid,nodev
        # bind of it (Docker's binds take no such option; a read-write bind keeps its source mount's flags)
        self.nosuid_bind: Callable[[Path], Path] | None = None

    @property
    def api(self) -> DockerAPI:
        """The client of self.host (created on first use: run.py may replace host after __init__)."""
        if self._api is None or self._api.host != self.host:
            self._api = DockerAPI(self.host)
        return self._api

    # ------------------------------------------------------------------------------ prepare
    def limit_flags(self, resources: dict) -> list[str]:
        """Docker's flags for `sandbox.resources` (runtimes/limits.py). No limit set: nothing to translate,
        and limits.py (with cgroups.py, ~10 ms of imports) stays out of `sandbox run`'s start-up."""
        if all(value is None for value in resources.values()):
            return []
        from egressgate.runtimes.limits import docker_flags

        return docker_flags(resources)

    def prepare(self, spec: RunSpec) -> None:
        if not spec.image:
            raise DockerError(f"--runtime {self.name} needs --image (the container image to run)")
        if not Path(BUSYBOX).is_file():
            raise DockerError(f"{BUSYBOX} is missing: install Debian busybox-static (it holds the workload)")
        api = self.api  # refuses a non-unix host before anything is created
        self.container = NAME_PREFIX + spec.run_id
        self.run_dir = run_dir = spec.state_dir / "docker" / spec.run_id
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        hold = run_dir / "hold"
        hold.mkdir(mode=0o755, exist_ok=True)
        hold.chmod(0o755)
        (hold / "go").unlink(missing_ok=True)
        config = self.create_config(spec, run_dir)
        # recorded before it exists: `sandbox gc` removes it if this process dies from here on
        records.update(spec.state_dir, spec.run_id, **self.record())
        api.create(self.container, config)
        api.start(self.container)  # only the holder runs
        state = api.inspect(self.container).get("State") or {}
        if not state.get("Running") or not state.get("Pid"):
            raise DockerError(f"container {self.container} did not stay running: {state.get('Error') or state}")
        self.pid = int(state["Pid"])
        # fail closed if the container somehow shares our network namespace (e.g. a daemon default of
        # --network host): the plumbing would then route the host, not the sandbox
        if os.readlink(f"/proc/{self.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            raise DockerError(f"container {self.container} shares the caller's network namespace")
        # the kernel's pids and OOM-kill counters of its cgroups, read while they exist (dockerwatch.py)
        self._cgroups = CgroupWatch(self.pid).start()
        # the workload's stdout/stderr become ours (the log stream replays from the container's start, so
        # nothing written before it connects is lost; the holder itself writes nothing). A thread, not a
        # process: it dies with `sandbox run`, even by SIGKILL, and never prints an orphan's output.
        self._close_logs, frames = api.log_stream(self.container)
        self._logs = threading.Thread(target=_copy_frames, args=(frames,), daemon=True)
        self._logs.start()

    def create_config(self, spec: RunSpec, run_dir: Path) -> dict:
        """The containers/create body (pure apart from the files it writes into run_dir)."""
        sandbox = spec.policy.get("sandbox") or {}
        ws_path = (sandbox.get("workspace") or {}).get("path")
        hostname = str(sandbox.get("name") or "sandbox")
        etc = {
            "resolv.conf": f"nameserver {spec.address.host_ip}\noptions edns0\n",
            "hosts": f"127.0.0.1\tlocalhost\n{spec.address.sandbox_ip}\t{hostname}\n",
        }
        for name, text in etc.items():
            (run_dir / name).write_text(text)
            (run_dir / name).chmod(0o444)
        env: list[str] = []
        for key, value in spec.env.items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise DockerError(f"environment variable {key!r} cannot be passed to docker ('=' or NUL)")
            env.append(f"{key}={value}")
        # the trust store at every path the image's TLS libraries read by default (truststore.py), over
        # whatever the image brought: its own roots are not the sandbox's trust
        trust = truststore.host_tree(spec.ca_bundle.read_bytes(), run_dir / "certs", spec.state_dir)
        mounts = [
            bind(BUSYBOX, f"{INSIDE}/busybox"),
            bind(run_dir / "hold", f"{INSIDE}/hold"),
            bind(run_dir / "certs", truststore.HASHED_DIR),
            *(bind(trust, path) for path in truststore.OTHER_FILES),
            bind(run_dir / "resolv.conf", "/etc/resolv.conf"),
            bind(run_dir / "hosts", "/etc/hosts"),
        ]
        config: dict = {
            "Image": spec.image, "Hostname": hostname, "User": f"{spec.uid}:{spec.gid}", "Env": env,
            "Labels": {LABEL: spec.run_id, "egressgate.sandbox": spec.sandbox_id},
            "Entrypoint": [f"{INSIDE}/busybox"],
            "Cmd": ["sh", "-c", HOLD, "egressgate-hold", *spec.command],
            "AttachStdin": False, "AttachStdout": False, "AttachStderr": False, "Tty": False, "OpenStdin": False,
        }
        host: dict = {
            "NetworkMode": "none", "CapDrop": ["ALL"], "Init": True,
            "SecurityOpt": ["no-new-privileges", seccompjson.security_opt(unix_sockets=True, runtime=self.oci_runtime)],
            "ReadonlyRootfs": sandbox.get("root_fs", "read_only") == "read_only",
            # the container's own /tmp, size- and inode-bounded (sandbox.tmp.max_bytes, diskfs.py) and the
            # run's own like the netns runtime's (owned by its uid/gid, not root's 1777 shared by every uid)
            "Tmpfs": {"/tmp": tmpfs_options(int((sandbox.get("tmp") or {}).get("max_bytes")  # noqa: S108
                                                or DEFAULT_TMP_MAX_BYTES))
                      + f",mode=1777,uid={spec.uid},gid={spec.gid}"},
            "Mounts": mounts,
        }
        if spec.workspace is not None:
            if not ws_path:
                raise DockerError("a workspace was given but the policy has no sandbox.workspace.path")
            mounts.append(bind(spec.workspace, ws_path, readonly=False))
            config["WorkingDir"] = ws_path
        trees = [(spec.workspace, ws_path)] if spec.workspace is not None and ws_path else []
        for path, writable in sandbox_fs.host_allow_entries(spec.policy):  # the policy's host paths
            source = os.path.realpath(path)
            sandbox_fs.check_no_channel(source)  # no host socket, device or FIFO (exit 120)
            if os.path.exists(source):
                bound = self.nosuid_bind(Path(source)) if writable and self.nosuid_bind else Path(source)
                mounts.append(bind(bound, path, readonly=not writable))
                trees.append((Path(source), path))
        deny = list(dict.fromkeys([*ALWAYS_MASKED, *((spec.policy.get("filesystem") or {}).get("deny") or [])]))
        kinds = dockermasks.kinds(self.api, spec.image or "", deny, self.oci_runtime, spec.state_dir, trees)
        mounts += dockermasks.mounts(kinds, run_dir)
        if self.oci_runtime:
            host["Runtime"] = self.oci_runtime
        host.update(host_config_limits(self.limit_flags(sandbox.get("resources") or {})))
        config["HostConfig"] = host
        return config

    def _inspect(self) -> dict:
        return self.api.inspect(self.container or "")

    def netns_path(self) -> str:
        """/proc/<pid>/ns/net of the container's first process (runc: docker-init; runsc: the sandbox
        process, which lives in the namespace Docker created for the container)."""
        if self.pid is None:
            raise DockerError("netns_path() before prepare()")
        return f"/proc/{self.pid}/ns/net"

    # ------------------------------------------------------------------------------ run
    def start(self) -> None:
        if self.run_dir is None:
            raise DockerError("start() before prepare()")
        go = self.run_dir / "hold" / "go"
        tmp = go.with_name(".go")
        tmp.write_text("go\n")
        tmp.chmod(0o444)
        tmp.replace(go)  # appears atomically: the holder never sees a half-written barrier

    def wait(self, deadline: float | None) -> ExitInfo:
        timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
        try:
            code = self.api.wait(self.container or "", timeout)
        except TimeoutError:
            self._killed_by = Limit.WALL_TIME
            self.kill()
            try:
                code = self.api.wait(self.container or "", 60.0)
            except TimeoutError:
                raise DockerError(f"container {self.container} did not exit within 60 s of SIGKILL") from None
        watch = self._cgroups
        if watch is not None:
            watch.stop()  # a last read of the counters (the group may still be there)
        self._stop_logs(grace=5.0)  # the stream ends with the container: let it copy the tail
        state = self._inspect().get("State") or {}
        limit = self._killed_by
        if limit is None and (state.get("OOMKilled") or (watch is not None and watch.oom_killed.is_set())):
            limit = Limit.MEMORY
        if limit is None and watch is not None and watch.pids_hit.is_set():
            limit = Limit.PIDS
        # docker-init (PID 1) exits 128+N when a signal N killed the workload
        if 128 < code <= 128 + 64:
            return ExitInfo(status=None, signal=code - 128, limit=limit)
        return ExitInfo(status=code, limit=limit)

    def kill(self) -> None:
        if self.container:
            with contextlib.suppress(DockerError):  # best effort: wait() and teardown() report what is left
                self.api.kill(self.container)

    def _stop_logs(self, grace: float) -> None:
        if self._logs is not None:
            self._logs.join(grace)
            if self._logs.is_alive():
                self._close_logs()
                self._logs.join(1.0)
            self._logs = None

    def teardown(self) -> None:
        if self._cgroups is not None:
            self._cgroups.stop(grace=0)
        self._stop_logs(grace=0)
        if self.container:
            try:
                self.api.remove(self.container)
            except DockerError as exc:
                raise DockerError(f"could not remove container {self.container}: {exc}") from None
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def record(self) -> dict[str, str]:
        """What the run record must hold so `sandbox gc` can remove the container (see gc_record)."""
        return {"container": self.container or "", "docker_host": self.host}


def oci_seccomp_problem(info: object, runtime: str) -> str | None:
    """Why the daemon's `runtime` (gVisor's runsc) would ignore the container's seccomp profile, from its
    `GET /info` answer; None when its runtimeArgs turn `--oci-seccomp` on. Without that flag runsc drops the
    profile with a log line only (docs/runtimes.md): the socket-family and system-call table of
    seccompjson.py would silently not apply. A runtime configured in a way this cannot read (no
    runtimeArgs, e.g. a containerd shim with its own config file) is refused too: unverifiable is not on."""
    runtimes = info.get("Runtimes") if isinstance(info, dict) else None
    entry = runtimes.get(runtime) if isinstance(runtimes, dict) else None
    if not isinstance(entry, dict):
        return (f"the Docker daemon knows no runtime {runtime!r}; register gVisor's runsc with "
                '"runtimeArgs": ["--oci-seccomp"] in its daemon.json (docs/runtimes.md)')
    on = False
    for arg in entry.get("runtimeArgs") or []:  # the last one wins, as in runsc's flag parsing
        name, _, value = str(arg).lstrip("-").partition("=")
        if name == "oci-seccomp":
            on = value.lower() in ("", "true", "1", "t")
    if on:
        return None
    return (f"the Docker daemon runs runtime {runtime!r} without --oci-seccomp, so gVisor would ignore the "
            'sandbox\'s seccomp profile; add "--oci-seccomp" to its "runtimeArgs" in daemon.json and reload '
            "dockerd (docs/runtimes.md)")


class GvisorAdapter(DockerAdapter):
    """The same container under gVisor (`runsc`, registered with the daemon as runtime `runsc`)."""

    name = "gvisor"
    oci_runtime = "runsc"

    def prepare(self, spec: RunSpec) -> None:
        """Refused (exit 120, nothing created) unless the daemon runs runsc with `--oci-seccomp`."""
        problem = oci_seccomp_problem(self.api.call("GET", "/info", "info"), str(self.oci_runtime))
        if problem is not None:
            raise DockerError(problem)
        super().prepare(spec)

    def limit_flags(self, resources: dict) -> list[str]:
        """Docker's --pids-limit on a gVisor container caps the host threads of gVisor's own kernel, not
        the workload's processes (runsc 20221219: 128 kills the sandbox at start; 1024 lets 40 workload
        processes through). gVisor's kernel does enforce RLIMIT_NPROC for the sandbox's own processes
        (verified: nproc=16 stops a fork loop at 15), and the workload cannot raise a hard limit (no
        CAP_SYS_RESOURCE), so `pids_max` becomes `--ulimit nproc=N:N` here. (Under runc that limit
        would count every host process of the container's uid (per run now, but a cgroup counts exactly the
        container), hence --pids-limit there.)"""
        flags = super().limit_flags(resources)
        if "--pids-limit" in flags:
            i = flags.index("--pids-limit")
            count = flags[i + 1]
            flags[i:i + 2] = ["--ulimit", f"nproc={count}:{count}"]
        return flags


def _copy_frames(frames: object) -> None:
    """The log stream's frames to our stdout (1) and stderr (2), until it ends or the reader is gone."""
    for stream, data in frames:  # type: ignore[attr-defined]
        if not write_all(2 if stream == 2 else 1, data):
            break


def gc_record(record: dict) -> list[str]:
    """`sandbox gc` hook: remove the container a dead run's record names."""
    name = record.get("container")
    if name != NAME_PREFIX + str(record.get("run_id")):  # this run's own container, never another
        return []
    try:
        DockerAPI(str(record.get("docker_host") or docker_host())).remove(name)
    except DockerError:
        return []
    return [f"container {name}"]


def labelled_containers(host: str | None = None) -> dict[str, str]:
    """Every container with an `egressgate.run` label on the daemon: name → run id."""
    out: dict[str, str] = {}
    for c in DockerAPI(host or docker_host()).containers(LABEL):
        names = c.get("Names") or []
        run_id = (c.get("Labels") or {}).get(LABEL)
        if names and run_id:
            out[str(names[0]).lstrip("/")] = str(run_id)
    return out


def gc_orphans(live: set[str], host: str | None = None) -> tuple[list[str], list[str]]:
    """`sandbox gc` sweep: remove containers labelled `egressgate.run` whose run is not live (its record is
    gone or its owner dead) — e.g. after the state dir was lost. Returns (removed, problems). A host with
    no daemon at the default socket has nothing to sweep; a configured daemon that does not answer (or
    is not a unix socket) is a problem (reported, never ignored)."""
    host = host or docker_host()
    if host == DEFAULT_DOCKER_HOST and not Path(DEFAULT_DOCKER_HOST[len("unix://"):]).exists():
        return [], []
    try:
        api = DockerAPI(host)
        found = labelled_containers(host)
    except DockerError as exc:
        return [], [f"could not list containers at {host}: {str(exc)[-300:]}"]
    removed: list[str] = []
    problems: list[str] = []
    for name, run_id in found.items():
        if run_id in live:
            continue
        try:
            if api.remove(name):
                removed.append(f"orphan container {name}")
        except DockerError as exc:
            problems.append(f"could not remove orphan container {name}: {str(exc)[-300:]}")
    return removed, problems
