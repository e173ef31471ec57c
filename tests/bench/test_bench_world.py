"""`make bench`'s namespace world is closed, and the bench runs end to end in it (loadtests/bench*.py).

The world must never put anything in the host's namespace nor route anywhere outside 198.18.0.0/24: the
bench's traffic stays in namespaces it creates. These tests create their own world (prefix egB-) and
check what the host and the namespaces see; the positive controls show the links do carry traffic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
           "--candidates", "direct", "squid", "egressgate", "egressgate-pt", "--bulk-bytes", str(4 << 20),
           "--out-dir", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    cells = {(s["mode"], s["candidate"]): s for s in report["summary"]}
    for mode in ("http", "https"):
        for cand in ("direct", "squid", "egressgate"):
            s = cells[(mode, cand)]
            assert s["rps"] > 0 and s["errors"] == 0, s
    if "egressgate-pt" in report["unavailable"]:
        assert "tls: passthrough" in report["unavailable"]["egressgate-pt"]
    else:
        assert cells[("https", "egressgate-pt")]["errors"] == 0
    assert all(r["ok"] for r in report["bulk"]), report["bulk"]
    assert {r["candidate"] for r in report["bulk"]} >= {"direct", "squid", "egressgate"}
    md = next(tmp_path.glob("bench-*.md")).read_text()
    assert "egressgate / mitmdump" in md and "loadavg" in md
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert report["meta"]["world"].startswith("egB-") and report["meta"]["world"] not in listed
