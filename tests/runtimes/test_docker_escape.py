"""From inside `egressgate sandbox run --runtime docker|gvisor`, hostile code that ignores the proxy
(HTTP_PROXY unset, NO_PROXY=*) tries every other way out. None reaches its canary; each DNS denial is
audited with the sandbox id; the allowed HTTPS call works (explicit proxy and transparently). The probe
and checks are the netns runtime's (tests/runtimes/probe.py), run by the python image's python3; the
positive control (the same attempts from the world's `open` namespace reach the canaries) is
test_netns_escape's, and is repeated here once so this file stands on its own.

One `sandbox run` per runtime runs every probe of this file (tests/runtimes/batch.py: each program framed and
judged on its own output and exit status), in the module fixture `inside`; the world's marks and the canaries'
counts are taken just before it, so "nothing reached" covers every probe of the run.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

import tests.networld as nw
from egressgate.runtimes.docker import labelled_containers
from tests.runtimes.batch import Ran, batch, split
from tests.runtimes.escape_probe import leak_name, network_checks, parse, probe_argv
from tests.runtimes.harness import CALLER_SECRET, DENIED_FILE_NAME, Gateway, sandbox_id
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns
RUNTIMES = ["docker", "gvisor"]


def run_in(gateway: Gateway, dockerd: Dockerd, runtime: str, *command: str, policy: str = "rt-allow",
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    argv = gateway.cmd("sandbox", "run", "--config", str(gateway.config), "--policy", policy,
                       "--runtime", runtime, "--image", dockerd.python_image(), "--", *command)
    env = {**gateway.caller_env(), "DOCKER_HOST": dockerd.host}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)


HTTPS_GET = """
import sys, urllib.request
handlers = [] if sys.argv[1] == "proxy" else [urllib.request.ProxyHandler({})]
opener = urllib.request.build_opener(*handlers)
print(opener.open("https://api.allowed.test/" + sys.argv[2], timeout=15).status)
"""
ADMISSION = [["env"], ["exists", "/var/run/docker.sock"], ["exists", "/run/docker.sock"], ["open", "/etc/shadow", "r"],
             ["uid"], ["open", "/etc/hosts", "a"], ["open", "/etc/resolv.conf", "a"]]


@dataclass
class Inside:
    """One runtime's `sandbox run` of every probe: the run, each program's part, and what was counted before."""

    res: subprocess.CompletedProcess[str]
    ran: dict[str, Ran]
    mark: nw.Mark
    leak: str
    leak_tcp: str
    dot_before: int
    quic_before: int
    # read once both runtimes' runs are over (a later test's positive control from the open namespace, which
    # does reach the canaries, must not count): canary hits, names the world's resolver was asked, the canaries'
    # counts, the paths the allowed upstream served
    canary_hits: list[dict] | None = None
    queried: set[str] | None = None
    dot_after: int = -1
    quic_after: int = -1
    targets: set[str] | None = None


def run_all(gateway: Gateway, dockerd: Dockerd, canaries: dict, host_files: Path, runtime: str) -> Inside:
    """rt-allow allows host_files read-only and denies one file in it (the filesystem probe)."""
    (host_files / "egN-visible.txt").write_text("visible\n")
    (host_files / "egN-visible.txt").chmod(0o644)
    filesystem = [["open", str(host_files / "egN-visible.txt"), "r"], ["open", str(host_files / "egN-new"), "w"],
                  ["open", str(host_files / DENIED_FILE_NAME), "r"], ["chmod", "/workspace/s", 0o4755, True]]
    leak, leak_tcp = leak_name(), leak_name()
    programs = {
        "admission": probe_argv(ADMISSION, hostile=False),  # the env the sandbox was given
        "filesystem": probe_argv(filesystem),
        "network": probe_argv(network_checks(leak, leak_tcp)),
        # a path per runtime and mode: the upstream's log tells which GET arrived
        "https_proxy": ["python3", "-c", HTTPS_GET, "proxy", f"{runtime}-proxy"],
        "https_transparent": ["python3", "-c", HTTPS_GET, "transparent", f"{runtime}-transparent"],
    }
    mark = gateway.world.mark()
    dot_before, quic_before = len(canaries["dot"].hits), len(canaries["quic"].hits)
    res = run_in(gateway, dockerd, runtime, *batch(programs), timeout=600)
    assert res.returncode == 0, res.stderr
    return Inside(res, split(list(programs), res.stdout, res.stderr), mark, leak, leak_tcp, dot_before, quic_before)


@pytest.fixture(scope="module")
def inside(gateway: Gateway, dockerd: Dockerd, canaries: dict, host_files: Path) -> dict[str, Inside]:
    runs = {runtime: run_all(gateway, dockerd, canaries, host_files, runtime) for runtime in RUNTIMES}
    world = gateway.world
    for run in runs.values():
        run.canary_hits = world.canary_hits(run.mark)
        run.queried = {q["qname"] for q in world.dns_queries(run.mark)}
        run.dot_after, run.quic_after = len(canaries["dot"].hits), len(canaries["quic"].hits)
        run.targets = {h.get("target") for h in world.hits(run.mark) if h.get("listener") == "upstream-tls"}
    return runs


def ok_part(inside: Inside, name: str) -> Ran:
    part = inside.ran[name]
    assert part.returncode == 0, (name, part)
    return part


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_admission_checks_inside(gateway: Gateway, dockerd: Dockerd, inside: dict[str, Inside], runtime: str) -> None:
    run = inside[runtime]
    env, sock1, sock2, shadow, ident, hosts, resolv = parse(ok_part(run, "admission").stdout)
    assert "AWS_SECRET_ACCESS_KEY" not in env["env"] and CALLER_SECRET not in json.dumps(env["env"])
    assert "NO_PROXY" not in env["env"] and "no_proxy" not in env["env"]
    assert env["env"]["EGRESSGATE_SANDBOX_ID"] == sandbox_id(run.res.stderr)
    assert "198.18.0.2:1" not in env["env"]["HTTP_PROXY"]  # the caller's proxy setting did not leak in
    assert env["env"]["SSL_CERT_FILE"] == "/etc/egressgate/ca.pem"
    assert not sock1["ok"] and not sock2["ok"]
    assert shadow["ok"] is False and shadow["error"] in ("EACCES", "ENOENT")  # masked, or not in the image
    first, last = gateway.uid_range  # the run's own uid (User uid:gid), never 65534 or root
    assert first <= ident["uid"] <= last and int(ident["caps"], 16) == 0
    assert hosts["error"] in ("EROFS", "EACCES") and resolv["error"] in ("EROFS", "EACCES")
    # the run left nothing: no container (labelled with its run id), no run dir, no run record
    run_id = run.res.stderr.split("(run ", 1)[1].split(",", 1)[0]
    assert run_id not in labelled_containers(dockerd.host).values()
    assert not (gateway.state_dir / "docker" / run_id).exists()
    assert not (gateway.state_dir / "runs" / f"{run_id}.json").exists()


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_filesystem_allow_and_setid(inside: dict[str, Inside], runtime: str) -> None:
    """rt-allow allows host_files read-only and denies one file in it: the container sees the tree at the
    same path, cannot write it, cannot read the denied file (masked on the host's judgement: the image
    has no such path), and cannot set a set-id bit in its workspace (the shared seccomp table)."""
    visible, write, denied, setuid = parse(ok_part(inside[runtime], "filesystem").stdout)
    assert visible == {"ok": True}, visible
    assert write["ok"] is False and write["error"] in ("EROFS", "EACCES"), write
    assert denied == {"ok": False, "error": "EACCES"}, denied
    assert setuid == {"ok": False, "error": "EPERM"}, setuid


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_no_direct_path_reaches_a_canary(gateway: Gateway, inside: dict[str, Inside], runtime: str) -> None:
    run = inside[runtime]
    leak, leak_tcp = run.leak, run.leak_tcp
    out = parse(ok_part(run, "network").stdout)
    sid = sandbox_id(run.res.stderr)
    # from this run's start to the end of both runtimes' runs: no probe of either reached a canary
    assert run.canary_hits == [], run.canary_hits
    assert (run.dot_after, run.quic_after) == (run.dot_before, run.quic_before)
    assert not out[0].get("data", "").count("CANARY") and not out[1].get("data", "").count("CANARY")
    assert not out[2]["ok"], out[2]  # IPv6 literal: no IPv6 in the sandbox
    # answered by OUR resolver: the policy's default `dns.deny_answer: gateway` points the denied name at the
    # gateway (one A record, NOERROR), without asking anyone (the world's resolver never sees it, below)
    assert out[3]["ok"] and (out[3]["rcode"], out[3]["answers"]) == (0, 1), out[3]
    assert out[10]["ok"] and (out[10]["rcode"], out[10]["answers"]) == (0, 1), out[10]
    assert run.queried is not None and leak not in run.queried and leak_tcp not in run.queried
    assert not out[5]["ok"] or out[5]["reply_from"] is None  # QUIC: nothing answers
    assert not out[6]["ok"] and not out[7]["ok"] and not out[8]["ok"], out[6:9]  # ICMP, raw sockets
    assert "CANARY" not in json.dumps(out[9])  # an allowed name pinned to a private IP (edited hosts)
    records = gateway.records(predicate=lambda r: r.get("dns.question.name") == leak_tcp)
    names = {r.get("dns.question.name") for r in records
             if r.get("egressgate.sandbox.id") == sid and r.get("egressgate.decision") == "deny"}
    assert {leak, leak_tcp} <= names
    # the metadata and private-IP connects landed on the transparent listener: denied, audited with the id
    # (the probe reads one segment: the deny head, whose body may come in the next)
    assert all("X-Egressgate-Decision: deny" in o.get("data", "") for o in out[:2]), out[:2]
    records = gateway.records(predicate=lambda r: r.get("egressgate.sandbox.id") == sid
                              and r.get("egressgate.original_dst") == "10.0.0.5:80")
    dsts = {r.get("egressgate.original_dst") for r in records
            if r.get("egressgate.sandbox.id") == sid and r.get("egressgate.decision") == "deny"}
    assert {"169.254.169.254:80", "10.0.0.5:80"} <= dsts, dsts


def test_open_namespace_reaches_the_canaries(gateway: Gateway, canaries: dict) -> None:
    """Positive control for the test above: without the runtime's plumbing the same probe gets out."""
    world = gateway.world
    control_leak = leak_name()
    mark = world.mark()
    ctl = world.exec(world.open, *probe_argv(network_checks(control_leak, leak_name())), timeout=60)
    assert ctl.returncode == 0, ctl.stderr
    hit = {h["listener"] for h in world.canary_hits(mark)}
    assert {"metadata", "private", "metadata-v6", "private-tls"} <= hit, hit
    assert control_leak in {q["qname"] for q in world.dns_queries(mark)}


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("mode", ["proxy", "transparent"])
def test_allowed_https(inside: dict[str, Inside], runtime: str, mode: str) -> None:
    """Positive control: the one way out works, through the explicit proxy and transparently (no proxy:
    the TCP connection to api.allowed.test:443 is sent to the transparent listener)."""
    run = inside[runtime]
    part = ok_part(run, f"https_{mode}")
    assert part.stdout.strip() == "200", (part, run.res.stderr)
    assert run.targets is not None and f"/{runtime}-{mode}" in run.targets, run.targets
