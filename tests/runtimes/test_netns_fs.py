"""The netns sandbox's file tree is built from an allowlist (runtimes/sandbox_fs.py), and no set-id file
survives in a workspace (issue 20, items 2 and 5 and the filesystem item). Real bwrap, real gateway; each
absence has its positive control (the path exists on the host, the message reaches a host socket from
outside, the bit is really set before teardown strips it)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.networld import World
from tests.runtimes.escape_probe import PROBE, PY, parse, probe_argv
from tests.runtimes.harness import Gateway, base_dir, remove, running_gateway, runtime_policy, sandbox_id
from tests.runtimes.runs import revocations

pytestmark = pytest.mark.netns
SANDBOX = 65534


@pytest.fixture(scope="module")
def trees() -> Iterator[dict[str, Path]]:
    """Host trees this module owns: an allowed read-only and read-write tree (with a denied file inside the
    read-only one), another sandbox's workspace, a /run dir with a datagram socket, and a socket tree."""
    base = base_dir("/var/tmp")
    run_dir = Path(f"/run/egX-{secrets.token_hex(4)}")
    run_dir.mkdir(mode=0o755)
    made = {"base": base, "ro": base / "ro", "rw": base / "rw", "other_ws": base / "other-ws", "run": run_dir,
            "sockdir": base / "sockdir"}
    for key in ("ro", "rw", "other_ws", "sockdir"):
        made[key].mkdir(mode=0o755)
    (made["ro"] / "data.txt").write_text("allowed host data\n")
    (made["ro"] / "secret.txt").write_text("denied host data\n")
    made["rw"].chmod(0o1777)  # each run has its own host uid (runtime.uid_range): writable for any, like /tmp
    (made["other_ws"] / "token.txt").write_text("another sandbox's file\n")
    for p in made["ro"].iterdir():
        p.chmod(0o644)
    (made["other_ws"] / "token.txt").chmod(0o644)
    try:
        yield made
    finally:
        remove(base)
        remove(run_dir)


@pytest.fixture(scope="module")
def fsgw(world: World, trees: dict[str, Path]) -> Iterator[Gateway]:
    allow = [{"path": str(trees["ro"]), "read": True}, {"path": str(trees["rw"]), "read": True, "write": True}]
    policies = {
        "fs-allow": runtime_policy("fs-allow", filesystem__allow=allow,
                                   filesystem__deny=[str(trees["ro"] / "secret.txt")]),
        "fs-plain": runtime_policy("fs-plain"),
        "fs-sock": runtime_policy("fs-sock", filesystem__allow=[{"path": str(trees["sockdir"]), "read": True}]),
    }
    with running_gateway(world, policies) as gw:
        yield gw


def test_only_the_allowlist_exists_inside(fsgw: Gateway, trees: dict[str, Path]) -> None:
    """Host paths outside the allowlist are absent (control: present on the host); allowed trees are there,
    read-only or read-write as written; deny masks inside an allowed tree; the tools still run."""
    absent = ["/home", "/root", "/opt", "/srv", "/boot", "/work", str(trees["other_ws"]),
              str(fsgw.base / "var"), str(trees["run"]), "/run/netns", "/sys"]
    for path in absent:
        assert os.path.lexists(path), path  # positive control: each exists on the host
    ro, rw = trees["ro"], trees["rw"]
    checks = [["exists", p] for p in absent] + [
        ["open", str(ro / "data.txt"), "r"], ["open", str(ro / "new.txt"), "w"], ["open", str(rw / "new.txt"), "w"],
        ["open", str(ro / "secret.txt"), "r"], ["open", "/etc/passwd", "r"], ["exists", "/etc/shadow"]]
    res = fsgw.run(*probe_argv(checks), policy="fs-allow")
    assert res.returncode == 0, res.stderr
    out = parse(res.stdout)
    seen = {path: r["ok"] for path, r in zip(absent, out, strict=False)}
    assert not any(seen.values()), seen
    data, ro_write, rw_write, denied, etc_passwd, shadow = out[len(absent):]
    assert data == {"ok": True} and etc_passwd == {"ok": True}
    assert ro_write == {"ok": False, "error": "EROFS"}
    assert rw_write == {"ok": True} and (rw / "new.txt").exists()  # the write reached the host tree
    assert denied == {"ok": False, "error": "EACCES"}
    assert shadow == {"ok": False}
    # with no allowed path under /var, /var does not exist at all (above, the allowed trees' parents exist
    # inside as empty read-only directories: bwrap makes the mount points; nothing of the host's is in them)
    plain = fsgw.run(*probe_argv([["exists", "/var/tmp"], ["exists", "/var"], ["exists", "/home"]]), policy="fs-plain")
    assert parse(plain.stdout) == [{"ok": False}] * 3, plain.stderr
    tools = fsgw.run("sh", "-c", "id -un; python3 -c 'print(2+2)'; curl --version | head -c 4; ls /",
                     policy="fs-allow")
    assert tools.returncode == 0, tools.stderr
    lines = tools.stdout.splitlines()
    assert lines[0] == "nobody" and lines[1] == "4" and lines[2].startswith("curl"), tools.stdout
    assert "home" not in lines and "root" not in lines and "usr" in lines[2:] + lines[2].split("curl")[-1:]


def test_an_allowed_path_holding_a_socket_refuses_the_run(fsgw: Gateway, trees: dict[str, Path]) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = trees["sockdir"] / "deep"
    path.mkdir(exist_ok=True)
    sock.bind(str(path / "svc.sock"))
    try:
        res = fsgw.run("true", policy="fs-sock")
        assert res.returncode == 120, res.stderr
        assert "holds a socket" in res.stderr and "svc.sock" in res.stderr, res.stderr
    finally:
        sock.close()
        (path / "svc.sock").unlink()
    ok = fsgw.run("true", policy="fs-sock")  # positive control: the same policy without the socket runs
    assert ok.returncode == 0, ok.stderr


def test_datagram_socketpair_reaches_no_host_socket(fsgw: Gateway, trees: dict[str, Path]) -> None:
    """Item 2: socketpair(AF_UNIX, SOCK_DGRAM) + sendto()/connect() to host datagram sockets (under /run, the
    host's /var/tmp and /tmp) fails inside; the same sendto from a uid-65534 process outside is received."""
    tmp_dir = base_dir("/tmp")  # a HOST /tmp dir: the sandbox has its own /tmp
    servers, paths = [], [trees["run"] / "dg.sock", trees["base"] / "dg.sock", tmp_dir / "dg.sock"]
    try:
        for path in paths:
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            srv.bind(str(path))
            path.chmod(0o666)
            srv.setblocking(False)
            servers.append(srv)
        checks = [["dgram", str(p), how] for p in paths for how in ("sendto", "connect")]
        res = fsgw.run(*probe_argv(checks), policy="fs-allow")
        assert res.returncode == 0, res.stderr
        assert all(not r["ok"] and r["error"] == "ENOENT" for r in parse(res.stdout)), res.stdout
        time.sleep(0.2)
        for srv in servers:
            with pytest.raises(BlockingIOError):
                srv.recv(100)
        # positive control: the same attempts from the sandbox's uid on the host reach every socket
        ctl = subprocess.run(["setpriv", "--reuid", str(SANDBOX), "--regid", str(SANDBOX), "--clear-groups", PY,
                              "-c", PROBE, json.dumps([["dgram", str(p), "sendto"] for p in paths])],
                             capture_output=True, text=True, timeout=30, check=False)
        assert parse(ctl.stdout) == [{"ok": True}] * len(paths), ctl.stderr
        for srv in servers:
            srv.setblocking(True)
            srv.settimeout(5)
            assert srv.recv(100) == b"egX leak"
    finally:
        for srv in servers:
            srv.close()
        remove(tmp_dir)


def test_setid_bits_cannot_be_set_and_are_stripped_at_teardown(fsgw: Gateway, trees: dict[str, Path]) -> None:
    """Item 5: inside, chmod u+s / g+s and open(O_CREAT, 04755) are refused (seccomp); a bit set from the
    host during the run (the seccomp rule cannot see that) is stripped at teardown and audited."""
    ws = base_dir("/var/tmp") / "ws"
    try:
        checks = [["chmod", "/workspace/a", 0o4755, True], ["open", "/workspace/b", "w"],
                  ["chmod", "/workspace/b", 0o4755], ["chmod", "/workspace/b", 0o2755],
                  ["chmod", "/workspace/b", 0o755]]
        res = fsgw.run(*probe_argv(checks), policy="fs-allow", workspace=ws)
        assert res.returncode == 0, res.stderr
        created, _opened, suid, sgid, plain = parse(res.stdout)
        assert created == {"ok": False, "error": "EPERM"} and suid == sgid == {"ok": False, "error": "EPERM"}
        assert plain == {"ok": True}  # positive control: ordinary modes work
        assert not (ws / "b").stat().st_mode & 0o6000
        # plant from the host while the workload waits, then let it end
        script = "touch /workspace/planted; while [ ! -e /workspace/go ]; do sleep 0.05; done"
        proc = subprocess.Popen(fsgw.run_argv("sh", "-c", script, policy="fs-allow", workspace=ws), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=fsgw.caller_env())
        deadline = time.monotonic() + 30
        while not (ws / "planted").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        (ws / "planted").chmod(0o6755)
        assert (ws / "planted").stat().st_mode & 0o6000 == 0o6000  # control: the bits are really set
        (ws / "go").touch()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert (ws / "planted").stat().st_mode & 0o7777 == 0o755
        sid = sandbox_id(err)
        (rev,) = [r for r in revocations(fsgw, sid) if r.get("egressgate.run.setid_stripped")] or [None]
        assert rev is not None, revocations(fsgw, sid)
        stripped = rev["egressgate.run.setid_stripped"]  # the harness flattens scalars only: an OTLP array
        assert [v["stringValue"] for v in stripped["values"]] == ["planted"], stripped
    finally:
        remove(ws.parent)
