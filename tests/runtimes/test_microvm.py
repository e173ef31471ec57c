"""`egressgate sandbox run --runtime microvm`: a real QEMU guest (TCG on these machines; KVM where it works)
behind the same plumbing as every runtime. Three full boots, each running many checks in one workload (a
boot costs seconds under TCG), and two runs that end before the guest is up:

1. the escape probe (tests/runtimes/probe.py, the netns/docker checks) run by the guest's python3: no route
   but the gateway (metadata, private IP, IPv6, other resolvers over UDP/TCP/TLS, QUIC, ICMP, raw sockets,
   vsock), every canary silent; the guest kernel is not the host's; host files, another sandbox's
   workspace, block devices and the control ports are absent; the root is read-only, /tmp and the
   workspace writable, a denied file masked (an undenied one readable: the control); the environment is
   admission's and none of it appears in any host /proc/*/cmdline during the run; the explicit proxy works;
   the exit status passes through. The positive control for the network (the same attempts from the
   world's `open` namespace reach the canaries) is test_netns_escape's, repeated here.
2. stdin, stdout and stderr are the caller's; a signal that kills the workload passes through (128+N); the
   revocation record carries egressgate.run.accel; a persistent --workspace goes in and comes back.
3. memory_mb: allocating past it ends the run with 121 (an allocation below it succeeded first).
4. SIGKILL of `sandbox run` once QEMU runs: the watchdog leaves no QEMU, tap/veth, namespace, table, cgroup,
   workspace image or run record, and revokes the sandbox.
wall_time_seconds: the host kills QEMU (124). A policy with host `filesystem.allow` paths is refused before
any boot (fail closed).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes.identity import uid_pids
from tests.networld import World
from tests.runtimes.escape_probe import PROBE, leak_name, network_checks, parse, probe_argv
from tests.runtimes.harness import (
    CALLER_SECRET,
    KEPT_WORKSPACE,
    SAFETY_NPROC,
    Canary,
    Gateway,
    base_dir,
    remove,
    running_gateway,
    runtime_policy,
    sandbox_id,
)
from tests.runtimes.runs import leftovers, revocations

pytestmark = pytest.mark.netns
GUEST_PY = "/usr/bin/python3"  # the root image's (Debian's), not the host's
MB = 1024 * 1024


def build_artifacts() -> None:
    """The kernel, initramfs and root image (`make test` builds them through scripts/install-test-deps.sh;
    a machine that has not is served here, never skipped)."""
    from egressgate.runtimes.microvm import artifacts, image

    if artifacts.kernel_dir() is not None and image.default_image() is not None:
        return
    res = subprocess.run(
        [str(Path(sys.executable).with_name("egressgate")), "runtime", "image", "build"],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture(scope="module")
def gateway(world: World) -> Iterator[Gateway]:
    build_artifacts()
    policies = {
        "mv-allow": runtime_policy(
            "mv-allow",
            sandbox__workspace={**KEPT_WORKSPACE, "max_bytes": 64 * MB},
            sandbox__resources={"pids_max": 64},
            filesystem__deny=["/etc/debian_version", "/var/run/docker.sock"],
        ),
        "mv-mem": runtime_policy("mv-mem", sandbox__resources={"memory_mb": 64}),
        "mv-wall": runtime_policy("mv-wall", sandbox__resources={"wall_time_seconds": 1}),
        "mv-hostpath": runtime_policy("mv-hostpath", filesystem__allow=[{"path": "/var/tmp", "read": True}]),
    }
    with running_gateway(world, policies) as gw:
        yield gw


def _limits() -> None:
    """The harness's process cap, not its address-space cap (QEMU maps guest RAM and its code buffer)."""
    resource.setrlimit(resource.RLIMIT_NPROC, (SAFETY_NPROC, SAFETY_NPROC))


def vm_argv(gateway: Gateway, policy: str, *command: str, workspace: Path | None = None) -> list[str]:
    extra = ["--workspace", str(workspace)] if workspace else []
    return gateway.cmd(
        "sandbox",
        "run",
        "--config",
        str(gateway.config),
        "--policy",
        policy,
        "--runtime",
        "microvm",
        *extra,
        "--",
        *command,
    )


def run_vm(
    gateway: Gateway, policy: str, *command: str, stdin: str = "", timeout: float = 240, workspace: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        vm_argv(gateway, policy, *command, workspace=workspace),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=gateway.caller_env(),
        check=False,
        preexec_fn=_limits,
    )


class CmdlineWatch:
    """Every distinct host /proc/*/cmdline seen while it runs: where a secret on a command line would show.

    Every exec on the host is reported by the kernel's process-events connector (netlink, root) and the new
    program's cmdline read at once (a process that execs is seen within the time the reader takes to wake, not
    at the next poll); a full scan of /proc every SCAN seconds besides catches a command line rewritten after
    exec and what ran before the watch. Without the connector (not root, no CONFIG_PROC_EVENTS) it falls back
    to the full scan every 20 ms (what this watch always did: ~0.08 CPU-s per second of run)."""

    SCAN = 0.2
    FALLBACK_SCAN = 0.02

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self.events = 0  # exec events read (the connector worked)
        self._stop = threading.Event()
        self._sock = self._connector()
        self._threads = [threading.Thread(target=self._scan_loop, daemon=True)]
        if self._sock is not None:
            self._threads.append(threading.Thread(target=self._exec_loop, daemon=True))
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _connector() -> socket.socket | None:
        netlink_connector, cn_idx_proc, cn_val_proc, listen, nlmsg_done = 11, 1, 1, 1, 3
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, netlink_connector)
        except OSError:
            return None
        try:
            sock.bind((0, cn_idx_proc))
            op = struct.pack("=I", listen)
            msg = struct.pack("=IIIIHH", cn_idx_proc, cn_val_proc, 0, 0, len(op), 0) + op
            sock.send(struct.pack("=IHHII", 16 + len(msg), nlmsg_done, 0, 0, 0) + msg)
            sock.settimeout(0.2)
        except OSError:
            sock.close()
            return None
        return sock

    def _read(self, pid: int | str) -> None:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                self.seen.add(fh.read())
        except OSError:
            pass

    def _exec_loop(self) -> None:
        proc_event_exec = 2
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # ENOBUFS: events were lost; the full scan still runs
                continue
            pos = 0
            while pos + 16 <= len(data):  # netlink messages, each: nlmsghdr, cn_msg, proc_event
                length = struct.unpack_from("=I", data, pos)[0]
                if length < 16:
                    break
                event = pos + 16 + 20
                if event + 24 <= pos + length and struct.unpack_from("=I", data, event)[0] == proc_event_exec:
                    self.events += 1
                    self._read(struct.unpack_from("=i", data, event + 16)[0])
                pos += (length + 3) & ~3

    def _scan_loop(self) -> None:
        interval = self.SCAN if self._sock is not None else self.FALLBACK_SCAN
        while not self._stop.is_set():
            for entry in os.scandir("/proc"):
                if entry.name.isdigit():
                    self._read(entry.name)
            self._stop.wait(interval)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        if self._sock is not None:
            self._sock.close()


def test_escape_probe_inside_the_guest(gateway: Gateway, host_files: Path, canaries: dict[str, Canary]) -> None:
    world = gateway.world
    other = gateway.state_dir / "workspaces" / "0123456789"  # another sandbox's workspace on the host
    other.mkdir(parents=True, exist_ok=True)
    (other / "secret.txt").write_text("another sandbox's file\n")
    leak, leak_tcp = leak_name(), leak_name()
    checks = [
        ["env"],
        ["uid"],
        ["uname"],
        ["open", "/etc/debian_version", "r"],
        ["open", "/etc/issue", "r"],
        ["exists", str(host_files)],
        ["exists", str(other / "secret.txt")],
        ["exists", str(gateway.state_dir)],
        ["exists", "/dev/vda"],
        ["exists", "/dev/vport0p1"],
        ["open", "/etc/hosts", "a"],
        ["open", "/usr/egN-written", "w"],
        ["open", "/tmp/egN-written", "w"],
        ["open", "/workspace/egN-written", "w"],
        ["vsock", 4321],
        ["get", "https://api.allowed.test/"],
        *network_checks(leak, leak_tcp),
    ]
    watch = CmdlineWatch()
    mark = world.mark()
    try:
        res = run_vm(
            gateway, "mv-allow", "/bin/sh", "-c", f'{GUEST_PY} -c "$0" "$1"; exit 3', PROBE, json.dumps(checks)
        )
    finally:
        watch.stop()
        remove(other)
    assert res.returncode == 3, res.stdout + res.stderr  # the workload's exit status
    assert "microvm: QEMU" in res.stderr
    out = parse(res.stdout)
    env, ident, uname, denied, undenied, hostfile, otherws, state, vda, vport = out[:10]
    hosts, usr, tmp, ws, vsock, get = out[10:16]
    net = out[16:]
    # the environment is admission's, rewritten for inside; nothing of the caller's
    assert env["env"]["EGRESSGATE_SANDBOX_ID"] == sandbox_id(res.stderr)
    assert "AWS_SECRET_ACCESS_KEY" not in env["env"] and CALLER_SECRET not in json.dumps(env["env"])
    assert env["env"]["SSL_CERT_FILE"] == "/etc/egressgate/ca.pem"
    # ... and none of it was on any host command line while the run lived (the watch saw QEMU's: it looked)
    assert any(b"microvm" in line for line in watch.seen), "the cmdline watch never saw QEMU"
    proxy_token = env["env"]["HTTP_PROXY"].split("@")[0].rsplit(":", 1)[1]  # the sandbox's credential
    assert len(proxy_token) >= 16
    secrets = {proxy_token, env["env"]["EGRESSGATE_SANDBOX_ID"]}
    leaked = [line for line in watch.seen for s in secrets if s.encode() in line]
    assert leaked == [], leaked
    # its own kernel
    assert uname["release"] != os.uname().release, uname
    assert uname["version"] != Path("/proc/version").read_text().strip()
    first, last = gateway.uid_range
    assert first <= ident["uid"] <= last and int(ident["caps"], 16) == 0
    # files: a denied one masked, its control readable; nothing of the host, no devices, read-only root
    assert denied == {"ok": False, "error": "EACCES"} and undenied == {"ok": True}
    assert host_files.is_dir() and (gateway.state_dir).is_dir()  # they exist on the host...
    assert hostfile == otherws == state == {"ok": False}  # ... not in the guest
    assert vda == vport == {"ok": False}
    assert hosts["error"] in ("EROFS", "EACCES") and usr == {"ok": False, "error": "EROFS"}
    assert tmp == {"ok": True} and ws == {"ok": True}
    assert not vsock["ok"]  # no vsock device in the guest
    assert get == {"ok": True, "status": 200}, get  # the one way out works
    # the network: nothing reached a canary, the resolver answered for "public" resolvers
    assert world.canary_hits(mark) == [], world.canary_hits(mark)
    assert canaries["dot"].hits == [] and canaries["quic"].hits == []
    assert not net[2]["ok"]  # IPv6
    # a "public" resolver's denied name: the gateway's own resolver answers with the gateway's address
    # (network.dns.deny_answer: gateway, the default) and nothing is asked upstream (the canaries above)
    assert net[3]["ok"] and (net[3]["rcode"], net[3]["answers"]) == (0, 1), net[3]
    assert net[10]["ok"] and (net[10]["rcode"], net[10]["answers"]) == (0, 1), net[10]
    assert {leak, leak_tcp}.isdisjoint({q["qname"] for q in world.dns_queries(mark)})
    assert not net[5]["ok"] or net[5]["reply_from"] is None  # QUIC
    assert not net[6]["ok"] and not net[7]["ok"] and not net[8]["ok"]  # ICMP, raw sockets
    sid = sandbox_id(res.stderr)
    records = gateway.records(
        predicate=lambda r: r.get("egressgate.operation") == "revocation" and r.get("egressgate.sandbox.id") == sid
    )
    mine = [r for r in records if r.get("egressgate.sandbox.id") == sid]
    transparent = {r.get("server.address"): r for r in mine if r.get("egressgate.mode") == "transparent"}
    for target in ("169.254.169.254", "10.0.0.5"):
        assert transparent[target]["egressgate.decision"] == "deny", transparent.get(target)
    assert {leak, leak_tcp} <= {r.get("dns.question.name") for r in mine if r.get("egressgate.decision") == "deny"}
    # the guest's QUIC datagram was dropped by the run's host table: the netns runtime's rules, unchanged
    (revocation,) = [r for r in mine if r.get("egressgate.operation") == "revocation"]
    assert int(revocation["egressgate.run.dropped.udp"]) >= 1, revocation
    # positive control: from the world's `open` namespace the same attempts reach the canaries
    control_leak = leak_name()
    mark = world.mark()
    ctl = world.exec(world.open, *probe_argv(network_checks(control_leak, leak_name())), timeout=60)
    assert ctl.returncode == 0, ctl.stderr
    assert {"metadata", "private", "metadata-v6"} <= {h["listener"] for h in world.canary_hits(mark)}
    assert control_leak in {q["qname"] for q in world.dns_queries(mark)}
    assert canaries["dot"].hits and canaries["quic"].hits


def test_stdio_signal_and_a_persistent_workspace(gateway: Gateway) -> None:
    """stdin/stdout/stderr are the caller's, a signal passes through (128+N), the audit record names the
    accelerator, and a persistent --workspace comes in (the file the operator left) and goes back (what the
    workload changed), its absolute symlink left out by the copy-back's filter."""
    ws = base_dir("/var/tmp")
    (ws / "in.txt").write_text("from the operator\n")
    script = (
        'read line; echo "got:$line"; cat /workspace/in.txt; echo made > /workspace/out.txt; rm /workspace/in.txt; '
        "mkdir /workspace/sub; echo deep > /workspace/sub/f; ln -s /etc/passwd /workspace/abs; "
        "echo to-stderr >&2; kill -TERM $$"
    )
    try:
        res = run_vm(gateway, "mv-allow", "/bin/sh", "-c", script, stdin="hello from the caller\n", workspace=ws)
        assert res.returncode == 128 + signal.SIGTERM, res.stdout + res.stderr
        assert res.stdout == "got:hello from the caller\nfrom the operator\n"
        assert "to-stderr" in res.stderr
        assert sorted(p.name for p in ws.iterdir()) == ["out.txt", "sub"], res.stderr
        assert (ws / "out.txt").read_text() == "made\n" and (ws / "sub" / "f").read_text() == "deep\n"
        assert (ws / "out.txt").stat().st_uid == 0  # given back to root, as every runtime leaves it
        assert "refused (left out): ./abs" in res.stderr
    finally:
        remove(ws)
    sid = sandbox_id(res.stderr)
    (revocation,) = revocations(gateway, sid)
    accel = revocation["egressgate.run.accel"]
    assert accel in ("kvm", "tcg") and f"microvm: QEMU {accel.upper()}" in res.stderr
    assert revocation["egressgate.run.runtime"] == "microvm"
    assert int(revocation["egressgate.run.signal"]) == signal.SIGTERM


def test_memory_limit_ends_the_run_with_121(gateway: Gateway) -> None:
    # touched in 8 MiB steps (one 256 MiB bytearray would be refused by the guest's overcommit check, a
    # MemoryError, not the limit)
    code = (
        "a = bytearray(16 << 20); print('16 MiB ok', flush=True)\n"
        "b = [bytearray(8 << 20) for _ in range(32)]; print('256 MiB ok', flush=True)"
    )
    res = run_vm(gateway, "mv-mem", GUEST_PY, "-c", code)
    assert res.returncode == 121, res.stdout + res.stderr
    assert res.stdout == "16 MiB ok\n"  # the control: below the limit the same workload allocates
    (revocation,) = revocations(gateway, sandbox_id(res.stderr))
    assert revocation["egressgate.run.limit"] == "memory"


def test_wall_time_is_kept_by_the_host(gateway: Gateway) -> None:
    """wall_time_seconds counts from QEMU's start (the boot included): the host kills QEMU, 124."""
    res = run_vm(gateway, "mv-wall", "/bin/sleep", "600")
    assert res.returncode == 124, res.stderr
    (revocation,) = revocations(gateway, sandbox_id(res.stderr))
    assert revocation["egressgate.run.limit"] == "wall_time"


def test_host_paths_are_refused(gateway: Gateway) -> None:
    res = run_vm(gateway, "mv-hostpath", "/bin/true")
    assert res.returncode == 120 and "filesystem.allow" in res.stderr, res.stderr


def wait_for_qemu(gateway: Gateway, proc: subprocess.Popen[str], timeout: float = 120) -> dict:
    """The run record of `proc` once its QEMU runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in (gateway.state_dir / "runs").glob("*.json"):
            with contextlib.suppress(ValueError, OSError):
                record = json.loads(path.read_text())
                pid = record.get("workload_pid") if record.get("owner_pid") == proc.pid else None
                if pid and Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"qemu-system"):
                    return record
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("QEMU did not start")


def test_sigkill_of_sandbox_run_leaves_nothing(gateway: Gateway) -> None:
    proc = subprocess.Popen(
        vm_argv(gateway, "mv-allow", "/bin/sh", "-c", "echo ready; exec sleep 120"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=gateway.caller_env(),
        preexec_fn=_limits,
    )
    try:
        record = wait_for_qemu(gateway, proc)  # QEMU, the tap, the image all exist: the guest's boot adds nothing
        qemu = record["workload_pid"]
        vm_dir = Path(record["vm_dir"])
        assert (vm_dir / "workspace.img").is_file()
        ns = f"egressgate-{record['run_id']}"
        links = subprocess.run(["ip", "-n", ns, "-o", "link"], capture_output=True, text=True, check=False).stdout
        assert ": tap0:" in links and ": br0:" in links, links  # what must go: the tap and bridge in its netns
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            left = leftovers(gateway)
            if (
                not any(left.values())
                and not Path(f"/proc/{qemu}").exists()
                and not vm_dir.exists()
                and not uid_pids(record["uid"])
            ):
                break
            time.sleep(0.2)
        assert not any(leftovers(gateway).values()), leftovers(gateway)
        assert not Path(f"/proc/{qemu}").exists() and not vm_dir.exists() and not uid_pids(record["uid"])
        cgroups = [p for p in Path("/sys/fs/cgroup").glob(f"*/egressgate/{record['run_id']}")]
        assert cgroups == [] and not Path(f"/sys/fs/cgroup/unified/egressgate/{record['run_id']}").exists()
        (revocation,) = revocations(gateway, record["sandbox_id"])
        assert revocation["egressgate.run.ended_by"] == "watchdog"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
