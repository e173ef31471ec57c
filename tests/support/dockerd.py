"""A private, disposable Docker daemon for tests (real dockerd, real runc and gVisor `runsc`).

Why its own daemon: tests must not touch a developer's Docker (or another engineer's test daemon on
the same machine), and nothing a container does may reach the real network. So the daemon:

- keeps all its state in a temp dir (`--data-root`, `--exec-root`, unix socket, pidfile), the data-root
  on a tmpfs of its own (unmounted at teardown: nothing to delete file by file);
- runs inside a network namespace of its own that has only `lo` and the daemon's bridge, so even a
  container on the bridge network has no route anywhere (and an image pull fails instead of leaving);
- is started with `--iptables=false --ip-forward=false --ip-masq=false` (the host's nftables and
  sysctls stay untouched) and addresses only in 198.18.0.0/15 (`--bip`, `--default-address-pool`):
  Docker's default 172.17/16 is a real private range tests must never send to;
- puts every container under its own cgroup parent, so teardown finds what is left by cgroup;
- knows the `runsc` runtime with `--network=host --oci-seccomp` (the second makes gVisor apply the
  container's seccomp profile, docs/runtimes.md; gVisor's netstack does not start on this kernel;
  the container's network namespace is still its own, which is all `--network none` needs).

Teardown removes the containers, stops the daemon, kills by PID whatever survived it (containerd
shims, `runsc` sandboxes and gofers — found by our unique state path in their command line or by our
cgroup parent), unmounts what the daemon left mounted, deletes the namespace (the bridge goes with
it), the cgroups and the state dir. A daemon left behind by a SIGKILLed session is removed by the
next one (owner pid recorded in /run/egressgate-dockerd).

`dockerd` (session fixture) is the one other helpers reuse::

    def test_x(dockerd):
        img = dockerd.busybox_image()
        dockerd.docker("run", "--rm", "--network", "none", img, "true")
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import images

DOCKER = "/usr/bin/docker"  # an older/newer CLI may be first on PATH
DOCKERD = "/usr/sbin/dockerd"
RUNSC = "/usr/bin/runsc"
REGISTRY = Path("/run/egressgate-dockerd")
PREFIX = "egD"
BIP = "198.18.250.1/24"
ADDRESS_POOL = "base=198.19.128.0/17,size=24"
DATA_TMPFS_SIZE = "6g"  # a bound, not a reservation: the suite's images and containers use ~1.5 GB
PACKAGES = ("docker.io", "runsc", "busybox-static", "mmdebstrap", "bubblewrap")


def ensure_installed() -> None:
    """Install the Debian packages with the repo's own script when a binary is missing (CI machines
    start bare); fail with its output when that does not produce them."""
    needed = (DOCKER, DOCKERD, RUNSC, images.BUSYBOX)
    if all(Path(p).exists() for p in needed):
        return
    script = Path(__file__).resolve().parents[2] / "scripts" / "install-test-deps.sh"
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900, check=False)
    missing = [p for p in needed if not Path(p).exists()]
    if missing:
        raise RuntimeError(f"{script} did not install {missing}: {res.stdout[-2000:]} {res.stderr[-2000:]}")


@dataclass
class Dockerd:
    """One running daemon. Create with `Dockerd.start(state_dir)`; always `close()` it."""

    state: Path
    sid: str = field(default_factory=lambda: secrets.token_hex(3))
    proc: subprocess.Popen[bytes] | None = None
    _images: dict[str, str] = field(default_factory=dict)
    # the `runsc` runtime's arguments (a test of the gVisor adapter's refusal starts a daemon without
    # --oci-seccomp: tests/runtimes/test_gvisor_seccomp.py)
    runsc_args: tuple[str, ...] = ("--network=host", "--oci-seccomp")

    # ------------------------------------------------------------------------------ names
    @property
    def netns(self) -> str:
        return f"{PREFIX}{self.sid}-dockerd"

    @property
    def cgroup_parent(self) -> str:
        return f"{PREFIX}{self.sid}"

    @property
    def socket(self) -> Path:
        return self.state / "docker.sock"

    @property
    def host(self) -> str:
        """The DOCKER_HOST value of this daemon."""
        return f"unix://{self.socket}"

    def env(self) -> dict[str, str]:
        """An environment for the docker CLI that talks to this daemon only."""
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DOCKER_HOST": self.host,
                "DOCKER_CONFIG": str(self.state / "cli"), "HOME": str(self.state)}

    # ------------------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, state: Path, runsc_args: tuple[str, ...] | None = None) -> Dockerd:
        ensure_installed()
        reap_stale()
        d = cls(state=state) if runsc_args is None else cls(state=state, runsc_args=runsc_args)
        try:
            d._start()
        except BaseException:
            d.close()
            raise
        return d

    def _start(self) -> None:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / f"{self.sid}.json").write_text(json.dumps(
            {"pid": os.getpid(), "state": str(self.state), "netns": self.netns, "cgroup": self.cgroup_parent}))
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / "cli").mkdir(exist_ok=True)
        # the daemon's data on a tmpfs of its own: image layers, BuildKit's cache and container layers are
        # tens of thousands of small files that a disk-backed rmtree took ~35 s to delete at session end;
        # destroy() unmounts it (it unmounts everything under the state dir) and the memory is freed
        (self.state / "data").mkdir(exist_ok=True)
        _sh("mount", "-t", "tmpfs", "-o", f"size={DATA_TMPFS_SIZE},mode=0711", f"{PREFIX}-{self.sid}-data",
            str(self.state / "data"))
        _sh("ip", "netns", "add", self.netns)
        _sh("ip", "-n", self.netns, "link", "set", "lo", "up")
        config = {
            "runtimes": {"runsc": {"path": RUNSC, "runtimeArgs": list(self.runsc_args)}},
            "cgroup-parent": self.cgroup_parent,
            "log-level": "warn",
        }
        (self.state / "daemon.json").write_text(json.dumps(config))
        log = open(self.state / "dockerd.log", "wb")  # noqa: SIM115 - the daemon keeps it open
        # nsenter --net (not `ip netns exec`): that one also remounts /sys, which hides the cgroup
        # hierarchies dockerd needs ("Devices cgroup isn't mounted")
        self.proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.netns}", DOCKERD,
             "--config-file", str(self.state / "daemon.json"), "--host", self.host,
             "--data-root", str(self.state / "data"), "--exec-root", str(self.state / "exec"),
             "--pidfile", str(self.state / "docker.pid"), "--iptables=false", "--ip-forward=false",
             "--ip-masq=false", "--storage-driver=overlay2", "--bip", BIP,
             "--default-address-pool", ADDRESS_POOL],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env())
        log.close()
        # generous: on a loaded 2-core machine (the suite runs in parallel) the first `docker version` can
        # wait seconds for the daemon's initialisation; a slow answer is "not ready yet", never an error
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.socket.exists():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    if self.docker("version", check=False, timeout=15).returncode == 0:
                        return
            time.sleep(0.1)
        tail = (self.state / "dockerd.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"dockerd did not start: {tail}")

    def docker(self, *args: str, check: bool = True, timeout: float = 60,
               input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Run the docker CLI against this daemon; failures raise with its stderr."""
        res = subprocess.run([DOCKER, *args], capture_output=True, timeout=timeout, input=input,
                             env=self.env(), check=False)
        out = subprocess.CompletedProcess(res.args, res.returncode, res.stdout.decode(errors="replace"),
                                          res.stderr.decode(errors="replace"))
        if check and res.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed ({res.returncode}): {out.stderr.strip()}")
        return out

    def close(self) -> None:
        """Tear everything down; safe after a partial start and when called twice."""
        if self.proc is not None and self.proc.poll() is None and self.socket.exists():
            ids = self.docker("ps", "-aq", check=False, timeout=30).stdout.split()
            if ids:
                self.docker("rm", "-f", *ids, check=False, timeout=60)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        destroy(self.state, self.netns, self.cgroup_parent)
        with contextlib.suppress(FileNotFoundError):
            (REGISTRY / f"{self.sid}.json").unlink()

    # ------------------------------------------------------------------------------ images
    def busybox_image(self) -> str:
        """A busybox image (static binary + applets + passwd/group), built in about 0.1 s, once."""
        if "busybox" not in self._images:
            self._images["busybox"] = images.busybox(self)
        return self._images["busybox"]

    def python_image(self) -> str:
        """A Debian python3 image from mmdebstrap (~20 s the first time, cached on disk afterwards)."""
        if "python" not in self._images:
            self._images["python"] = images.python(self)
        return self._images["python"]

    def threaded_image(self) -> str:
        """Debian python3 + grpcio + nodejs (images.threaded; cached on disk like the python image)."""
        if "threaded" not in self._images:
            self._images["threaded"] = images.threaded(self)
        return self._images["threaded"]

    # ------------------------------------------------------------------------------ observation
    def leftovers(self) -> dict[str, list[str]]:
        """What this daemon's containers left on the host: containers, their cgroups, their processes."""
        containers = self.docker("ps", "-aq", check=False).stdout.split()
        cgroups = [str(c) for top in _cgroup_dirs(self.cgroup_parent) for c in top.iterdir() if c.is_dir()]
        procs = [str(pid) for pid in _cgroup_pids(self.cgroup_parent)]
        return {"containers": containers, "cgroups": cgroups, "processes": procs}


def _sh(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _cgroup_dirs(parent: str) -> list[Path]:
    return [p for p in Path("/sys/fs/cgroup").glob(f"*/{parent}") if p.is_dir()]


def _cgroup_pids(parent: str) -> set[int]:
    pids: set[int] = set()
    for top in _cgroup_dirs(parent):
        for procs in top.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids |= {int(x) for x in procs.read_text().split()}
    return pids


def _pids_mentioning(path: Path) -> set[int]:
    """Processes whose command line names our state dir (containerd, shims, runsc sandboxes/gofers)."""
    needle = str(path).encode()
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
    return found


def destroy(state: Path, netns: str, cgroup_parent: str) -> None:
    """Remove every trace of one daemon (its processes by PID, mounts, namespace, cgroups, files)."""
    assert netns.startswith(PREFIX) and cgroup_parent.startswith(PREFIX), (netns, cgroup_parent)
    for _ in range(3):
        pids = _pids_mentioning(state) | _cgroup_pids(cgroup_parent)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    mounts = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            target = line.split()[4].replace("\\040", " ")
            if target == str(state) or target.startswith(str(state) + "/"):
                mounts.append(target)
    for target in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
    for top in _cgroup_dirs(cgroup_parent):
        for sub in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
    shutil.rmtree(state, ignore_errors=True)


def reap_stale() -> None:
    """Remove daemons whose owning test process died without cleaning up (SIGKILL, OOM)."""
    if not REGISTRY.is_dir():
        return
    for entry in REGISTRY.glob("*.json"):
        try:
            record = json.loads(entry.read_text())
            pid = int(record["pid"])
        except (OSError, ValueError, KeyError):
            continue
        if Path(f"/proc/{pid}").exists():
            continue
        daemon_pid = Path(record["state"], "docker.pid")
        with contextlib.suppress(OSError, ValueError, ProcessLookupError):
            os.kill(int(daemon_pid.read_text()), signal.SIGKILL)
        destroy(Path(record["state"]), record["netns"], record["cgroup"])
        entry.unlink(missing_ok=True)


@contextlib.contextmanager
def running(state: Path, runsc_args: tuple[str, ...] | None = None) -> Iterator[Dockerd]:
    d = Dockerd.start(state, runsc_args)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture(scope="session")
def dockerd() -> Iterator[Dockerd]:
    """The session's private dockerd (see the module docstring). Import it into a conftest.py."""
    # a short state path, not tmp_path_factory's (longer under xdist): containerd's sockets live under it
    # and a Unix socket path must fit 104 bytes
    state = Path(tempfile.mkdtemp(prefix="egD-"))
    try:
        with running(state / "d") as d:
            yield d
    finally:
        shutil.rmtree(state, ignore_errors=True)
