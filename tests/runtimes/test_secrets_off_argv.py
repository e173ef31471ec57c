"""No secret of a run on any command line or environment another local user can read (issue 20, item 6),
and a run's token bound to its own source address (issue 20, "tokens bound to their addresses").

The scan is what a local attacker does: during a run, a forked child of the test drops to an unprivileged
host uid (UNPRIVILEGED, neither root nor the sandbox uid) and reads every /proc/*/cmdline and
/proc/*/environ it can. The needles are the run's own proxy token and phantom credential, which the
workload writes into its workspace for the test. The positive control plants both where that user can
read them (a command line of a root process, the environment of a process of its own uid) and the same
scan finds them, so "nothing found" is a result and not a blind scan.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.networld import World
from tests.runtimes.harness import Gateway, base_dir, remove, running_gateway, runtime_policy, sandbox_id
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns

UNPRIVILEGED = 65533  # a host uid that is neither root nor the sandbox's (65534)
PHANTOM_ENV = "EGN_PHANTOM_KEY"
POLICY = "rt-argv"
# the workload publishes its secrets to the test, then waits until the test says it is done
PUBLISH = ('printf "%s\\n%s\\n%s\\n%s\\n" "$EGRESSGATE_SANDBOX_TOKEN" "$' + PHANTOM_ENV + '" "$HTTP_PROXY" '
           '"$EGRESSGATE_SANDBOX_ID" '
           '> /workspace/.secrets.tmp && mv /workspace/.secrets.tmp /workspace/secrets; '
           'i=0; while [ ! -e /workspace/done ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done')


@pytest.fixture(scope="module")
def gateway(world: World) -> Iterator[Gateway]:
    """The runtime gateway with a policy that hands out a phantom credential (a second secret that
    admission puts into the workload's environment)."""
    policy = runtime_policy(POLICY)
    policy["network"]["https"]["allow"].append({"id": "phantom", "host": "phantom.allowed.test",
                                                "credential": "fake"})
    policy["credentials"] = {"capabilities": {"fake": {
        "type": "static", "source": {"file": "/nonexistent/egN-secret"}, "placement": {"header": "x-api-key"},
        "mode": "phantom", "phantom_env": PHANTOM_ENV}}}
    with running_gateway(world, {POLICY: policy}) as gw:
        yield gw


def scan_as(uid: int, needles: list[str]) -> dict:
    """Fork; in the child drop to `uid` (no groups) and read every /proc/*/cmdline and environ it can.
    Returns {"hits": [[pid, file, needle index]], "cmdline": n, "environ": n} (n: files read)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no imports, no locks, only os calls, then _exit
        try:
            os.close(read_end)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            out: dict = {"hits": [], "cmdline": 0, "environ": 0}
            encoded = [n.encode() for n in needles]
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                for name in ("cmdline", "environ"):
                    try:
                        with open(f"/proc/{entry}/{name}", "rb") as fh:
                            data = fh.read()
                    except OSError:
                        continue
                    out[name] += 1
                    out["hits"] += [[int(entry), name, i] for i, n in enumerate(encoded) if n in data]
            os.write(write_end, json.dumps(out).encode())
            os._exit(0)
        except BaseException:
            os._exit(99)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the scanning child failed"
    return json.loads(b"".join(chunks))


def wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)
    return path.read_text()


def start_publishing(gateway: Gateway, ws: Path, dockerd: Dockerd | None = None,
                     runtime: str = "netns") -> tuple[subprocess.Popen[str], list[str]]:
    """A run whose workload wrote [token, phantom, proxy URL, id] to ws/secrets and waits for ws/done."""
    argv = gateway.run_argv("sh", "-c", PUBLISH, policy=POLICY, workspace=ws)
    env = gateway.caller_env()
    if dockerd is not None:
        at = argv.index("--")
        argv[at:at] = ["--runtime", runtime, "--image", dockerd.busybox_image()]
        env["DOCKER_HOST"] = dockerd.host
    proc = subprocess.Popen(argv, text=True, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    secrets = wait_for(ws / "secrets", proc).splitlines()
    assert len(secrets) == 4 and len(secrets[0]) >= 32 and len(secrets[1]) >= 16, secrets
    return proc, secrets


def finish(proc: subprocess.Popen[str], ws: Path) -> tuple[str, str]:
    (ws / "done").write_text("")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return out, err


def memfd_contents(pid: int) -> list[bytes]:
    """What each memfd a process holds contains (root's view: bwrap must have closed its --args fd)."""
    out = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:"):
                out.append(fd.read_bytes())
        except OSError:
            continue
    return out


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # scan_as's child
def test_no_secret_in_any_readable_cmdline_or_environ(gateway: Gateway) -> None:
    ws = base_dir()
    proc = None
    try:
        proc, secrets = start_publishing(gateway, ws)
        needles = secrets[:2]
        found = scan_as(UNPRIVILEGED, needles)
        assert found["hits"] == [], found["hits"]
        assert found["cmdline"] > 0  # the scan read something (pids of other users' processes included)
        # bwrap's command line says only where the environment came from, never what it is
        record = next(json.loads(p.read_text()) for p in (gateway.state_dir / "runs").glob("*.json")
                      if json.loads(p.read_text()).get("owner_pid") == proc.pid)
        bwrap_cmdline = Path(f"/proc/{record['workload_pid']}/cmdline").read_bytes().split(b"\0")
        assert b"--args" in bwrap_cmdline and b"--setenv" not in bwrap_cmdline, bwrap_cmdline
        assert not any(n.encode() in blob for n in needles for blob in memfd_contents(record["workload_pid"]))
        assert Path(f"/proc/{record['workload_pid']}/environ").read_bytes() == b""  # not even the caller's
        # positive control: the same scan finds the token on a command line and the phantom in an
        # environment that this user may read
        planted = subprocess.Popen(["sh", "-c", "sleep 30", "egN-planted", needles[0]])
        own = subprocess.Popen(["sleep", "30"], env={PHANTOM_ENV: needles[1]}, user=UNPRIVILEGED,
                               group=UNPRIVILEGED, extra_groups=[])
        try:
            deadline = time.monotonic() + 5
            while True:
                control = scan_as(UNPRIVILEGED, needles)
                hits = {(pid, name, i) for pid, name, i in control["hits"]}
                if {(planted.pid, "cmdline", 0), (own.pid, "environ", 1)} <= hits or time.monotonic() > deadline:
                    break
                time.sleep(0.05)  # until both have exec'd
            assert hits == {(planted.pid, "cmdline", 0), (own.pid, "environ", 1)}, control
        finally:
            for p in (planted, own):
                p.kill()
                p.wait()
        out, err = finish(proc, ws)
        proc = None
        assert needles[0] not in out + err and needles[1] not in out + err
    finally:
        if proc is not None:
            proc.kill()
            proc.communicate()
        remove(ws)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # scan_as's child
@pytest.mark.parametrize("runtime", ["docker", "gvisor"])
def test_no_secret_readable_from_a_container_run(gateway: Gateway, dockerd: Dockerd, runtime: str) -> None:
    """Docker/gVisor parity: the environment goes to the daemon in the API request body, so no process of
    the run (dockerd, containerd, shim, runc/runsc, the workload) shows it to another local user. The
    positive control is the netns test's (the same scan finds planted needles)."""
    ws = base_dir()
    proc = None
    try:
        proc, secrets = start_publishing(gateway, ws, dockerd, runtime)
        needles = secrets[:2]
        found = scan_as(UNPRIVILEGED, needles)
        assert found["hits"] == [], found["hits"]
        assert found["cmdline"] > 0
        # control: the token was there to be found. Under runc root reads it in the workload's own
        # /proc/<pid>/environ; under gVisor the workload's environment lives inside gVisor's kernel (no host
        # process has it), and root finds it only in the container's config through the daemon's API
        if runtime == "docker":
            root = scan_as(0, needles[:1])
            assert root["hits"] and {h[1] for h in root["hits"]} == {"environ"}, root
        run_id = next(path.stem for path in (gateway.state_dir / "runs").glob("*.json")
                      if json.loads(path.read_text()).get("owner_pid") == proc.pid)
        env = dockerd.docker("inspect", "-f", "{{json .Config.Env}}", f"egressgate-{run_id}").stdout
        assert needles[0] in env and needles[1] in env
        out, err = finish(proc, ws)
        proc = None
        assert needles[0] not in out + err and needles[1] not in out + err
    finally:
        if proc is not None:
            proc.kill()
            proc.communicate()
        remove(ws)


def test_a_run_with_a_nul_in_its_environment_refuses_to_start() -> None:
    """A NUL would split bwrap's --args record (a variable named by the value's tail): refused, not cut."""
    from egressgate.runtimes.netns import BwrapCommand

    cmd = BwrapCommand()
    with pytest.raises(ValueError, match="NUL"):
        cmd.environment({"A": "x\0--setenv"})
    cmd.environment({"A": "1", "B": "two words"})
    try:
        (fd,) = cmd.fds
        assert cmd.args == ["--args", str(fd)]
        assert os.pread(fd, 4096, 0) == b"--clearenv\0--setenv\0A\x001\0--setenv\0B\0two words\0"
    finally:
        cmd.close()


STEAL = (
    # A's id:token at B's own proxy address (A's proxy address is not reachable from B: it is DNATed to the
    # transparent listener, which refuses any CONNECT)
    'curl -sS -o /dev/null -D - --max-time 10 -x "http://$(cat /workspace/stolen-user)@${HTTP_PROXY#*@}" '
    'https://api.allowed.test/ '
    '| head -n 1; '
    'curl -sS -o /dev/null -w "%{http_code}\\n" --max-time 10 https://api.allowed.test/own; '
    'curl -sS -o /dev/null -w "%{http_code}\\n" --max-time 10 --noproxy "*" '
    '-H "Proxy-Authorization: $(cat /workspace/stolen-auth)" https://api.allowed.test/transparent'
)


def test_another_runs_token_is_refused_from_this_runs_address(gateway: Gateway) -> None:
    """Run A's token, read by run B (as in issue 20, where B found it in A's workspace): from B's address
    the explicit proxy refuses it (407 identity_address_mismatch, audited under A with B's address), and on
    the transparent listener a token is never read (the request is B's, by its source address). Control:
    B's own proxy settings work, and A's token is accepted from A's address (the run's own requests)."""
    ws_a, ws_b = base_dir(), base_dir()
    proc = None
    try:
        proc, (_token, _phantom, a_proxy, a_id) = start_publishing(gateway, ws_a)
        user, _, _ = a_proxy.removeprefix("http://").partition("@")
        (ws_b / "stolen-user").write_text(user)
        (ws_b / "stolen-auth").write_text("Basic " + base64.b64encode(unquote(user).encode()).decode())
        for name in ("stolen-user", "stolen-auth"):
            (ws_b / name).chmod(0o644)
        thief = gateway.run("sh", "-c", STEAL, policy=POLICY, workspace=ws_b)
        assert thief.returncode == 0, thief.stderr
        lines = thief.stdout.split("\n")
        assert "407" in lines[0], thief.stdout
        assert lines[1:3] == ["200", "200"], thief.stdout  # control: B's own proxy; transparent as B
        b_id = sandbox_id(thief.stderr)
        b_ip = thief.stderr.split(", netns, ")[1].split(")")[0]

        def mismatches(r: dict) -> bool:
            return r.get("egressgate.reason") == "identity_address_mismatch" and r.get("egressgate.sandbox.id") == a_id

        records = gateway.records(predicate=mismatches)
        (refused,) = [r for r in records if mismatches(r)]
        assert refused["client.address"] == b_ip and b_ip in refused["egressgate.detail"], refused
        requests = [r for r in records if r.get("egressgate.operation") in ("connect", "http_request")
                    and r.get("egressgate.decision") == "allow"]
        assert not [r for r in requests if r.get("egressgate.sandbox.id") == a_id], requests
        transparent = [r for r in requests if r.get("egressgate.mode") == "transparent"
                       and r.get("egressgate.sandbox.id") == b_id]
        assert transparent and all(r["client.address"] == b_ip for r in transparent), requests
        finish(proc, ws_a)
        proc = None
    finally:
        if proc is not None:
            proc.kill()
            proc.communicate()
        remove(ws_a)
        remove(ws_b)
