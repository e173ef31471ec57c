"""`--runtime microvm`: the workload runs in its own guest kernel (QEMU's `microvm` machine) whose only NIC
is a tap in the sandbox's network namespace.

Lifecycle (runtimes/base.py): `prepare` creates the namespace (as netns does), resolves the kernel,
initramfs and root image, creates the workspace image; run.py attaches the one plumbing (veth + nftables)
to that namespace; `start` turns the namespace's end of the veth into a bridge port next to a tap (the
guest then holds the /30's sandbox address itself, so the host table's rules apply to the guest's packets
unchanged), and starts QEMU inside the namespace, as the run's uid, with no capability, under its seccomp
sandbox, in the run's cgroup, dying with `sandbox run` (PDEATHSIG). The run itself (config, environment,
argv, CA bundle, resolv.conf, hosts) goes to the guest over the virtio-serial port `eg.in`, never on a
command line; the guest's init (init.sh) reports how the workload ended on `eg.status`; the workload's
stdio are relayed between the caller's fds and the ports eg.stdin/eg.stdout/eg.stderr.

What maps where: memory_mb → the workload's cgroup in the guest (memory.max; an OOM kill there is
Limit.MEMORY) with guest RAM above it, and QEMU's host cgroup above that (run.py `_limits`); cpu_millis →
vCPUs and the host cgroup's CPU quota; pids_max → the guest cgroup's pids.max; wall_time_seconds → the
host kills QEMU; workspace.max_bytes → the size of the workspace image.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import struct
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from egressgate.runtimes import records, sandbox_fs
from egressgate.runtimes.base import ExitInfo, Limit, RunSpec
from egressgate.runtimes.microvm import artifacts, export, image, qemu
from egressgate.runtimes.microvm.guest import GuestFailed, make_workspace_image, parse_status, run_payload, sizes
from egressgate.runtimes.netns import EXIT_PARENT_GONE, PR_SET_PDEATHSIG, delete_netns, netns_name
from egressgate.runtimes.plumbing import in_netns, ip_batch

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
TAP = "tap0"  # names inside the sandbox's own namespace: no clash with other runs
BRIDGE = "br0"
DEFAULT_WORKSPACE_BYTES = 1 << 30
VM_DIR = "microvm"  # state_dir/microvm/<run_id>/: the run's workspace image (named in the run record)


def vm_dir(state_dir: Path, run_id: str) -> Path:
    return state_dir / VM_DIR / run_id


class MicrovmAdapter:
    """QEMU microvm in a prepared network namespace (see the module docstring)."""

    name = "microvm"

    def __init__(self) -> None:
        self.spec: RunSpec | None = None
        self.ns: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.preexec: Callable[[], None] | None = None  # run.py: QEMU's host cgroup
        self.accel = "tcg"
        self.kernel: Path | None = None
        self.initrd: Path | None = None
        self.root: Path | None = None
        self.ws_image: Path | None = None
        self.ws_path: str | None = None
        self._ours: dict[str, socket.socket] = {}
        self._relays: list[threading.Thread] = []
        self._stderr = b""
        self.persistent = False
        self._had_lost_found = False
        self._export_limit = 0
        self._export_overflow = False

    # ------------------------------------------------------------------------------ prepare
    def prepare(self, spec: RunSpec) -> None:
        self.spec = spec
        sandbox = spec.policy.get("sandbox") or {}
        if sandbox_fs.host_allow_entries(spec.policy):
            raise RuntimeError(
                "the microvm runtime gives the guest no host path but the workspace: the policy's "
                "filesystem.allow host paths cannot be honoured (use the netns or docker runtime)"
            )
        ns = netns_name(spec.run_id)
        directory = vm_dir(spec.state_dir, spec.run_id)
        records.update(spec.state_dir, spec.run_id, netns=ns, vm_dir=str(directory))  # before they exist
        kernel = artifacts.kernel_dir()
        if kernel is None:
            raise RuntimeError("no microvm guest kernel: run `egressgate runtime image build` first")
        self.kernel = kernel / "vmlinux"
        self.initrd = artifacts.initramfs(kernel)
        self.root = image.resolve(spec.image)
        res = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True, check=False, timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"ip netns add {ns} failed: {res.stderr.strip()}")
        self.ns = ns
        self.ws_path = (sandbox.get("workspace") or {}).get("path") if spec.workspace is not None else None
        if self.ws_path:
            assert spec.workspace is not None
            (spec.state_dir / VM_DIR).mkdir(mode=0o700, exist_ok=True)
            directory.mkdir(mode=0o700, exist_ok=True)
            self.ws_image = directory / "workspace.img"
            size = int((sandbox.get("workspace") or {}).get("max_bytes") or DEFAULT_WORKSPACE_BYTES)
            make_workspace_image(self.ws_image, spec.workspace, size, spec.uid, spec.gid)
            # a persistent --workspace (not the run's temporary one) comes back as a tar at a clean end
            # (not by its path: a named workspace is exposed at the same state_dir/workspaces/<run_id> a
            # temporary one uses, runtimes/workspaces.py)
            self.persistent = spec.workspace_persistent
            self._had_lost_found = (spec.workspace / export.MKFS_ONLY).exists()
            self._export_limit = export.limit_for(size)
        self.accel = qemu.accel(self.kernel, self.initrd, artifacts.cache_dir() / "accel.json")

    def netns_path(self) -> str:
        assert self.ns is not None, "prepare() first"
        return f"/run/netns/{self.ns}"

    # ------------------------------------------------------------------------------ start
    def _tap(self) -> int:
        """In the sandbox namespace: a tap (its fd goes to QEMU; the device dies with QEMU) bridged with
        the veth end plumbing configured, whose address moves to the guest."""
        a = self.spec.address  # type: ignore[union-attr]
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", TAP.encode(), IFF_TAP | IFF_NO_PI))
            ip_batch(
                [
                    f"link add {BRIDGE} type bridge",
                    f"link set dev {BRIDGE} addrgenmode none",
                    f"addr flush dev {a.sandbox_if}",
                    f"link set {a.sandbox_if} master {BRIDGE}",
                    f"link set dev {TAP} addrgenmode none",
                    f"link set {TAP} master {BRIDGE}",
                    f"link set {TAP} up",
                    f"link set {BRIDGE} up",
                ]
            )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _child_setup(self) -> None:
        """In QEMU's child before exec: the sandbox namespace, the host cgroup, the run's uid (and the kvm
        group when KVM is used), death with `sandbox run`."""
        fd = os.open(self.netns_path(), os.O_RDONLY)
        os.setns(fd, os.CLONE_NEWNET)
        os.close(fd)
        if self.preexec is not None:
            self.preexec()
        os.setgroups(self._groups)
        os.setresgid(self._gid, self._gid, self._gid)
        os.setresuid(self._uid, self._uid, self._uid)
        self._prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != self._parent:
            os._exit(EXIT_PARENT_GONE)

    def start(self) -> None:
        spec = self.spec
        assert spec is not None and self.kernel and self.initrd and self.root, "prepare() first"
        import ctypes

        self._prctl = ctypes.CDLL(None, use_errno=True).prctl
        self._parent = os.getpid()
        self._uid, self._gid = spec.uid, spec.gid
        self._groups = [os.stat("/dev/kvm").st_gid] if self.accel == "kvm" else []
        payload = run_payload(spec, self.ws_path, export=self.persistent)
        sandbox = spec.policy.get("sandbox") or {}
        guest_mb, _, vcpus = sizes(sandbox.get("resources") or {})
        tap = in_netns(self.netns_path(), self._tap)
        opened = [tap]
        pairs = {name: socket.socketpair() for name in qemu.PORTS}
        try:
            opened += [os.open(path, os.O_RDONLY | os.O_CLOEXEC) for path in (self.kernel, self.initrd, self.root)]
            ws = ws_ro = None
            if self.ws_image is not None:
                ws = os.open(self.ws_image, os.O_RDWR | os.O_CLOEXEC)
                opened.append(ws)
                ws_ro = os.open(self.ws_image, os.O_RDONLY | os.O_CLOEXEC)
                opened.append(ws_ro)
            fds = qemu.Fds(
                kernel=opened[1],
                initrd=opened[2],
                root=opened[3],
                workspace=ws,
                workspace_ro=ws_ro,
                tap=tap,
                ports={name: pair[1].fileno() for name, pair in pairs.items()},
            )
            argv = qemu.argv(fds, self.accel, guest_mb, vcpus, qemu.mac_of(spec.run_id))
            self.proc = subprocess.Popen(
                argv,
                pass_fds=[*opened, *fds.ports.values()],
                env={},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                preexec_fn=self._child_setup,
                cwd="/",
            )
        finally:
            for fd in opened:
                os.close(fd)
            for _, theirs in pairs.values():
                theirs.close()
        self._ours = {name: pair[0] for name, pair in pairs.items()}
        records.update(spec.state_dir, spec.run_id, workload_pid=self.proc.pid, accel=self.accel)
        from egressgate.runtimes.run import log

        what = (
            "hardware virtualization"
            if self.accel == "kvm"
            else "software emulation: a separate guest kernel, no hardware isolation"
        )
        log(f"microvm: QEMU {self.accel.upper()} ({what}), {guest_mb} MiB, {vcpus} vCPU")
        self._relay(self._send_payload, payload)
        self._relay(self._pump_out, "eg.stdout", 1)
        self._relay(self._pump_out, "eg.stderr", 2)
        self._relay(self._pump_in)
        self._relay(self._read_stderr)
        self._relay(self._spool_export)

    def _relay(self, fn: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=fn, args=args, daemon=True, name=f"egressgate-vm-{fn.__name__}")
        thread.start()
        self._relays.append(thread)

    def _send_payload(self, payload: bytes) -> None:
        sock = self._ours["eg.in"]
        with contextlib.suppress(OSError):
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)

    def _pump_out(self, name: str, fd: int) -> None:
        """A guest port to the caller's fd. Drained to the end even when the caller's side is gone (EPIPE):
        a port nobody reads would block the guest's writer until the wall time."""
        sock = self._ours[name]
        open_ = True
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                view = memoryview(chunk)
                while view and open_:
                    try:
                        view = view[os.write(fd, view) :]
                    except OSError:
                        open_ = False

    def _pump_in(self) -> None:
        """The caller's stdin to the guest; its EOF becomes the port's (QEMU drops the connection)."""
        sock = self._ours["eg.stdin"]
        with contextlib.suppress(OSError):
            while chunk := os.read(0, 65536):
                sock.sendall(chunk)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)

    def _spool_export(self) -> None:
        """eg.out (a persistent workspace's tar) into a bounded spool file; always drained, so a guest
        writing more than the bound is never blocked (the copy-back is then refused)."""
        assert self.spec is not None
        sock = self._ours["eg.out"]
        spool = vm_dir(self.spec.state_dir, self.spec.run_id) / "export.tar"
        written = 0
        with contextlib.suppress(OSError):
            fh = open(spool, "wb") if self.persistent else None  # noqa: SIM115 - closed below
            try:
                while chunk := sock.recv(1 << 16):
                    written += len(chunk)
                    if fh is not None and written <= self._export_limit:
                        fh.write(chunk)
                    else:
                        self._export_overflow = self.persistent
            finally:
                if fh is not None:
                    fh.close()

    def _copy_back(self) -> None:
        """A clean end of a persistent workspace's run: its content from the guest's tar (export.py)."""
        from egressgate.runtimes.run import log

        assert self.spec is not None and self.spec.workspace is not None
        if self._export_overflow:
            log(
                f"the workspace tar from the guest exceeded {self._export_limit} bytes; {self.spec.workspace} "
                "keeps its content from before the run"
            )
            return
        spool = vm_dir(self.spec.state_dir, self.spec.run_id) / "export.tar"
        try:
            count, skipped = export.sync_back(spool, self.spec.workspace, self.spec.run_id, self._had_lost_found)
        except (OSError, tarfile.TarError) as exc:
            log(
                f"the workspace from the guest was refused ({type(exc).__name__}: {exc}); "
                f"{self.spec.workspace} keeps its content from before the run"
            )
            return
        log(
            f"workspace {self.spec.workspace}: {count} entries copied back from the guest"
            + (f"; refused (left out): {', '.join(skipped[:5])}" if skipped else "")
        )

    def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        with contextlib.suppress(OSError, ValueError):
            for line in self.proc.stderr:
                self._stderr = (self._stderr + line)[-4000:]

    # ------------------------------------------------------------------------------ wait / kill
    def _status(self, deadline: float | None) -> str | None:
        sock = self._ours["eg.status"]
        got = b""
        while b"\n" not in got:
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                raise TimeoutError
            sock.settimeout(timeout)
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                raise
            except OSError:
                chunk = b""
            if not chunk:
                return None
            got += chunk
        return got.split(b"\n", 1)[0].decode(errors="replace")

    def wait(self, deadline: float | None) -> ExitInfo:
        assert self.proc is not None, "start() first"
        try:
            line = self._status(deadline)
        except TimeoutError:
            self.kill()
            self.proc.wait()
            self._join()
            return ExitInfo(status=None, signal=signal.SIGKILL, limit=Limit.WALL_TIME)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)  # the guest reboots right after its status line
        self.kill()
        self.proc.wait()
        self._join()
        if line is None:
            rc = self.proc.returncode
            if rc < 0:
                return ExitInfo(status=None, signal=-rc)
            detail = self._stderr.decode(errors="replace").strip().splitlines()[-3:]
            raise GuestFailed(
                f"QEMU ended ({rc}) before the guest reported a status" + (f": {' | '.join(detail)}" if detail else "")
            )
        result = parse_status(line)
        if self.persistent:
            self._copy_back()
        return result

    def _join(self) -> None:
        for thread in self._relays:
            if thread.name != "egressgate-vm-_pump_in":  # blocked on the caller's stdin: left behind
                thread.join(10)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def teardown(self) -> None:
        self.kill()
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        for sock in self._ours.values():
            sock.close()
        if self.spec is not None:
            remove_vm_dir(self.spec.state_dir, self.spec.run_id)
        if self.ns is not None:
            delete_netns(self.ns)
            self.ns = None


def remove_vm_dir(state_dir: Path, run_id: str) -> bool:
    """The run's workspace image and its directory (teardown, watchdog, gc); False when absent."""
    import shutil

    directory = vm_dir(state_dir, run_id)
    if not directory.is_dir():
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True
