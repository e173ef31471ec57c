"""runtimes/dockerapi.py against the real test dockerd: every call the docker adapter makes, the
multiplexed log stream split back into stdout and stderr, the wait deadline, and each failure as a
DockerError naming the call and the daemon's own message (never a traceback, never a silent success).
Each check has its control through the docker CLI (the daemon really did what the API said)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from egressgate.runtimes.dockerapi import DockerAPI, DockerError, NotFound, host_config_limits, socket_path
from egressgate.runtimes.limits import docker_flags
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns


def _config(image: str, cmd: list[str], **host: object) -> dict:
    return {"Image": image, "Cmd": cmd, "Labels": {"egressgate.run": "egA-test"},
            "HostConfig": {"NetworkMode": "none", **host}}


def _name() -> str:
    return f"egA-api-{os.urandom(3).hex()}"


def test_refuses_anything_but_a_unix_socket() -> None:
    for host in ("tcp://127.0.0.1:2375", "ssh://root@host", "fd://", "unix://relative/docker.sock", "/var/run/x"):
        with pytest.raises(DockerError, match="unix socket only"):
            socket_path(host)
    assert socket_path("unix:///run/docker.sock") == "/run/docker.sock"  # positive control


def test_unreachable_daemon_is_a_clear_error(tmp_path: Path) -> None:
    api = DockerAPI(f"unix://{tmp_path}/egA-none.sock")
    with pytest.raises(DockerError, match=r"docker API ping: cannot reach the daemon at unix://.*egA-none\.sock"):
        api.inspect("x")


def test_not_a_docker_daemon(tmp_path: Path) -> None:
    """Something else listening on the socket (here: an HTTP server without Docker's API-Version header)
    is refused at negotiation."""
    path = tmp_path / "egA-fake.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def answer() -> None:
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nOK")
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        with pytest.raises(DockerError, match="did not answer as a Docker daemon"):
            DockerAPI(f"unix://{path}").inspect("x")
    finally:
        t.join(5)
        srv.close()


def test_lifecycle_logs_and_labels(dockerd: Dockerd) -> None:
    api, name = DockerAPI(dockerd.host), _name()
    script = "echo out1; echo err1 >&2; echo out2; printf 'no newline' >&2; exit 3"
    try:
        cid = api.create(name, _config(dockerd.busybox_image(), ["sh", "-c", script], CapDrop=["ALL"],
                                       ReadonlyRootfs=True, Env=None))
        assert len(cid) == 64
        # the daemon stored what we asked for (control through the CLI, not through our client)
        cli = dockerd.docker("inspect", "--format", "{{.HostConfig.NetworkMode}} {{.HostConfig.CapDrop}} "
                             "{{.HostConfig.ReadonlyRootfs}}", name).stdout.split()
        assert cli == ["none", "[ALL]", "true"]
        assert api.containers("egressgate.run")[0]["Labels"]["egressgate.run"] == "egA-test"
        assert api.inspect(name)["State"]["Running"] is False
        api.start(name)
        assert api.wait(name, 30.0) == 3
        frames = list(api.logs(name, follow=False, timeout=10.0))
        out = b"".join(d for s, d in frames if s == 1)
        err = b"".join(d for s, d in frames if s == 2)
        assert out == b"out1\nout2\n" and err == b"err1\nno newline"
        assert dockerd.docker("logs", name).stdout == "out1\nout2\n"  # control: the CLI sees the same stdout
    finally:
        removed = api.remove(name)
    assert removed
    assert api.remove(name) is False  # gone: not an error, but reported
    assert name not in dockerd.docker("ps", "-a", "--format", "{{.Names}}").stdout.split()


def test_log_stream_follows_until_the_end(dockerd: Dockerd) -> None:
    api, name = DockerAPI(dockerd.host), _name()
    big = 70000  # larger than one frame/chunk: the frame reader must reassemble
    try:
        api.create(name, _config(dockerd.busybox_image(), ["sh", "-c", f"sleep 0.3; head -c {big} /dev/zero; "
                                                           "echo; echo tail >&2"]))
        api.start(name)
        _close, frames = api.log_stream(name)
        got: list[tuple[int, bytes]] = []
        t = threading.Thread(target=lambda: got.extend(frames), daemon=True)
        t.start()
        assert api.wait(name, 30.0) == 0
        t.join(10)
        assert not t.is_alive()
        assert sum(len(d) for s, d in got if s == 1) == big + 1
        assert b"".join(d for s, d in got if s == 2) == b"tail\n"
    finally:
        api.remove(name)


def test_log_stream_close_unblocks_the_reader(dockerd: Dockerd) -> None:
    api, name = DockerAPI(dockerd.host), _name()
    try:
        api.create(name, _config(dockerd.busybox_image(), ["sleep", "60"]))
        api.start(name)
        close, frames = api.log_stream(name)
        t = threading.Thread(target=lambda: list(frames), daemon=True)
        t.start()
        t.join(0.5)
        assert t.is_alive()  # control: following a running container blocks
        close()
        t.join(5)
        assert not t.is_alive()
    finally:
        api.remove(name)


def test_wait_deadline_then_kill(dockerd: Dockerd) -> None:
    api, name = DockerAPI(dockerd.host), _name()
    try:
        api.create(name, _config(dockerd.busybox_image(), ["sleep", "60"]))
        api.start(name)
        begin = time.monotonic()
        with pytest.raises(TimeoutError):
            api.wait(name, 0.5)
        assert time.monotonic() - begin < 5
        assert api.inspect(name)["State"]["Running"] is True
        api.kill(name)
        assert api.wait(name, 30.0) == 137
        api.kill(name)  # not running any more: no error
    finally:
        api.remove(name)


def test_daemon_errors_name_the_call_and_the_reason(dockerd: Dockerd, tmp_path: Path) -> None:
    api = DockerAPI(dockerd.host)
    with pytest.raises(NotFound, match=r"docker API inspect egA-nope failed \(HTTP 404\): No such container"):
        api.inspect("egA-nope")
    with pytest.raises(NotFound, match=r"docker API create .* \(HTTP 404\): No such image: ega-no-such-image"):
        api.create(_name(), _config("ega-no-such-image:1", ["true"]))
    name = _name()
    missing = {"Type": "bind", "Source": str(tmp_path / "missing"), "Target": "/x", "ReadOnly": True}
    with pytest.raises(DockerError, match=r"docker API create .* \(HTTP 400\): .*bind source path does not exist"):
        api.create(name, _config(dockerd.busybox_image(), ["true"], Mounts=[missing]))
    assert name not in dockerd.docker("ps", "-a", "--format", "{{.Names}}").stdout.split()


def test_limit_flags_become_host_config(dockerd: Dockerd) -> None:
    """limits.docker_flags → HostConfig, checked by what the daemon stored (the same values `docker run`
    with those flags stores: the control)."""
    flags = docker_flags({"memory_mb": 64, "pids_max": 32, "cpu_millis": 250})
    hc = host_config_limits([*flags, "--ulimit", "nproc=16:16"])
    assert hc == {"Memory": 64 << 20, "MemorySwap": 64 << 20, "PidsLimit": 32, "NanoCpus": 250_000_000,
                  "Ulimits": [{"Name": "nproc", "Soft": 16, "Hard": 16}]}
    assert host_config_limits(docker_flags({"cpu_millis": 5})) == {"CpuPeriod": 1_000_000, "CpuQuota": 5000}
    with pytest.raises(DockerError, match="not supported"):
        host_config_limits(["--privileged", "true"])  # never silently dropped
    api, ours, theirs = DockerAPI(dockerd.host), _name(), _name()
    fmt = "{{.HostConfig.Memory}} {{.HostConfig.MemorySwap}} {{.HostConfig.PidsLimit}} {{.HostConfig.NanoCpus}}"
    try:
        api.create(ours, _config(dockerd.busybox_image(), ["true"], **hc))
        dockerd.docker("create", "--network", "none", "--name", theirs, *flags, dockerd.busybox_image(), "true")
        assert dockerd.docker("inspect", "--format", fmt, ours).stdout == \
            dockerd.docker("inspect", "--format", fmt, theirs).stdout
    finally:
        api.remove(ours)
        api.remove(theirs)


def test_a_daemon_that_stops_answering_is_a_named_error(tmp_path: Path) -> None:
    """A daemon that answers the ping and then hangs: the call ends at its timeout with a DockerError
    naming it (exit 120 in `sandbox run`), not a bare TimeoutError; wait's deadline stays a TimeoutError
    (the adapter turns it into the wall-time kill)."""
    path = tmp_path / "egA-hang.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            if b"/_ping" in conn.recv(4096):
                conn.sendall(b"HTTP/1.1 200 OK\r\nApi-Version: 1.41\r\nContent-Length: 2\r\n\r\nOK")
                conn.close()
            else:
                held.append(conn)  # never answered

    threading.Thread(target=serve, daemon=True).start()
    api = DockerAPI(f"unix://{path}")
    try:
        begin = time.monotonic()
        with pytest.raises(DockerError, match=r"docker API inspect egA-x: no answer from unix://.* within 0.3 s"):
            api.call("GET", "/containers/egA-x/json", "inspect egA-x", timeout=0.3)
        with pytest.raises(TimeoutError):
            api.wait("egA-x", 0.3)
        assert time.monotonic() - begin < 5
    finally:
        srv.close()
        for conn in held:
            conn.close()
