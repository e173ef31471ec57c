"""From inside `egressgate sandbox run --runtime netns`, hostile code that ignores the proxy (HTTP_PROXY
unset, NO_PROXY=*) tries every other way out. None reaches its canary; the same attempts from the world's
`open` namespace (same position off gw, no egressgate rules) DO reach them: the positive control that a
direct route exists and only the runtime's plumbing stands in the way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runtimes.escape_probe import PROBE, PY, leak_name, network_checks, parse, probe_argv
from tests.runtimes.harness import CALLER_SECRET, DENIED_FILE_NAME, Gateway, base_dir, remove, sandbox_id

pytestmark = pytest.mark.netns



def test_admission_checks_inside(gateway: Gateway, host_files: Path) -> None:
    """The seed's admission checks: no docker.sock, no caller secret, /etc/shadow and a denied host file
    unreadable, no capabilities, /etc/hosts and /etc/resolv.conf not editable."""
    denied = str(host_files / DENIED_FILE_NAME)
    checks = [["env"], ["exists", "/var/run/docker.sock"], ["exists", "/run/docker.sock"],
              ["open", "/etc/shadow", "r"], ["open", denied, "r"], ["uid"],
              ["open", "/etc/hosts", "a"], ["open", "/etc/resolv.conf", "a"],
              ["open", "/usr/egN-written", "w"], ["open", "/tmp/egN-written", "w"],
              ["open", "/workspace/egN-written", "w"], ["exists", "/run/netns"]]
    res = gateway.run(*probe_argv(checks, hostile=False), policy="rt-allow")
    assert res.returncode == 0, res.stderr
    env, sock1, sock2, shadow, masked, ident, hosts, resolv, usr, tmp, ws, netns = parse(res.stdout)
    assert "AWS_SECRET_ACCESS_KEY" not in env["env"] and CALLER_SECRET not in json.dumps(env["env"])
    assert "NO_PROXY" not in env["env"] and "no_proxy" not in env["env"]
    assert env["env"]["EGRESSGATE_SANDBOX_ID"] == sandbox_id(res.stderr)
    assert "198.18.0.2:1" not in env["env"]["HTTP_PROXY"]  # the caller's proxy setting did not leak in
    assert env["env"]["SSL_CERT_FILE"] == "/etc/egressgate/ca.pem"
    assert not sock1["ok"] and not sock2["ok"]
    assert shadow == {"ok": False, "error": "ENOENT"}  # /etc is built from an allowlist (sandbox_fs.py)
    assert masked == {"ok": False, "error": "EACCES"}  # denied inside an allowed tree: masked
    assert ident["uid"] == 65534 and int(ident["caps"], 16) == 0
    assert hosts["error"] in ("EROFS", "EACCES") and resolv["error"] in ("EROFS", "EACCES")
    assert usr == {"ok": False, "error": "EROFS"}  # root_fs: read_only
    assert tmp == {"ok": True} and ws == {"ok": True}  # tmpfs /tmp and the workspace are writable
    assert netns == {"ok": False}  # the host's /run (netns mounts, run records) is not visible
    # positive control for the mask: the same file IS readable under a policy that does not deny it
    control = gateway.run(*probe_argv([["open", denied, "r"]]), policy="rt-nomask")
    assert parse(control.stdout) == [{"ok": True}], control.stderr


def test_no_direct_path_reaches_a_canary(gateway: Gateway, canaries: dict) -> None:
    world = gateway.world
    leak, leak_tcp = leak_name(), leak_name()
    mark = world.mark()
    res = gateway.run(*probe_argv(network_checks(leak, leak_tcp)), policy="rt-allow")
    assert res.returncode == 0, res.stderr
    out = parse(res.stdout)
    sid = sandbox_id(res.stderr)
    assert world.canary_hits(mark) == [], world.canary_hits(mark)
    assert canaries["dot"].hits == [] and canaries["quic"].hits == []
    assert not out[2]["ok"] and out[2]["error"] in ("ENETUNREACH", "EADDRNOTAVAIL", "EAFNOSUPPORT")
    # the "public" resolver's answer came from OUR resolver (it refuses the name); the world's never saw it
    # answered by OUR resolver: the policy's default `dns.deny_answer: gateway` points the denied name at the
    # gateway (one A record, NOERROR), without asking anyone (the world's resolver never sees it, below)
    assert out[3]["ok"] and (out[3]["rcode"], out[3]["answers"]) == (0, 1), out[3]
    assert out[10]["ok"] and (out[10]["rcode"], out[10]["answers"]) == (0, 1), out[10]
    queried = {q["qname"] for q in world.dns_queries(mark)}
    assert leak not in queried and leak_tcp not in queried
    assert not out[5]["ok"] or out[5]["reply_from"] is None  # QUIC: nothing answers, nothing arrived
    assert not out[6]["ok"] and not out[7]["ok"] and not out[8]["ok"]  # ICMP and raw sockets refused
    assert out[7]["error"] == "EPERM" and out[8]["error"] == "EPERM"
    # each denial is audited with the sandbox id (identity = the sandbox's registered source address):
    # DNS by the resolver, TCP by the transparent listener, dropped packets in the revocation's counters
    records = gateway.records(predicate=lambda r: r.get("egressgate.operation") == "revocation"
                              and r.get("egressgate.sandbox.id") == sid)
    mine = [r for r in records if r.get("egressgate.sandbox.id") == sid]
    names = {r.get("dns.question.name") for r in mine if r.get("egressgate.decision") == "deny"}
    assert {leak, leak_tcp} <= names
    transparent = {r.get("server.address"): r for r in mine if r.get("egressgate.mode") == "transparent"}
    for target in ("169.254.169.254", "10.0.0.5", "dns.public.test"):
        assert transparent[target]["egressgate.decision"] == "deny", transparent.get(target)
    (revocation,) = [r for r in mine if r.get("egressgate.operation") == "revocation"]
    assert int(revocation["egressgate.run.dropped.udp"]) >= 1  # the QUIC datagram

    # positive control: the same attempts from `open` (no egressgate rules) reach every canary
    control_leak = leak_name()
    mark = world.mark()
    ctl = world.exec(world.open, *probe_argv(network_checks(control_leak, leak_name())), timeout=60)
    assert ctl.returncode == 0, ctl.stderr
    hit = {h["listener"] for h in world.canary_hits(mark)}
    assert {"metadata", "private", "metadata-v6", "private-tls"} <= hit, hit
    assert ctl_out_ok(ctl.stdout)
    assert control_leak in {q["qname"] for q in world.dns_queries(mark)}
    assert canaries["dot"].hits and canaries["quic"].hits


def ctl_out_ok(stdout: str) -> bool:
    """From `open`, the direct attempts connect (metadata, private IP, IPv6, the world's resolver; the
    853 and QUIC canaries record their hits themselves)."""
    out = parse(stdout)
    return all(out[i]["ok"] for i in (0, 1, 2, 3))


def test_allowed_https_transparently(gateway: Gateway) -> None:
    """Positive control: with no proxy configured at all, an allowed HTTPS GET works through the
    transparent listener (TLS intercepted with the sandbox CA), and is audited as transparent."""
    world = gateway.world
    mark = world.mark()
    res = gateway.run("env", "-u", "HTTP_PROXY", "-u", "HTTPS_PROXY", "-u", "http_proxy", "-u", "https_proxy",
                      "NO_PROXY=*", "curl", "-sS", "--noproxy", "*", "--max-time", "10", "-o", "/dev/null",
                      "-w", "%{http_code}", "https://api.allowed.test/", policy="rt-allow")
    assert res.returncode == 0 and res.stdout == "200", res.stdout + res.stderr
    assert "upstream-tls" in {h.get("listener") for h in world.hits(mark)}
    sid = sandbox_id(res.stderr)
    records = gateway.records(predicate=lambda r: r.get("egressgate.sandbox.id") == sid
                              and r.get("egressgate.mode") == "transparent")
    assert any(r.get("egressgate.decision") == "allow" and r.get("server.address") == "api.allowed.test"
               for r in records if r.get("egressgate.sandbox.id") == sid)


def test_allowed_https_via_explicit_proxy(gateway: Gateway) -> None:
    """Positive control: the one way out works (curl uses the proxy and CA that admission handed out)."""
    world = gateway.world
    mark = world.mark()
    res = gateway.run("curl", "-sS", "--max-time", "10", "https://api.allowed.test/", policy="rt-allow")
    assert res.returncode == 0, res.stderr
    assert "upstream-tls" in {h.get("listener") for h in world.hits(mark)}


def test_no_host_unix_socket_is_a_way_out(gateway: Gateway) -> None:
    """The host root is visible read-only, and a read-only mount does not stop connect(2): a host Unix
    socket that uid 65534 may open (0666, traversable directories) would be a way out that no nftables
    rule sees. The workload may not create AF_UNIX sockets (runtimes/seccomp.py); socketpair still works.
    Positive control: a uid-65534 process on the host connects to the same socket."""
    import socket
    import subprocess
    import threading

    sock_dir = base_dir("/var/tmp")  # not an allowed path: the sandbox does not even see it
    path = sock_dir / "egV-host.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    path.chmod(0o666)
    server.listen(4)
    server.settimeout(0.5)
    got: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                got.append(conn.recv(100))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        res = gateway.run(*probe_argv([["unix", str(path)], ["pair"]]), policy="rt-allow")
        assert res.returncode == 0, res.stderr
        refused, paired = parse(res.stdout)
        assert refused == {"ok": False, "error": "EACCES"}, refused
        assert paired == {"ok": True}
        assert got == []
        # positive control: the socket is reachable by the sandbox's uid outside the sandbox
        ctl = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", PY, "-c",
                              PROBE, json.dumps([["unix", str(path)]])], capture_output=True, text=True,
                             timeout=30, check=False)
        assert parse(ctl.stdout) == [{"ok": True}], ctl.stderr
        for _ in range(50):
            if got:
                break
            stop.wait(0.1)
        assert got == [b"egV leak\n"]
    finally:
        stop.set()
        thread.join(2)
        server.close()
        remove(sock_dir)
