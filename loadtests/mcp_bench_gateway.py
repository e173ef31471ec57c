"""`python -m loadtests.mcp_bench gateway`: the MCP decision overhead through the real gateway (see
loadtests/mcp_bench.py for what is measured and why). Loopback only: the gateway, the upstream and the
client all listen on / dial 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from loadtests import procs
from loadtests.loadgen import Target, connect
from tests.support.loopback import serve_json

ARGUMENTS = {"limit": 10, "status": "open", "query": "printer on fire", "path": "/workspace/reports/q3.csv"}
RESULT = {"content": [{"type": "text", "text": "3 tickets"}], "isError": False}


def policy(name: str, port: int, with_mcp: bool) -> dict:
    url = f"https://{procs.UPSTREAM_NAME}:{port}/mcp"
    out: dict = {
        "sandbox": {"name": name, "resources": {"outbound_bytes_max": 1 << 50}},
        "network": {"allow_private": ["127.0.0.0/8"], "https": {"allow": [
            {"id": "mcp-route", "host": procs.UPSTREAM_NAME, "ports": [port], "methods": ["GET", "POST"],
             "paths": ["/mcp"]}]}},
    }
    if with_mcp:
        out["mcp"] = {"servers": [{"name": "bench", "url": url, "tools": {"allow": [{
            "name": "search_tickets",
            "arguments": {"limit": {"type": "integer", "min": 1, "max": 50}, "status": {"enum": ["open", "closed"]},
                          "query": {"type": "string", "pattern": "^[a-z ]{1,40}$", "max_length": 40},
                          "path": {"path_prefix": "/workspace/"}, "url": {"allowed_by_network": True}}}]}}]}
    return out


class JsonRpcUpstream:
    """A minimal HTTPS/1.1 server answering every POST with a JSON-RPC result for the request's id."""

    def __init__(self, certs: procs.Certs) -> None:
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(str(certs.cert_pem), str(certs.key_pem))
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.requests = 0
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        if not ready.wait(10):
            raise RuntimeError("upstream did not start")

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ctx))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_json(reader, writer, self._answer)

    def _answer(self, _target: str, body: bytes) -> tuple[bytes, bytes]:
        self.requests += 1
        request_id = json.loads(body).get("id") if body else None
        return b"200 OK", json.dumps({"jsonrpc": "2.0", "id": request_id, "result": RESULT}).encode()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


async def _read(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return status, await reader.readexactly(int(line.split(b":", 1)[1]))
    raise RuntimeError(f"unframed answer (status {status}): {head[:200]!r}")


async def _cell(target: Target, seconds: float) -> list[float]:
    reader, writer = await connect(target)
    latencies = []
    deadline = time.perf_counter() + seconds
    i = 0
    try:
        while time.perf_counter() < deadline:
            i += 1
            body = json.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {
                "name": "search_tickets", "arguments": {**ARGUMENTS, "url": f"https://{target.authority}/mcp"}}})
            request = (f"POST /mcp HTTP/1.1\r\nHost: {target.authority}\r\nContent-Type: application/json\r\n"
                       f"Accept: application/json, text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n{body}")
            start = time.perf_counter()
            writer.write(request.encode())
            status, answer = await _read(reader)
            latencies.append((time.perf_counter() - start) * 1000)
            if status != 200 or json.loads(answer).get("result") != RESULT:
                raise RuntimeError(f"request {i}: HTTP {status} {answer[:300]!r}")
    finally:
        writer.close()
    return latencies


def _load() -> str:
    return Path("/proc/loadavg").read_text().strip()


def gateway_main(seconds: float, repeats: int, as_json: bool = False) -> None:
    procs.check_loopback_name()
    print(f"load at start: {_load()}", file=sys.stderr, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="e13e-mcp-bench-") as tmp:
        d = Path(tmp)
        certs = procs.make_certs(d)
        up = JsonRpcUpstream(certs)
        gw = None
        try:
            gdir = d / "egressgate"
            (gdir / "policies").mkdir(parents=True)
            for name, with_mcp in (("mcpbench-plain", False), ("mcpbench-mcp", True)):
                (gdir / "policies" / f"{name}.yaml").write_text(yaml.safe_dump(policy(name, up.port, with_mcp)))
            listen = {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": "127.0.0.2:0"}
            # MCP_BENCH_PROFILE=OUT.prof:LABEL: the gateway under loadtests.cprofile_gateway, profiling only
            # the cells of LABEL (plain or mcp); Python calls per request are then load-independent
            prof, _, prof_label = os.environ.get("MCP_BENCH_PROFILE", "").partition(":")
            program = ([sys.executable, "-m", "loadtests.cprofile_gateway", prof, "--", "run"] if prof
                       else [procs.EGRESSGATE, "run"])
            gw = procs.launch_egressgate(gdir, certs.ca_pem, listen, {"plain": "mcpbench-plain", "mcp": "mcpbench-mcp"},
                                         program=program)
            for rep in range(repeats):
                order = ["plain", "mcp"] if rep % 2 == 0 else ["mcp", "plain"]
                for label in order:
                    target = Target(scheme="https", host=procs.UPSTREAM_NAME, port=up.port,
                                    dial=("127.0.0.1", gw.info["port"]), via_proxy=True, ca_file=gw.info["ca"],
                                    proxy_auth=gw.info[label], path="/mcp")
                    cpu0 = gw.cpu_seconds()
                    if prof and label == prof_label:
                        os.kill(gw.pid, signal.SIGUSR1)
                    lat = asyncio.run(_cell(target, seconds))
                    if prof and label == prof_label:
                        os.kill(gw.pid, signal.SIGUSR2)
                    cpu = gw.cpu_seconds() - cpu0
                    lat.sort()
                    rows.append({"rep": rep, "target": label, "n": len(lat), "p50_ms": statistics.median(lat),
                                 "p99_ms": lat[max(0, int(len(lat) * 0.99) - 1)],
                                 "gw_cpu_ms_per_req": cpu * 1000 / len(lat)})
                    print(f"rep {rep + 1} {label:5} n={len(lat):5} p50 {rows[-1]['p50_ms']:.3f} ms p99 "
                          f"{rows[-1]['p99_ms']:.3f} ms gateway CPU {rows[-1]['gw_cpu_ms_per_req']:.3f} ms/req",
                          file=sys.stderr, flush=True)
            audit = Path(gw.info["audit"]).read_text(errors="replace")
            recorded = audit.count('"mcp_tool_call"')
            # audit records per request of each cell (the sandbox's admission record aside: < 1/n)
            lines = audit.splitlines()
            per_request = {label: sum(f'"mcpbench-{label}"' in line for line in lines)
                           / max(1, sum(r["n"] for r in rows if r["target"] == label)) for label in ("plain", "mcp")}
        finally:
            if gw is not None:
                gw.stop(grace=60 if prof else 10)
            up.stop()
    if prof:
        import pstats

        st = pstats.Stats(prof)
        # requests profiled = the decision stage's requestheaders calls (a signal may land after a cell began)
        n = sum(v[1] for (f, _l, fn), v in st.stats.items()  # type: ignore[attr-defined]
                if f.endswith(("gateway/pipeline/decision.py", "gateway/decision.py")) and fn == "requestheaders")
        enc = sum(v[1] for (f, _l, fn), v in st.stats.items()  # type: ignore[attr-defined]
                  if f.endswith("audit/encode.py") and fn == "encode_record")
        calls = st.total_calls  # type: ignore[attr-defined]
        print(f"profiled {prof_label} cells: {calls} Python calls / {n} requests = {calls / max(1, n):.0f} per "
              f"request; {enc / max(1, n):.2f} records encoded per request")
    med = {label: {k: statistics.median(r[k] for r in rows if r["target"] == label)
                   for k in ("p50_ms", "p99_ms", "gw_cpu_ms_per_req")} for label in ("plain", "mcp")}
    # paired: MCP minus plain within each repeat (adjacent cells), then the median over repeats -- robust
    # to the load drifting between repeats on a shared machine
    paired = {k: statistics.median(
        next(r[k] for r in rows if r["rep"] == rep and r["target"] == "mcp")
        - next(r[k] for r in rows if r["rep"] == rep and r["target"] == "plain") for rep in range(repeats))
        for k in ("p50_ms", "gw_cpu_ms_per_req")}
    summary = {"plain": med["plain"], "mcp": med["mcp"], "upstream_requests": up.requests,
               "mcp_tool_call_records": recorded, "records_per_request": per_request,
               "paired_overhead_p50_ms": paired["p50_ms"],
               "paired_overhead_cpu_ms_per_req": paired["gw_cpu_ms_per_req"],
               "overhead_p50_ms": med["mcp"]["p50_ms"] - med["plain"]["p50_ms"],
               "overhead_cpu_ms_per_req": med["mcp"]["gw_cpu_ms_per_req"] - med["plain"]["gw_cpu_ms_per_req"]}
    summary["load_at_end"] = _load()
    if as_json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
        return
    print(f"load at end: {summary['load_at_end']}")
    print(f"plain POST   p50 {med['plain']['p50_ms']:.3f} ms  p99 {med['plain']['p99_ms']:.3f} ms  "
          f"gateway CPU {med['plain']['gw_cpu_ms_per_req']:.3f} ms/req")
    print(f"MCP tools/call p50 {med['mcp']['p50_ms']:.3f} ms  p99 {med['mcp']['p99_ms']:.3f} ms  "
          f"gateway CPU {med['mcp']['gw_cpu_ms_per_req']:.3f} ms/req")
    print(f"overhead p50 {summary['overhead_p50_ms']:.3f} ms (goal <= 0.3), gateway CPU "
          f"{summary['overhead_cpu_ms_per_req']:.3f} ms/req; {recorded} mcp_tool_call records")
    print(f"paired (median over repeats of MCP - plain): p50 {paired['p50_ms']:.3f} ms, gateway CPU "
          f"{paired['gw_cpu_ms_per_req']:.3f} ms/req; audit records per request: plain "
          f"{per_request['plain']:.2f}, MCP {per_request['mcp']:.2f}")


async def _mediator_cell(calls: int) -> tuple[list[float], list[float]]:
    """McpSession driven in-process: the gateway's MCP work per call without mitmproxy (memory state store,
    the real file audit sink: the decision record is durable before from_client returns)."""
    import tempfile as _tempfile

    from egressgate.approvals.memory import MemoryApprovals
    from egressgate.audit.config import open_audit_sink
    from egressgate.config import load_config
    from egressgate.gateway.shared.context import PolicyHolder, Runtime
    from egressgate.mcp.mediator import McpSession
    from egressgate.policy.loader import parse_policy
    from egressgate.state.base import SandboxRecord, hash_token
    from egressgate.state.memory import MemoryState

    with _tempfile.TemporaryDirectory(prefix="e13e-mediator-") as tmp:
        var = Path(tmp) / "var"
        cfg = load_config(None, {"var_dir": str(var)})
        sink = await open_audit_sink(cfg.audit, var)
        compiled = parse_policy(yaml.safe_dump(policy("mcpbench-mcp", 443, True)), "bench.yaml")
        state = MemoryState()
        rt = Runtime(config=cfg, policies=PolicyHolder({compiled.name: compiled}), state=state, audit=sink,
                     resolver=None, ledger=None, approvals=MemoryApprovals())  # type: ignore[arg-type]
        sandbox = SandboxRecord(id="sbx-bench", token_hash=hash_token("t"), policy_name=compiled.name,
                                admitted_at=time.time(), labels={})
        await state.admit(sandbox)
        session = McpSession(rt, rt.policies.get(compiled.name), compiled.mcp.servers["bench"], sandbox,
                             "streamable_http")
        to_server, to_client = [], []
        try:
            for i in range(1, calls + 1):
                body = json.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {
                    "name": "search_tickets", "arguments": {**ARGUMENTS, "url": f"https://{procs.UPSTREAM_NAME}/mcp"}}})
                start = time.perf_counter()
                verdict = await session.from_client(body.encode())
                mid = time.perf_counter()
                if verdict.forward is None:
                    raise RuntimeError(f"call {i} refused: {verdict.replies}")
                answer = json.dumps({"jsonrpc": "2.0", "id": i, "result": RESULT}).encode()
                if await session.from_server_bytes(answer) is None:
                    raise RuntimeError(f"answer {i} dropped")
                to_server.append((mid - start) * 1000)
                to_client.append((time.perf_counter() - mid) * 1000)
        finally:
            await session.close()
            await sink.close()
    return sorted(to_server), sorted(to_client)


def mediator_main(calls: int = 2000) -> None:
    to_server, to_client = asyncio.run(_mediator_cell(calls))
    for name, lat in (("from_client (strict parse, decide, count, durable record)", to_server),
                      ("from_server_bytes (answer read, outcome queued)", to_client)):
        print(f"{name:<60} p50 {statistics.median(lat):.3f} ms  p99 {lat[int(len(lat) * 0.99) - 1]:.3f} ms")
