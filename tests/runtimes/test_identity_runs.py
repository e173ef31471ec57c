"""One host identity per sandbox, end to end (issue 20 item 4): real `sandbox run`s, real bwrap.

Two concurrent netns sandboxes under different policies get different host uids, so B cannot read A's
mode-0600 workspace file through A's host path (when the host root makes it visible at all), and a
process with B's uid cannot read A's /proc/<pid>/environ (its token) or signal it. Positive control: the
same attacks with A's uid succeed, so the protection is the uid and nothing else. A gateway whose range
holds one uid shows the record, exhaustion (exit 120, one sentence), gc freeing a dead run's uid (and
killing what still ran as it), and the uid's reuse.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressgate.runtimes import identity
from tests.networld import World
from tests.runtimes.harness import Gateway, base_dir, remove, running_gateway, runtime_policy, safety_net
from tests.runtimes.runs import kill_watchdog, netns_commands, wait_for_workload
from tests.support.launcher import private_uid_range

pytestmark = pytest.mark.netns

PY = "/usr/bin/python3"  # reachable by any uid (pyenv under /root is not)

# B's attack from inside: A's workspace by its host path, as the read-only host root shows it
B_PROBE = r"""
import errno, json, os, sys
target = sys.argv[1]
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
out = {"visible": os.path.isdir(target), "read": attempt(lambda: open(target + "/secret").read()),
       "list": attempt(lambda: os.listdir(target)), "uid": os.getuid()}
with open("/workspace/result.json", "w") as fh:
    json.dump(out, fh)
os.execv("/bin/sleep", ["sleep", "60"])
"""

# the same attacks from the host, as a process of some uid: A's environ, A's file, a signal to A
HOST_PROBE = r"""
import errno, json, os, sys
pid, secret = int(sys.argv[1]), sys.argv[2]
def attempt(fn):
    try:
        return fn()
    except OSError as exc:
        return errno.errorcode[exc.errno]
print(json.dumps({"environ": attempt(lambda: open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")),
                  "secret": attempt(lambda: open(secret).read()),
                  "signal": attempt(lambda: os.kill(pid, 0) or "ok")}))
"""


def _popen(gateway: Gateway, *command: str, policy: str, workspace: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(gateway.run_argv(*command, policy=policy, workspace=workspace), text=True,
                            env=gateway.caller_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=safety_net)


def _sandbox_pids(run_id: str) -> list[int]:
    res = subprocess.run(["ip", "netns", "pids", f"egressgate-{run_id}"], capture_output=True, text=True,
                         check=False)
    return [int(p) for p in res.stdout.split()]


def _ids(pid: int) -> tuple[list[int], list[int]]:
    """(Uid, Gid) lines of /proc/<pid>/status: real, effective, saved, filesystem, as the host sees them."""
    lines = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return [int(x) for x in lines["Uid"].split()], [int(x) for x in lines["Gid"].split()]


def _as_uid(uid: int, *args: str) -> dict:
    res = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", PY, "-c", HOST_PROBE,
                          *args], capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _stop(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.communicate(timeout=30)


def test_concurrent_sandboxes_cannot_read_or_signal_each_other(gateway: Gateway) -> None:
    ws_a, ws_b = base_dir("/var/tmp"), base_dir("/var/tmp")  # not /tmp: each sandbox has its own /tmp
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(_popen(gateway, "sh", "-c", 'umask 077; echo "$HTTP_PROXY" > /workspace/secret; '
                            "exec sleep 60", policy="rt-allow", workspace=ws_a))
        rec_a = wait_for_workload(gateway, procs[0])
        deadline = time.monotonic() + 10
        while not (ws_a / "secret").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        token_url = (ws_a / "secret").read_text().strip()
        assert token_url.startswith("http://") and "@" in token_url
        first, last = gateway.uid_range
        uid_a = rec_a["uid"]
        assert first <= uid_a <= last and rec_a["gid"] == uid_a
        # every process of the sandbox runs as the allocated host uid/gid (what ps shows), and owns its files
        pids = _sandbox_pids(rec_a["run_id"])
        assert pids
        for pid in pids:
            assert _ids(pid) == ([uid_a] * 4, [uid_a] * 4), pid
        assert (ws_a / "secret").stat().st_uid == uid_a and (ws_a / "secret").stat().st_mode & 0o777 == 0o600
        assert ws_a.stat().st_uid == uid_a
        sleep_a = next(pid for pid in pids if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep")

        procs.append(_popen(gateway, PY, "-c", B_PROBE, str(ws_a), policy="rt-nomask", workspace=ws_b))
        rec_b = wait_for_workload(gateway, procs[1])
        deadline = time.monotonic() + 10
        while not (ws_b / "result.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        inside_b = json.loads((ws_b / "result.json").read_text())
        uid_b = rec_b["uid"]
        assert first <= uid_b <= last and uid_b != uid_a
        # inside, the workload sees itself as nobody; on the host it is B's own uid
        assert inside_b["uid"] == 65534
        assert {tuple(_ids(pid)[0]) for pid in _sandbox_pids(rec_b["run_id"])} == {(uid_b,) * 4}
        if inside_b["visible"]:  # the host root shows A's workspace: the uid alone must refuse it
            assert inside_b["read"] == "EACCES" and inside_b["list"] == "EACCES", inside_b
        else:  # a filesystem allowlist hides it
            assert inside_b["read"] == "ENOENT", inside_b

        # from the host, as B's uid: A's environ (its token), A's file and a signal to A are refused ...
        as_b = _as_uid(uid_b, str(sleep_a), str(ws_a / "secret"))
        assert as_b == {"environ": "EACCES", "secret": "EACCES", "signal": "EPERM"}, as_b
        # ... positive control: as A's uid (what every sandbox shared before) all three succeed
        as_a = _as_uid(uid_a, str(sleep_a), str(ws_a / "secret"))
        assert token_url in as_a["environ"] and as_a["secret"].strip() == token_url and as_a["signal"] == "ok"
        _stop(*procs)
        assert procs[0].returncode == 128 + signal.SIGTERM
        # the end of A's run gave its files back to root: a later run given uid_a reads none of them
        assert (ws_a / "secret").stat().st_uid == 0 and ws_a.stat().st_uid == 0
        assert _as_uid(uid_a, str(sleep_a), str(ws_a / "secret"))["secret"] == "EACCES"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        remove(ws_a)
        remove(ws_b)


@pytest.fixture(scope="module")
def one_uid(world: World) -> Iterator[tuple[Gateway, int]]:
    """A gateway whose runtime.uid_range holds a single uid."""
    uid = int(private_uid_range(1).split("-")[0])
    with running_gateway(world, {"id-one": runtime_policy("id-one")}, runtime={"uid_range": f"{uid}-{uid}"}) as gw:
        yield gw, uid


def test_exhausted_range_then_gc_frees_and_the_uid_is_reused(one_uid: tuple[Gateway, int]) -> None:
    gateway, uid = one_uid
    proc = gateway.popen_run("sleep", "60", policy="id-one")
    try:
        record = wait_for_workload(gateway, proc)
        assert record["uid"] == uid and record["gid"] == uid
        # the range is exhausted while A holds its uid: exit 120 and one sentence
        refused = gateway.run("true", policy="id-one")
        assert refused.returncode == 120, refused.stderr
        assert refused.stderr.count("\n") == 1 and "runtime.uid_range" in refused.stderr, refused.stderr
        assert "sandbox gc" in refused.stderr
        # A dies by SIGKILL with its watchdog: its record (and uid) stays until gc
        kill_watchdog(record)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=20)
        deadline = time.monotonic() + 10
        while netns_commands(record["run_id"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gateway.run("true", policy="id-one").returncode == 120  # still held by the dead run's record
        # something still running as the dead run's uid (as an escaped process would) is killed by gc
        leftover = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                                     "sleep", "60"])
        try:
            gc = subprocess.run(gateway.cmd("sandbox", "gc", "--config", str(gateway.config)), capture_output=True,
                                text=True, timeout=60, check=False)
            assert gc.returncode == 0, gc.stdout + gc.stderr
            assert f"processes of uid {uid}" in gc.stdout and f"run record {record['run_id']}" in gc.stdout
            assert leftover.wait(10) == -signal.SIGKILL
        finally:
            leftover.kill()
            leftover.wait()
        # freed (once the killed processes are gone): the next runs get the same uid
        deadline = time.monotonic() + 10
        while identity.uid_pids(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        again = gateway.run("cat", "/proc/self/uid_map", policy="id-one")
        assert again.returncode == 0, again.stderr
        assert again.stdout.split() == ["65534", "0", "1"]  # bwrap's nested namespace: 0 is the outer one's
        reuse = gateway.popen_run("sleep", "60", policy="id-one")
        try:
            assert wait_for_workload(gateway, reuse)["uid"] == uid
        finally:
            _stop(reuse)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
