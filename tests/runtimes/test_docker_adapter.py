"""The docker and gvisor adapters on a real dockerd (runc and runsc): the workload is held until start(),
runs as nobody without capabilities on a read-only root with the policy's masks, sees only its own
environment, and every limit ends as the documented ExitInfo. Each isolation check has its positive
control (the same probe without the protection shows what it would have seen)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from egressgate.runtimes import seccompjson
from egressgate.runtimes.base import Limit
from egressgate.runtimes.docker import DockerError, labelled_containers
from tests.runtimes.docker_support import adapter, make_spec, run
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns
RUNTIMES = ["docker", "gvisor"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_held_until_start_in_its_own_netns(dockerd: Dockerd, tmp_path: Path, runtime: str) -> None:
    spec = make_spec(tmp_path, dockerd.busybox_image(), ["sh", "-c", "date > /workspace/started"], runtime=runtime)
    a = adapter(dockerd, runtime)
    try:
        a.prepare(spec)
        ns = a.netns_path()
        assert os.readlink(ns) != os.readlink("/proc/self/ns/net")
        links = subprocess.run(["nsenter", f"--net={ns}", "ip", "-o", "link"], capture_output=True, text=True,
                               check=True).stdout
        assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"], links
        time.sleep(1.0)
        assert not (tmp_path / "ws" / "started").exists(), "the workload ran before start()"
        a.start()
        info = a.wait(time.monotonic() + 60)
    finally:
        a.teardown()
    assert info.status == 0 and info.exit_code() == 0, info
    assert (tmp_path / "ws" / "started").exists()  # positive control: start() does release it


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_exit_status_and_signal(dockerd: Dockerd, tmp_path: Path, runtime: str) -> None:
    img = dockerd.busybox_image()
    info = run(dockerd, runtime, make_spec(tmp_path, img, ["sh", "-c", "exit 7"], runtime=runtime))
    assert (info.status, info.signal, info.limit, info.exit_code()) == (7, None, None, 7)
    info = run(dockerd, runtime, make_spec(tmp_path, img, ["sh", "-c", "kill -KILL $$"], runtime=runtime))
    assert (info.signal, info.limit, info.exit_code()) == (9, None, 137), info


REPORT = (
    "exec > /workspace/report 2>&1; echo uid=$(id -u); grep -E 'Cap(Eff|Bnd)' /proc/self/status; "
    "touch /scratch/x && echo ROOT_WRITABLE; ls /var/run/docker.sock /run/docker.sock && echo SOCK; "
    "echo shadow=$(stat -c '%s:%a' /etc/shadow); cat /etc/shadow >/dev/null && echo SHADOW_READ; "
    "echo sys=$(ls /sys | wc -l); cat /etc/resolv.conf; head -1 /etc/egressgate/ca.pem; "
    "touch /tmp/t && echo TMP_OK; touch /workspace/w && echo WS_OK; echo ENV; env"
)


def _report(dockerd: Dockerd, tmp_path: Path, runtime: str, **kw: object) -> dict[str, object]:
    spec = make_spec(tmp_path, dockerd.busybox_image(), ["sh", "-c", REPORT], runtime=runtime, **kw)  # type: ignore[arg-type]
    info = run(dockerd, runtime, spec)
    text = (tmp_path / "ws" / "report").read_text()
    head, _, env = text.partition("ENV\n")
    envd = dict(line.split("=", 1) for line in env.splitlines() if "=" in line)
    return {"info": info, "text": head, "env": envd}


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_isolation(dockerd: Dockerd, tmp_path: Path, runtime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "host-secret-canary")
    r = _report(dockerd, tmp_path, runtime, deny=["/etc/shadow", "/sys"],
                env={"PATH": "/bin", "HOME": "/workspace", "FROM_ADMISSION": "yes"})
    text, env = str(r["text"]), r["env"]
    assert "uid=65534" in text
    assert "CapEff:\t0000000000000000" in text
    assert "CapBnd:\t0000000000000000" in text  # --cap-drop ALL (a non-root uid has no CapEff anyway)
    assert "ROOT_WRITABLE" not in text and "Read-only file system" in text
    assert "SOCK" not in text
    assert "shadow=0:0" in text and "SHADOW_READ" not in text  # masked by an empty mode-000 file
    assert "sys=0" in text  # a denied directory is empty
    assert "nameserver 198.18.200.1" in text and "BEGIN CERTIFICATE" in text
    assert "TMP_OK" in text and "WS_OK" in text
    assert isinstance(env, dict) and env.get("FROM_ADMISSION") == "yes"
    assert not any("host-secret-canary" in v or k.startswith("AWS") for k, v in env.items()), env
    assert set(env) <= {"PATH", "HOME", "FROM_ADMISSION", "HOSTNAME", "PWD", "SHLVL"}, env
    # positive control: without --read-only and without masks the same probe sees the image's files
    ctrl = _report(dockerd, tmp_path, runtime, deny=[], sandbox={"root_fs": "read_write"})
    assert "ROOT_WRITABLE" in str(ctrl["text"])
    assert "shadow=0:0" not in str(ctrl["text"]) and "sys=0" not in str(ctrl["text"])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_no_new_privileges_set(dockerd: Dockerd, tmp_path: Path, runtime: str) -> None:
    spec = make_spec(tmp_path, dockerd.busybox_image(), ["sh", "-c", "grep NoNewPrivs /proc/self/status "
                                                         "> /workspace/nnp; true"], runtime=runtime)
    a = adapter(dockerd, runtime)
    try:
        a.prepare(spec)
        host_config = a._inspect()["HostConfig"]
        a.start()
        a.wait(time.monotonic() + 60)
    finally:
        a.teardown()
    assert "no-new-privileges" in host_config["SecurityOpt"] and host_config["CapDrop"] == ["ALL"]
    assert host_config["ReadonlyRootfs"] and host_config["NetworkMode"] == "none"
    # the explicit seccomp profile (runtimes/seccompjson.py), not the daemon's default; gVisor's variant
    # refuses clone3/openat2 with SCMP_ACT_TRACE (runsc ignores errnoRet: test_gvisor_threads.py)
    assert seccompjson.security_opt(runtime=a.oci_runtime) in host_config["SecurityOpt"]
    assert (seccompjson.security_opt() in host_config["SecurityOpt"]) == (runtime == "docker")
    if runtime == "docker":  # gVisor's /proc/self/status has no NoNewPrivs line
        assert (tmp_path / "ws" / "nnp").read_text().split() == ["NoNewPrivs:", "1"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_memory_limit_reports_memory(dockerd: Dockerd, tmp_path: Path, runtime: str) -> None:
    spec = make_spec(tmp_path, dockerd.busybox_image(), ["awk", 'BEGIN{s="x"; while(1) s=s s}'], runtime=runtime,
                     sandbox={"resources": {"memory_mb": 48}})
    info = run(dockerd, runtime, spec)
    assert info.limit is Limit.MEMORY and info.exit_code() == 121, info


FORKS = """
import os, sys, time
for _ in range(int(sys.argv[1])):
    try:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
    except BlockingIOError:  # the pids limit: a fork bomb keeps trying, as this one does
        pass
time.sleep(0.5)
"""


def test_pids_limit_reports_pids(dockerd: Dockerd, tmp_path: Path) -> None:
    img = dockerd.python_image()
    spec = make_spec(tmp_path, img, ["python3", "-c", FORKS, "100"], sandbox={"resources": {"pids_max": 24}})
    info = run(dockerd, "docker", spec)
    assert info.limit is Limit.PIDS and info.exit_code() == 122, info
    # positive control: the same workload under a limit it does not reach ends normally
    spec = make_spec(tmp_path, img, ["python3", "-c", FORKS, "5"], sandbox={"resources": {"pids_max": 24}})
    assert run(dockerd, "docker", spec).exit_code() == 0


COUNT_FORKS = """
import os, sys, time
n = 0
for _ in range(int(sys.argv[1])):
    try:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        n += 1
    except BlockingIOError:
        pass
open("/workspace/forks", "w").write(str(n))
"""


def test_gvisor_pids_max_caps_the_workload(dockerd: Dockerd, tmp_path: Path) -> None:
    """Under gVisor pids_max is RLIMIT_NPROC inside gVisor's kernel (Docker's pids limit would count
    gVisor's own threads): a fork loop stops below the limit; without it, all 32 forks (twice the limit)
    succeed."""
    img = dockerd.python_image()
    spec = make_spec(tmp_path, img, ["python3", "-c", COUNT_FORKS, "32"], runtime="gvisor",
                     sandbox={"resources": {"pids_max": 16}})
    assert run(dockerd, "gvisor", spec).status == 0
    assert int((tmp_path / "ws" / "forks").read_text()) < 16
    control = make_spec(tmp_path, img, ["python3", "-c", COUNT_FORKS, "32"], runtime="gvisor")
    assert run(dockerd, "gvisor", control).status == 0
    assert int((tmp_path / "ws" / "forks").read_text()) == 32


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_wall_time_kills(dockerd: Dockerd, tmp_path: Path, runtime: str) -> None:
    spec = make_spec(tmp_path, dockerd.busybox_image(), ["sleep", "60"], runtime=runtime)
    begin = time.monotonic()
    info = run(dockerd, runtime, spec, wall=1.5)
    assert info.limit is Limit.WALL_TIME and info.exit_code() == 124, info
    assert time.monotonic() - begin < 15


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_teardown_leaves_nothing(dockerd: Dockerd, tmp_path: Path, runtime: str) -> None:
    spec = make_spec(tmp_path, dockerd.busybox_image(), ["sleep", "60"], runtime=runtime)
    a = adapter(dockerd, runtime)
    a.prepare(spec)
    pid = a.pid
    assert spec.run_id in labelled_containers(dockerd.host).values()  # positive control: it was there
    a.kill()
    a.teardown()
    a.teardown()  # idempotent
    assert spec.run_id not in labelled_containers(dockerd.host).values()
    assert not (spec.state_dir / "docker" / spec.run_id).exists()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()


def test_teardown_after_failed_prepare(dockerd: Dockerd, tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "egd-no-such-image:1", ["true"])
    a = adapter(dockerd, "docker")
    with pytest.raises(DockerError):
        a.prepare(spec)
    a.teardown()
    assert spec.run_id not in labelled_containers(dockerd.host).values()
    assert not (spec.state_dir / "docker" / spec.run_id).exists()


def test_docker_cli_config_cannot_add_environment(dockerd: Dockerd, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The docker CLI's config.json `proxies` adds HTTP_PROXY/NO_PROXY to every container it creates;
    the adapter talks to the Engine API itself, so a caller's DOCKER_CONFIG (or ~/.docker) cannot put
    a proxy bypass (NO_PROXY=*) or an address into the sandbox's environment."""
    cfg = tmp_path / "egA-cli-config"
    cfg.mkdir()
    (cfg / "config.json").write_text('{"proxies": {"default": {"httpProxy": "http://198.18.0.9:1", '
                                     '"noProxy": "*"}}}')
    # positive control: the CLI with that config does inject them
    env = dict(dockerd.env(), DOCKER_CONFIG=str(cfg))
    ctrl = subprocess.run(["/usr/bin/docker", "run", "--rm", "--network", "none", dockerd.busybox_image(), "env"],
                          capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    assert "NO_PROXY=*" in ctrl and "HTTP_PROXY=http://198.18.0.9:1" in ctrl
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".docker").mkdir()
    (tmp_path / ".docker" / "config.json").write_text((cfg / "config.json").read_text())
    spec = make_spec(tmp_path, dockerd.busybox_image(), ["sh", "-c", "env > /workspace/env"])
    assert run(dockerd, "docker", spec).exit_code() == 0
    inside = (tmp_path / "ws" / "env").read_text()
    assert "PROXY" not in inside.upper() and "198.18.0.9" not in inside, inside
