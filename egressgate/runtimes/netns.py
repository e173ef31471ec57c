"""`--runtime netns`: a fresh network namespace (`ip netns add egressgate-<run_id>`) plus bubblewrap for
files and processes.

The namespace is created in `prepare` and the plumbing attaches to it before `start` runs bwrap inside
it (setns in the child before exec), so the workload never runs without its only way out in place. bwrap
does NOT get --unshare-net: the namespace it must use is the prepared one.

Isolation (each line is a rule enforced here):
* the workload runs as the run's own host uid/gid (RunSpec.uid, runtimes/identity.py; it sees itself as
  65534 `nobody` inside its new user namespace), with every capability dropped
  (no CAP_NET_RAW: no raw sockets; no CAP_NET_ADMIN: the namespace's routes and nftables stay as set;
  no CAP_DAC_OVERRIDE: mode-000 masks and owner-only host files are unreadable);
* the file tree is built from an allowlist (sandbox_fs.py), not the host root: /usr, /bin, /lib*, /sbin
  and a few /etc entries read-only, generated passwd/group, the workspace, the policy's host
  `filesystem.allow` paths; nothing else of the host exists inside (no other workspace, /home, /root,
  /opt, /srv, /var, host sockets); every bind is nosuid,nodev; the root is read-only;
* new pid, ipc, uts (and cgroup, where possible) namespaces, a new session (no TIOCSTI into the
  caller's terminal), killed with `sandbox run` (--die-with-parent);
* /proc of the new pid namespace, a minimal /dev, tmpfs /run (no /run/netns, no run records, no
  docker.sock), a size- and inode-bounded tmpfs /tmp (sandbox.tmp.max_bytes, diskfs.py), the workspace
  read-write at sandbox.workspace.path;
* `filesystem.deny` paths inside a visible tree are masked by mode-000 read-only files/directories;
* /etc/resolv.conf (`nameserver <host_ip>`), /etc/hosts and the CA bundle are generated read-only
  copies (data passed by fd: no host path has to be reachable by the sandbox uid); the bundle sits at every
  system trust path and as the OpenSSL hashed directory /etc/ssl/certs (truststore.py), not the host's;
* the environment is exactly RunSpec.env (`--clearenv`), handed to bwrap in a memfd (`--args FD`), never on
  a command line (/proc/<pid>/cmdline is world-readable; the env holds the token and phantoms); bwrap itself
  gets an empty environment (it runs as the sandbox uid: its /proc/<pid>/environ must hold nothing of the
  caller's);
* socket families by allowlist (no AF_UNIX socket(2), no vsock, packet, netlink beyond NETLINK_ROUTE),
  no io_uring, bpf, keyrings, ptrace, namespaces; native ABI only (seccomp.py): a host Unix socket (none is
  in the tree; one created later in an allowed tree) or the hypervisor's vsock is not a way out;
  no set-id mode can be set (seccomp.SETID_MODE);
* a new, empty session keyring (joined in the child before bwrap starts): the caller's session keys
  are not the workload's (and the keyring syscalls are refused anyway).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import subprocess
import time
from collections.abc import Callable

from egressgate.runtimes import records, sandbox_fs, truststore
from egressgate.runtimes.base import SANDBOX_UID, ExitInfo, Limit, RunSpec
from egressgate.runtimes.diskfs import DEFAULT_TMP_MAX_BYTES
from egressgate.runtimes.seccomp import ARCH_INDEX, REFUSED, no_unix_sockets

NETNS_PREFIX = "egressgate-"
PR_SET_PDEATHSIG = 1
MNT_DETACH = 2
EXIT_PARENT_GONE = 120
KEYCTL_JOIN_SESSION_KEYRING = 1
ALWAYS_MASKED = ("/var/run/docker.sock", "/run/docker.sock", "/run/containerd/containerd.sock")
BWRAP = "bwrap"
TMP = "/tmp"  # noqa: S108 - the sandbox's own /tmp: a fresh tmpfs per run, no host directory


def netns_name(run_id: str) -> str:
    return NETNS_PREFIX + run_id


def _data_fd(data: bytes) -> int:
    """A memfd holding `data`, positioned at 0 (bwrap copies it into the sandbox). Not a pipe: a CA bundle
    with the system roots is larger than a pipe buffer."""
    fd = os.memfd_create("egressgate-data", os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class BwrapCommand:
    """The bwrap argv and the fds it reads; built once in prepare (pure apart from reading the host tree)."""

    def __init__(self) -> None:
        self.args: list[str] = []
        self.fds: list[int] = []

    def data(self, content: bytes, dest: str, perms: str | None = None) -> None:
        self.args += ([ "--perms", perms] if perms else []) + ["--ro-bind-data", str(self.data_fd(content)), dest]

    def data_fd(self, content: bytes) -> int:
        """A memfd holding `content` that bwrap is given (its number goes into an argument)."""
        fd = _data_fd(content)
        self.fds.append(fd)
        return fd

    def environment(self, env: dict[str, str]) -> None:
        """`--clearenv` and one `--setenv` per variable, read by bwrap from a memfd (`--args FD`), never
        from its argv: /proc/<pid>/cmdline is world-readable, and the environment holds the proxy token and
        phantom credentials. bwrap reads the fd once at start and closes it; its cmdline stays
        `... --args N ...`. A NUL inside a name or value cannot be passed (it would split the record)."""
        words = ["--clearenv"]
        for key, value in env.items():
            if "\0" in key or "\0" in value or "=" in key or not key:
                raise ValueError(f"environment variable {key!r} cannot be passed to bwrap (empty, '=' or NUL)")
            words += ["--setenv", key, value]
        fd = _data_fd(b"".join(word.encode() + b"\0" for word in words))
        self.fds.append(fd)
        self.args += ["--args", str(fd)]

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def build_command(spec: RunSpec, workspace_fd: int | None, tmp_fd: int | None = None) -> BwrapCommand:
    """The whole bwrap invocation for `spec` (see the module docstring for the rules)."""
    sandbox = spec.policy.get("sandbox") or {}
    fs = spec.policy.get("filesystem") or {}
    ws_path = (sandbox.get("workspace") or {}).get("path")
    cmd = BwrapCommand()
    cmd.args += ["--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                 "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                 "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                 "--hostname", str(sandbox.get("name") or "sandbox")[:63]]
    # an empty tmpfs root with only what sandbox_fs lists (not the host root: issue 20); read-only at the
    # end. root_fs read_write never makes a host path writable: it gets writable scratch space instead
    cmd.args += ["--perms", "0755", "--dir", "/etc", *sandbox_fs.minimal_args()]
    users, groups = sandbox_fs.passwd(SANDBOX_UID, SANDBOX_UID)
    cmd.data(users, "/etc/passwd", "0444")
    cmd.data(groups, "/etc/group", "0444")
    # /tmp: the run's size- and inode-bounded tmpfs (diskfs.py), bound by fd onto the allowlist root (bwrap
    # creates the mount point there), when `sandbox run` could make one the run's uid reaches; else bwrap's
    # own tmpfs of the same size (inodes then bounded by memory only)
    tmp_bytes = str((sandbox.get("tmp") or {}).get("max_bytes") or DEFAULT_TMP_MAX_BYTES)
    tmp = ["--bind-fd", str(tmp_fd), TMP] if tmp_fd is not None else ["--size", tmp_bytes, "--tmpfs", TMP]
    cmd.args += ["--proc", "/proc", "--dev", "/dev", *tmp, "--tmpfs", "/run"]
    if sandbox.get("root_fs") == "read_write":
        for scratch in ("/var/tmp", "/home"):  # noqa: S108 - fresh tmpfs mounts inside the sandbox
            cmd.args += ["--tmpfs", scratch]
    if ws_path and workspace_fd is not None:
        cmd.args += ["--bind-fd", str(workspace_fd), ws_path]
    cmd.args += sandbox_fs.allow_args(spec.policy)
    # the CA bundle where TLS libraries look by default, not only where the variables point (truststore.py)
    bundle = spec.ca_bundle.read_bytes()
    trust_fd = _data_fd(bundle)
    cmd.fds.append(trust_fd)
    cmd.args += truststore.bwrap_args(trust_fd, bundle, cmd.data_fd, spec.state_dir)
    cmd.data(f"nameserver {spec.address.host_ip}\noptions edns0\n".encode(), "/etc/resolv.conf", "0444")
    hostname = str(sandbox.get("name") or "sandbox")
    cmd.data(f"127.0.0.1\tlocalhost\n{spec.address.sandbox_ip}\t{hostname}\n".encode(), "/etc/hosts", "0444")
    visible = sandbox_fs.visible_roots(spec.policy, ws_path if workspace_fd is not None else None)
    for path in [*ALWAYS_MASKED, *fs.get("deny", [])]:
        path = os.path.normpath(path)
        if sandbox_fs.is_visible(path, visible):  # elsewhere it is absent: nothing to mask
            _mask(cmd, path, ws_path)
    cmd.args += ["--remount-ro", "/"]
    # socket families by allowlist, no Unix sockets of its own (a host socket appearing later in an
    # allowed tree would be a way out), no set-id modes, no io_uring/bpf/keyrings/ptrace (seccomp.py)
    program = _data_fd(no_unix_sockets())
    cmd.fds.append(program)
    cmd.args += ["--seccomp", str(program)]
    cmd.environment(spec.env)
    cmd.args += ["--chdir", ws_path if ws_path and workspace_fd is not None else TMP, "--", *spec.command]
    return cmd


def _mask(cmd: BwrapCommand, path: str, ws_path: str | None) -> None:
    """Mode-000 read-only stand-in for a denied path. A path that does not exist is masked only where the
    workload could create it (/tmp, the workspace); elsewhere the root is read-only, so it stays absent."""
    if not path.startswith("/"):
        return
    writable = path.startswith(TMP + "/") or (ws_path and path.startswith(ws_path.rstrip("/") + "/"))
    if os.path.isdir(path) and not os.path.islink(path):
        cmd.args += ["--perms", "0000", "--tmpfs", path, "--remount-ro", path]
    elif os.path.lexists(path) or writable:
        cmd.data(b"", path, "0000")


class NetnsAdapter:
    """bubblewrap in a prepared network namespace (see the module docstring)."""

    name = "netns"

    def __init__(self) -> None:
        self.spec: RunSpec | None = None
        self.ns: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.preexec: Callable[[], None] | None = None  # run.py: move the child into the run's cgroups
        self.stdio: dict[str, int] = {}  # Popen stdin/stdout (`mcp run` pipes them through its relay)
        self._cmd: BwrapCommand | None = None
        self._ws_fd: int | None = None
        self._tmp_fd: int | None = None  # the run's bounded /tmp (diskfs.py), bound by fd like the workspace
        self._bwrap = BWRAP

    def prepare(self, spec: RunSpec) -> None:
        self.spec = spec
        ns = netns_name(spec.run_id)
        records.update(spec.state_dir, spec.run_id, netns=ns)  # recorded before it exists
        res = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True, check=False, timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"ip netns add {ns} failed: {res.stderr.strip()}")
        self.ns = ns
        if spec.workspace is not None:
            self._ws_fd = os.open(spec.workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        if spec.tmp_dir is not None:
            self._tmp_fd = os.open(spec.tmp_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._cmd = build_command(spec, self._ws_fd, self._tmp_fd)
        self._bwrap = shutil.which(BWRAP) or BWRAP  # found on the caller's PATH: bwrap itself gets no env

    def netns_path(self) -> str:
        assert self.ns is not None, "prepare() first"
        return f"/run/netns/{self.ns}"

    def _child_setup(self) -> None:
        """In the child, before exec: join the sandbox netns, then the cgroups (needs root), then drop
        to the sandbox uid (bwrap then runs unprivileged and cannot regain anything)."""
        fd = os.open(self.netns_path(), os.O_RDONLY)
        os.setns(fd, os.CLONE_NEWNET)
        os.close(fd)
        if self.preexec is not None:
            self.preexec()
        # a new anonymous session keyring, joined as root so it is charged to root's key quota, not to
        # the shared sandbox uid's (200 keys: concurrent runs would run out): the caller's session keys
        # never reach the workload. Failing to leave the caller's keyring refuses the run.
        if self._keyctl(self._nr_keyctl, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
            raise OSError("keyctl(KEYCTL_JOIN_SESSION_KEYRING) failed: the sandbox would share the "
                          "caller's session keyring")
        os.setgroups([])
        os.setresgid(self._gid, self._gid, self._gid)  # the run's own host identity (RunSpec.uid)
        os.setresuid(self._uid, self._uid, self._uid)
        # after the uid change (which clears it): bwrap dies with `sandbox run`, even on SIGKILL, and its
        # sandbox's pid 1 (--die-with-parent) with it, so no workload outlives its run
        self._prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != self._parent:
            os._exit(EXIT_PARENT_GONE)

    def start(self) -> None:
        assert self._cmd is not None, "prepare() first"
        import ctypes  # here, not in the child: no imports between fork and exec

        libc = ctypes.CDLL(None, use_errno=True)
        self._prctl = libc.prctl
        self._keyctl = libc.syscall
        self._nr_keyctl = next(s.nr for s in REFUSED if s.name == "keyctl")[ARCH_INDEX[platform.machine()]]
        self._parent = os.getpid()
        self._uid, self._gid = self.spec.uid, self.spec.gid  # type: ignore[union-attr]
        fds = [*self._cmd.fds, *(fd for fd in (self._ws_fd, self._tmp_fd) if fd is not None)]
        try:
            # env={}: bwrap runs as the sandbox uid, so its /proc/<pid>/environ is readable by that uid; the
            # caller's environment (cloud keys, tokens) must not sit there (the workload's comes by fd)
            self.proc = subprocess.Popen([self._bwrap, *self._cmd.args], pass_fds=fds, env={},
                                         preexec_fn=self._child_setup, **self.stdio)  # type: ignore[call-overload]
        finally:
            self._cmd.close()
        records.update(self.spec.state_dir, self.spec.run_id, workload_pid=self.proc.pid)  # type: ignore[union-attr]

    def wait(self, deadline: float | None) -> ExitInfo:
        assert self.proc is not None, "start() first"
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rc = self.proc.wait(timeout=timeout)
                break
            except subprocess.TimeoutExpired:
                self.kill()
                self.proc.wait()
                return ExitInfo(status=None, signal=signal.SIGKILL, limit=Limit.WALL_TIME)
        if rc < 0:  # bwrap itself was killed (kill(), or a signal from outside)
            return ExitInfo(status=None, signal=-rc)
        return ExitInfo(status=rc)  # bwrap reports a workload killed by signal N as 128+N

    def kill(self) -> None:
        """SIGKILL the outer bwrap: its child (pid 1 of the sandbox's pid namespace) has PDEATHSIG, and
        when pid 1 dies the kernel kills every process in the namespace."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def teardown(self) -> None:
        self.kill()
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self._cmd is not None:
            self._cmd.close()
        for fd in (self._ws_fd, self._tmp_fd):
            if fd is not None:
                os.close(fd)
        self._ws_fd = self._tmp_fd = None
        if self.ns is not None:
            delete_netns(self.ns)
            self.ns = None


def delete_netns(name: str) -> bool:
    """What `ip netns del` does, without its process (start-up budget): detach the bind mount that keeps
    the namespace alive and remove its file; the kernel frees the namespace (and the veth pair in it)
    once no process uses it. False when it did not exist."""
    if not name.startswith(NETNS_PREFIX) or "/" in name:
        raise ValueError(f"refusing to delete a namespace that is not ours: {name!r}")
    import ctypes

    path = f"/run/netns/{name}"
    if not os.path.lexists(path):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(path.encode(), MNT_DETACH)  # EINVAL when not mounted (a leftover file): unlinked anyway
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
