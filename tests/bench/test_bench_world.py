"""`make bench`'s namespace world is closed, and the bench runs end to end in it (loadtests/bench*.py).

The world must never put anything in the host's namespace nor route anywhere outside 198.18.0.0/24: the
bench's traffic stays in namespaces it creates. These tests create their own world (prefix egB-) and
check what the host and the namespaces see; the positive controls show the links do carry traffic.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from loadtests import procs
from loadtests.bench_world import ADDR, UPSTREAM_NAME, World

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]

SERVE = ("import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 8000)); s.listen(); print('up', flush=True);"
         " c, a = s.accept(); c.sendall(a[0].encode()); c.close()")
DIAL = ("import socket,sys\ntry:\n c=socket.create_connection((sys.argv[1], 8000), 2); print(c.recv(64).decode())\n"
        "except OSError as e: print('errno', e.errno)")


def host_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


@pytest.fixture
def world():
    w = World.create()
    yield w
    w.destroy()


def test_world_adds_nothing_to_the_host_and_has_no_way_out(world: World) -> None:
    before = host_links()
    # the world exists already; a second one shows creation itself adds no host link
    other = World.create()
    try:
        assert host_links() == before
    finally:
        other.destroy()
    for role in ADDR:
        routes = subprocess.run(["ip", "-n", world.ns(role), "route"], capture_output=True, text=True,
                                check=True).stdout
        assert "default" not in routes and routes.strip().startswith("198.18.0.0/24"), routes
    # an address of the benchmarking range off our /24: no route, so no packet leaves the client namespace
    off = subprocess.run([*world.exec_prefix("cli"), sys.executable, "-c", DIAL, "198.19.255.1"],
                         capture_output=True, text=True, timeout=30)
    assert off.stdout.strip() == "errno 101", off  # ENETUNREACH
    # readiness probes run inside the world (procs.wait_port with a prefix), never from this process's host
    # namespace, which has no route there: nothing listens on the gateway's port 8000, and the probe says so
    with pytest.raises(RuntimeError, match=r"nothing listening on 198\.18\.0\.2:8000"):
        procs.wait_port(8000, 1.0, host=ADDR["gw"], prefix=world.exec_prefix("cli"))


def test_client_reaches_the_upstream_namespace_and_the_gateway_resolves_its_name(world: World) -> None:
    server = subprocess.Popen([*world.exec_prefix("up"), sys.executable, "-c", SERVE, ADDR["up"]],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        dial = subprocess.run([*world.exec_prefix("cli"), sys.executable, "-c", DIAL, ADDR["up"]],
                              capture_output=True, text=True, timeout=30)
        assert dial.stdout.strip() == ADDR["cli"]  # the upstream saw the client's own address: a real link
    finally:
        server.kill()
        server.wait()
    names = subprocess.run([*world.exec_prefix("gw"), "getent", "hosts", UPSTREAM_NAME], capture_output=True,
                           text=True, check=True).stdout.split()
    assert names[0] == ADDR["up"]


def test_destroy_removes_namespaces_processes_and_hosts_file() -> None:
    w = World.create()
    sleeper = subprocess.Popen([*w.exec_prefix("gw"), "sleep", "300"])
    w.destroy()
    assert sleeper.wait(10) == -9
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert w.tag not in listed
    assert not (Path("/etc/netns") / w.ns("gw")).exists()


@pytest.mark.timeout(240)
def test_bench_runs_end_to_end_and_writes_its_report(tmp_path: Path) -> None:
    """A short real run: every cell has throughput and no error, the egressgate cells went through its
    pipeline (the client trusted only its CA), and the passthrough cell is measured or said unavailable."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("EGB_BENCH_WORLD", None)
    cmd = [sys.executable, "-m", "loadtests.bench", "--seconds", "0.5", "--repeats", "1", "--concurrency", "1",
           "--candidates", "direct", "squid", "squid-bump", "egressgate", "egressgate-pt",
           "--bulk-bytes", str(4 << 20),
           "--out-dir", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    cells = {(s["mode"], s["candidate"]): s for s in report["summary"]}
    for mode in ("http", "https"):
        for cand in ("direct", "squid", "egressgate"):
            s = cells[(mode, cand)]
            assert s["rps"] > 0 and s["errors"] == 0, s
    # Squid's ssl-bump MITM (squid-openssl, which scripts/install-test-deps.sh installs): measured, through
    # its own CA only (the client trusts nothing else on that cell), and set against egressgate's MITM
    assert "squid-bump" not in report["unavailable"], report["unavailable"]
    bump = cells[("https", "squid-bump")]
    assert bump["rps"] > 0 and bump["errors"] == 0, bump
    assert ("http", "squid-bump") not in cells  # plain HTTP through it would be the forward proxy again
    if "egressgate-pt" in report["unavailable"]:
        assert "tls: passthrough" in report["unavailable"]["egressgate-pt"]
    else:
        assert cells[("https", "egressgate-pt")]["errors"] == 0
    assert all(r["ok"] for r in report["bulk"]), report["bulk"]
    assert {r["candidate"] for r in report["bulk"]} >= {"direct", "squid", "egressgate"}
    md = next(tmp_path.glob("bench-*.md")).read_text()
    assert "egressgate / mitmdump" in md and "loadavg" in md
    ratio = next(x for x in md.splitlines() if x.startswith("| https | 1 | -"))  # no mitmdump in this run
    assert ratio.split("|")[-4].strip().endswith("x"), ratio  # egressgate MITM / squid ssl-bump rps
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert report["meta"]["world"].startswith("egB-") and report["meta"]["world"] not in listed


ONE_GET = """\
import asyncio, json, sys
from loadtests.loadgen import Target, connect, read_response

async def get(t):
    try:
        reader, writer = await connect(t)
        writer.write(t.request_bytes())
        status, n = await read_response(reader)
        writer.close()
        return "ok" if (status, n) == (200, 64) else f"status {status}, {n} bytes"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

out = {}
for name, host, port, proxy_port, ca, strict in json.loads(sys.argv[1]):
    t = Target(scheme="https", host=host, port=port, dial=(sys.argv[2], proxy_port), via_proxy=True, ca_file=ca,
               path="/bytes/64", expect_body=64, x509_strict=strict)
    out[name] = asyncio.run(get(t))
print(json.dumps(out))
"""


def test_squid_bump_intercepts_with_its_own_ca_and_verifies_the_upstream() -> None:
    """The ssl-bump candidate is a MITM, not a tunnel: a client that trusts only Squid's bump CA gets the
    upstream's body, one that trusts only the upstream's CA fails its handshake; plain Squid's CONNECT
    tunnel is the positive control the other way round. And the bump verifies the upstream: a bump Squid
    given another CA for its upstreams refuses this one (positive control: the first bump Squid)."""
    from loadtests import bench_procs

    # as in loadtests/bench.py: work dirs in /tmp, so Squid (it runs as `proxy`) can reach its private dirs
    # next to them (pytest's tmp_path lives under a 0700 directory)
    work, other = (Path(tempfile.mkdtemp(prefix="egB-bumptest-")) for _ in range(2))
    w = World.create()
    started = []
    try:
        certs = bench_procs.make_certs(work)
        started.append(up := bench_procs.start_upstream(w, certs, work))
        started.append(tunnel := bench_procs.start_squid(w, work))
        started.append(bump := bench_procs.start_squid_bump(w, work, certs.ca_pem))
        other_ca = bench_procs.make_certs(other).ca_pem
        started.append(wrong := bench_procs.start_squid_bump(w, other, other_ca, port=3130, name="squid-bump2"))
        port = up.info["https_port"]
        cases = [("bump_trusting_bump_ca", bump, bump.info["ca"]),
                 ("bump_trusting_upstream_ca", bump, str(certs.ca_pem)),
                 ("tunnel_trusting_upstream_ca", tunnel, str(certs.ca_pem)),
                 ("tunnel_trusting_bump_ca", tunnel, bump.info["ca"]),
                 ("bump_not_trusting_the_upstream", wrong, wrong.info["ca"])]
        arg = [(name, UPSTREAM_NAME, port, p.info["port"], ca, p is tunnel) for name, p, ca in cases]
        run = subprocess.run([*w.exec_prefix("cli"), sys.executable, "-c", ONE_GET, json.dumps(arg), ADDR["gw"]],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                             timeout=90)
        assert run.returncode == 0, run.stderr[-2000:]
        out = json.loads(run.stdout)
        assert out["bump_trusting_bump_ca"] == "ok", out
        assert "CERTIFICATE_VERIFY_FAILED" in out["bump_trusting_upstream_ca"], out
        assert out["tunnel_trusting_upstream_ca"] == "ok", out
        assert "CERTIFICATE_VERIFY_FAILED" in out["tunnel_trusting_bump_ca"], out
        assert out["bump_not_trusting_the_upstream"].startswith("status 503"), out  # ERR_SECURE_CONNECT_FAIL
    finally:
        for p in reversed(started):
            p.stop()
        w.destroy()
        for d in (work, other):
            shutil.rmtree(d, ignore_errors=True)
