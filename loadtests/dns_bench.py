"""DNS resolver throughput: egressgate (cached allowed answers, denied answers) beside dnsmasq, same run.

Everything is on loopback. Processes:
- a tiny upstream resolver (this file, --role upstream) answering A records for *.example.com and NXDOMAIN
  with an SOA for anything else;
- egressgate's DnsServer (--role egressgate) with MemoryState, the real FileSink audit trail (group commit, hash
  chain, in a temp directory) and a policy allowing bench.example.com; the load comes from 127.0.0.2, which is
  registered as the sandbox;
- dnsmasq (Debian dnsmasq-base) as a forwarding cache in front of the same upstream.
The load generator (this process) keeps N queries in flight on one UDP socket for a fixed duration, counts
answers with the expected rcode, and re-primes the window when answers are lost. Each run measures every target
once, interleaved, so all targets see the same machine conditions; the report gives medians over runs.

Usage: .venv/bin/python loadtests/dns_bench.py [--duration 5] [--runs 5] [--inflight 32] [--json FILE]
       [--reference] [--compare-tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SANDBOX_SOURCE = "127.0.0.2"
ALLOWED = "bench.example.com"
DENIED = "denied.example.org"
NEGATIVE = "nothing.example.org"  # dnsmasq: negative answer from its cache (NXDOMAIN with SOA upstream)
POLICY = """
sandbox: {name: bench}
network:
  dns:
    allow: [bench.example.com]
"""


# --- roles run in child processes ------------------------------------------------------------------------


async def run_upstream() -> None:
    from dnslib import QTYPE, RCODE, RR, DNSRecord

    class Upstream(asyncio.DatagramProtocol):
        def connection_made(self, transport):
            self.transport = transport

        def datagram_received(self, data, addr):
            request = DNSRecord.parse(data)
            name = str(request.q.qname).rstrip(".").lower()
            reply = request.reply()
            if name.endswith(".example.com") and request.q.qtype == QTYPE.A:
                reply.add_answer(*RR.fromZone(f"{name}. 300 A 93.184.216.34"))
            else:
                reply.header.rcode = RCODE.NXDOMAIN
                reply.add_auth(*RR.fromZone("example.org. 300 SOA ns.example.org. h.example.org. 1 2 3 4 300"))
            self.transport.sendto(reply.pack(), addr)

    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(Upstream, local_addr=("127.0.0.1", 0))
    print(transport.get_extra_info("sockname")[1], flush=True)
    await asyncio.Event().wait()


class MemorySink:
    """Reference only (--role egressgate --audit memory): events kept in a bounded in-memory list, nothing
    durable. Used to show how much of the per-query cost is the durable audit trail; never used by tests."""

    def __init__(self) -> None:
        self.events: list = []

    async def write(self, event) -> None:
        self.events.append(event)
        if len(self.events) > 10_000:
            self.events.clear()

    def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        return None


async def run_egressgate(upstream_port: int, audit_dir: str, audit: str) -> None:
    from egressgate.audit.filesink import FileSink
    from egressgate.audit.signer import LocalEd25519Signer
    from egressgate.dns.config import DnsConfig
    from egressgate.dns.server import DnsServer
    from egressgate.policy.loader import parse_policy
    from egressgate.state.base import SandboxRecord, hash_token
    from egressgate.state.memory import MemoryState

    policies = {"bench": parse_policy(POLICY, "<bench>")}
    state = MemoryState()
    await state.admit(SandboxRecord(id="sbx-bench", token_hash=hash_token("t"), policy_name="bench",
                                    admitted_at=time.time(), addresses=(SANDBOX_SOURCE,)))
    if audit == "file":
        sink = await FileSink(Path(audit_dir) / "audit.jsonl", LocalEd25519Signer.generate()).start()
    else:
        sink = MemorySink()
    server = DnsServer(policies.get, state, sink, DnsConfig(upstreams=(("127.0.0.1", upstream_port),)))
    _, port = await server.start("127.0.0.1", 0)
    print(port, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    print(json.dumps(server.metrics.as_dict()), flush=True)
    await server.stop()
    await sink.close()


# --- load generator ----------------------------------------------------------------------------------------


def query_packet(name: str) -> bytes:
    labels = b"".join(bytes((len(p),)) + p for p in name.encode().split(b".")) + b"\x00"
    return struct.pack("!HHHHHH", 0, 0x0100, 1, 0, 0, 0) + labels + struct.pack("!HH", 1, 1)


def load(port: int, name: str, expect_rcode: int, duration: float, inflight: int) -> dict[str, float]:
    """Keep `inflight` queries outstanding for `duration` seconds; answers/s with the expected rcode."""
    template = bytearray(query_packet(name))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((SANDBOX_SOURCE, 0))
    sock.connect(("127.0.0.1", port))
    sock.settimeout(0.25)
    seq = ok = wrong = lost = 0

    def send() -> None:
        nonlocal seq
        seq = (seq + 1) & 0xFFFF
        struct.pack_into("!H", template, 0, seq)
        sock.send(template)

    for _ in range(inflight):
        send()
    outstanding = inflight
    start = time.perf_counter()
    deadline = start + duration
    while True:
        try:
            data = sock.recv(4096)
        except TimeoutError:
            lost += outstanding
            outstanding = 0
            if time.perf_counter() >= deadline:
                break
            for _ in range(inflight):
                send()
            outstanding = inflight
            continue
        outstanding -= 1
        if len(data) >= 4 and data[3] & 0xF == expect_rcode:
            ok += 1
        else:
            wrong += 1
        if time.perf_counter() < deadline:
            send()
            outstanding += 1
        elif outstanding == 0:
            break
    elapsed = time.perf_counter() - start
    sock.close()
    return {"qps": ok / elapsed, "ok": ok, "wrong": wrong, "lost": lost, "seconds": elapsed}


# --- orchestration ---------------------------------------------------------------------------------------


def spawn_role(*args: str, tree: str | None = None) -> tuple[subprocess.Popen, int]:
    """Start a role of this script; with `tree`, the copy of this script and egressgate in that source tree."""
    script, env = __file__, None
    if tree is not None:
        script = os.path.join(tree, "loadtests", "dns_bench.py")
        env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError(f"{args[1]} did not start")
    return proc, int(line)


def free_udp_tcp_port() -> int:
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind(("127.0.0.1", 0))
            port = u.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                try:
                    t.bind(("127.0.0.1", port))
                except OSError:
                    continue
        return port
    raise RuntimeError("no free port")


def dnsmasq_command(port: int, upstream_port: int, pid_file: str) -> list[str]:
    return ["dnsmasq", "--no-daemon", f"--port={port}", "--listen-address=127.0.0.1", "--bind-interfaces",
            "--no-resolv", "--no-hosts", "--conf-file=/dev/null", f"--pid-file={pid_file}",
            f"--server=127.0.0.1#{upstream_port}", "--cache-size=1000", "--log-facility=/dev/null"]


def wait_answering(port: int, name: str, expect: int) -> None:
    for _ in range(50):
        if load(port, name, expect, 0.05, 1)["ok"]:
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing answers {name} on port {port}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["bench", "upstream", "egressgate"], default="bench")
    parser.add_argument("--upstream-port", type=int)
    parser.add_argument("--audit-dir")
    parser.add_argument("--audit", choices=["file", "memory"], default="file")
    parser.add_argument("--reference", action="store_true",
                        help="also measure egressgate with audit events kept in memory (not durable)")
    parser.add_argument("--compare-tree", metavar="DIR",
                        help="also measure egressgate from another source tree (before/after in one run), e.g. "
                             "`git archive <commit> egressgate loadtests | tar -x -C DIR`")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--inflight", type=int, default=32)
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args()
    if args.role == "upstream":
        asyncio.run(run_upstream())
        return 0
    if args.role == "egressgate":
        asyncio.run(run_egressgate(args.upstream_port, args.audit_dir, args.audit))
        return 0
    if shutil.which("dnsmasq") is None:
        print("dnsmasq not installed (Debian: dnsmasq-base)", file=sys.stderr)
        return 2

    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="dns-bench-")
    try:
        upstream, upstream_port = spawn_role("--role", "upstream")
        procs.append(upstream)
        gate, gate_port = spawn_role("--role", "egressgate", "--upstream-port", str(upstream_port),
                                     "--audit-dir", tmp)
        procs.append(gate)
        if args.reference:
            ref, ref_port = spawn_role("--role", "egressgate", "--upstream-port", str(upstream_port),
                                       "--audit-dir", tmp, "--audit", "memory")
            procs.append(ref)
        if args.compare_tree:
            old, old_port = spawn_role("--role", "egressgate", "--upstream-port", str(upstream_port),
                                       "--audit-dir", tempfile.mkdtemp(dir=tmp), tree=args.compare_tree)
            procs.append(old)
        mport = free_udp_tcp_port()
        cmd = dnsmasq_command(mport, upstream_port, os.path.join(tmp, "dnsmasq.pid"))
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_answering(gate_port, ALLOWED, 0)
        wait_answering(mport, ALLOWED, 0)
        wait_answering(mport, NEGATIVE, 3)
        targets = {
            "egressgate cached allowed": (gate_port, ALLOWED, 0),
            "egressgate denied": (gate_port, DENIED, 3),
            "dnsmasq cached": (mport, ALLOWED, 0),
            "dnsmasq cached NXDOMAIN": (mport, NEGATIVE, 3),
        }
        if args.reference:
            wait_answering(ref_port, ALLOWED, 0)
            targets["reference: cached, audit in memory"] = (ref_port, ALLOWED, 0)
            targets["reference: denied, audit in memory"] = (ref_port, DENIED, 3)
        if args.compare_tree:
            wait_answering(old_port, ALLOWED, 0)
            targets["compare tree: cached allowed"] = (old_port, ALLOWED, 0)
            targets["compare tree: denied"] = (old_port, DENIED, 3)
        results: dict[str, list[dict[str, float]]] = {k: [] for k in targets}
        for run in range(args.runs):
            for label, (port, name, rc) in targets.items():
                res = load(port, name, rc, args.duration, args.inflight)
                results[label].append(res)
                print(f"run {run + 1} {label:36s} {res['qps']:9.0f} qps  wrong={res['wrong']} lost={res['lost']}",
                      flush=True)
        medians = {k: statistics.median(r["qps"] for r in v) for k, v in results.items()}
        gate.send_signal(signal.SIGTERM)
        metrics_line = gate.stdout.readline() if gate.stdout else ""
        print("\nmedian qps over", args.runs, "runs of", args.duration, "s, inflight", args.inflight)
        for label, qps in medians.items():
            print(f"  {label:36s} {qps:9.0f}")
        ratio = medians["egressgate denied"] / medians["dnsmasq cached"]
        cached_ratio = medians["egressgate cached allowed"] / medians["dnsmasq cached"]
        print(f"  {'denied / dnsmasq cached':36s} {ratio:9.2f}x  (goal >= 0.5x)")
        print(f"  {'cached allowed / dnsmasq cached':36s} {cached_ratio:9.2f}x")
        if args.compare_tree:
            for label in ("compare tree: denied", "compare tree: cached allowed"):
                print(f"  {label + ' / dnsmasq cached':36s} {medians[label] / medians['dnsmasq cached']:9.2f}x")
        print("  dnsmasq command:", " ".join(cmd))
        if metrics_line.strip():
            metrics = json.loads(metrics_line)
            print("  egressgate upstream queries during the run:", metrics["upstream_queries"],
                  " audit failures:", metrics["audit_failures"])
        if args.json:
            Path(args.json).write_text(json.dumps({"medians": medians, "runs": results, "args": vars(args)},
                                                  indent=2))
        return 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
