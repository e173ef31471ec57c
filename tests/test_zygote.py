"""The test fork server (tests/support/zygote.py) starts a gateway the exec'd console script would start:
same process name, working directory, signal dispositions and mask, open file descriptors,
argv as the product sees it, and exit statuses; and it steps aside whenever it could not be (another
interpreter-level environment, the off switch, a custom launcher)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import zygote
from tests.support.cli import POLICIES, cli
from tests.support.env import netns_unavailable_reason
from tests.support.launcher import EGRESSGATE, drain, launch_loopback, stop_process, write_policies


def _config(tmp: Path) -> dict[str, Any]:
    policies = write_policies(tmp / "policies", {"p": {"sandbox": {"name": "p"}, "network": {}}})
    return {
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
        "policy": str(policies),
        "var_dir": str(tmp / "var"),
    }


# Signals 32 and 33 are glibc's own (thread cancellation, setxid broadcast): no program can set or query them
# (sigaction refuses them), and a posix_spawn'd child gets them ignored where a forked one does not.
LIBC_INTERNAL = (1 << 31) | (1 << 32)


def _portrait(pid: int, tmp: Path) -> dict[str, Any]:
    """What an observer of the process sees, with the test's own directory and socket numbers factored out."""
    proc = Path(f"/proc/{pid}")
    status = dict(line.split(":\t", 1) for line in (proc / "status").read_text().splitlines() if ":\t" in line)
    fds = []
    for fd in sorted(os.listdir(proc / "fd"), key=int):
        try:
            target = os.readlink(proc / "fd" / fd)
        except FileNotFoundError:
            continue
        fds.append((int(fd), re.sub(r"\[\d+\]", "[N]", target.replace(str(tmp), "TMP"))))
    return {
        "comm": (proc / "comm").read_text().strip(),
        "cwd": os.readlink(proc / "cwd").replace(str(tmp), "TMP"),
        "signals": {k: int(status[k], 16) & ~LIBC_INTERNAL for k in ("SigBlk", "SigIgn", "SigCgt")},
        "fds": fds,
        "pgrp": os.getpgid(pid) == os.getpgid(0),
        "session": os.getsid(pid) == os.getsid(0),
    }


def _start(tmp: Path, switch: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], dict[str, Any]]:
    monkeypatch.setenv(zygote.SWITCH, switch)
    monkeypatch.chdir(tmp)
    gw = launch_loopback(tmp, _config(tmp))
    drain(gw["proc"])
    try:
        return gw, _portrait(gw["proc"].pid, tmp)
    except BaseException:
        stop_process(gw["proc"])
        raise


def test_a_forked_gateway_looks_like_an_exec_d_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "exec").mkdir()
    (tmp_path / "fork").mkdir()
    forked_before = zygote.FORKED
    real, real_view = _start(tmp_path / "exec", "0", monkeypatch)
    forked, forked_view = _start(tmp_path / "fork", "1", monkeypatch)
    try:
        assert isinstance(real["proc"], subprocess.Popen)  # the switch runs the real command
        assert isinstance(forked["proc"], zygote.ZygoteProcess) and forked_before + 1 == zygote.FORKED
        assert real_view["comm"] == "egressgate" and real_view["cwd"] == "TMP"
        assert forked_view == real_view
    finally:
        assert stop_process(forked["proc"]) == 0  # SIGTERM: the graceful stop, exit status from the server
        assert stop_process(real["proc"]) == 0
    assert forked["proc"].poll() == 0 and forked["proc"].returncode == 0


def test_exit_statuses_and_signals_come_back_as_popen_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(zygote.SWITCH, "1")
    gw = launch_loopback(tmp_path, _config(tmp_path))
    proc = gw["proc"]
    assert isinstance(proc, zygote.ZygoteProcess)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None
    cpu_before = zygote.ZYGOTE_CPU
    proc.kill()
    assert proc.wait(60) == -signal.SIGKILL
    assert cpu_before < zygote.ZYGOTE_CPU  # its CPU is counted (--cpu-report)
    proc.kill()  # after the exit: a no-op, as Popen's (the server never signals a reaped pid)
    # a command that fails: its exit code and its stderr, through the caller's own fds
    err = tmp_path / "err"
    with (
        err.open("w") as fh,
        zygote.popen(
            [EGRESSGATE, "run", "--config", str(tmp_path / "missing.yaml")],
            stdout=subprocess.PIPE,
            stderr=fh,
            text=True,
        ) as bad,
    ):
        assert isinstance(bad, zygote.ZygoteProcess)
        assert bad.stdout is not None and bad.stdout.read() == ""
        assert bad.wait(60) != 0
    assert "missing.yaml" in err.read_text()


def test_it_steps_aside_when_the_interpreter_would_differ(tmp_path: Path) -> None:
    argv = [EGRESSGATE, "--version"]
    same = zygote.popen(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, "NO_PROXY": "x"})
    other = zygote.popen(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "error"})
    off = zygote.popen(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, zygote.SWITCH: "0"})
    script = tmp_path / "egressgate"
    script.symlink_to(EGRESSGATE)
    elsewhere = zygote.popen([str(script), "--version"], stdout=subprocess.PIPE, text=True)
    outputs = []
    for proc in (same, other, off, elsewhere):
        assert proc.stdout is not None
        outputs.append(proc.stdout.read())
        assert proc.wait(60) == 0
        proc.stdout.close()
    assert isinstance(same, zygote.ZygoteProcess)  # a run-time-only variable differs: forked
    assert isinstance(other, subprocess.Popen) and isinstance(elsewhere, subprocess.Popen)
    assert len(set(outputs)) == 1 and outputs[0].strip(), outputs


def test_cli_calls_answer_as_the_exec_d_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/support/cli.py's `python -m egressgate` through the fork server: same exit codes, stdout and
    stderr (click names the program from how it was started: `python -m egressgate`) as the exec'd one."""
    calls = [("--help",), ("nonsense",), ("policy", "check", str(POLICIES)), ("policy", "check", "/nonexistent")]
    answers = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(zygote.SWITCH, switch)
        forked = zygote.FORKED
        answers[switch] = [(r.returncode, r.stdout, r.stderr) for r in (cli(*args) for args in calls)]
        assert zygote.FORKED - forked == (len(calls) if switch == "1" else 0)
    assert answers["1"] == answers["0"]
    assert [code for code, _, _ in answers["1"]] == [0, 2, 0, answers["0"][3][0]] and answers["0"][3][0] != 0
    assert "python -m egressgate" in answers["1"][1][2]


def _ns_portrait(pid: int) -> dict[str, Any]:
    """What a process in a namespace sees: its network namespace, its /etc/resolv.conf (through its own
    mount namespace), what is mounted on /sys and /etc, and whether its mount namespace is its own."""
    proc = Path(f"/proc/{pid}")
    mounts = []
    for line in (proc / "mountinfo").read_text().splitlines():
        fields = line.split()
        mount_point, fstype = fields[4], fields[fields.index("-") + 1]
        if mount_point == "/sys" or mount_point.startswith("/etc/"):
            mounts.append((mount_point, fstype, fields[3]))
    return {
        "net": os.readlink(proc / "ns" / "net"),
        "own_mount_ns": os.readlink(proc / "ns" / "mnt") != os.readlink("/proc/self/ns/mnt"),
        "resolv.conf": (proc / "root" / "etc" / "resolv.conf").read_text(),
        "mounts": sorted(mounts),
    }


def test_a_gateway_forked_into_a_namespace_sees_what_ip_netns_exec_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.networld import world
    from tests.support.launcher import launch_in_namespace

    if reason := netns_unavailable_reason():
        pytest.fail(f"network namespaces are needed here: {reason}")
    (tmp_path / "world").mkdir()
    with world(tmp_path / "world") as w:
        views = {}
        for switch in ("0", "1"):
            monkeypatch.setenv(zygote.SWITCH, switch)
            base = tmp_path / f"gw{switch}"
            base.mkdir()
            config = _config(base)
            config["listen"] = {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None}
            proc, _, _, stderr = launch_in_namespace(w, w.gw, base, config)
            try:
                kind = zygote.ZygoteProcess if switch == "1" else subprocess.Popen
                assert isinstance(proc, kind)
                views[switch] = _ns_portrait(proc.pid)
            finally:
                assert stop_process(proc) == 0
                stderr.close()
        assert views["1"] == views["0"]
        assert views["1"]["net"] != os.readlink("/proc/self/ns/net") and views["1"]["own_mount_ns"]
        netns_etc = Path("/etc/netns") / w.gw
        if (netns_etc / "resolv.conf").exists():  # the namespace's own resolv.conf is what it reads
            assert views["1"]["resolv.conf"] == (netns_etc / "resolv.conf").read_text()
