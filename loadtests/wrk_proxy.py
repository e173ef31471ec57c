"""wrk as a plain-HTTP forward-proxy client: a C load generator, so the proxy, not the client, is the limit.

wrk has no proxy option, but a forward proxy for plain HTTP needs nothing but the absolute-form request
line: wrk connects to the proxy's address and a Lua script sends `GET http://upstream:port/path` with the
upstream's Host and Proxy-Authorization headers. (HTTPS would need CONNECT and TLS inside the tunnel, which
wrk cannot do; those cells use loadtests/loadgen.py.) The Python load generator needs ~0.5-1 core at a few
thousand rps; wrk needs a fraction of that, which matters on a 2-core machine where client and gateway share.

A request counts as OK only with a 2xx status (wrk's own non-2xx counter is the check, and the caller also
compares with the upstream's request counter: a deny never reaches the upstream). wrk's latency figures are
its own (HdrHistogram over every request of the run, which includes the first request on each connection).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from loadtests.loadgen import CellResult, Target

SCRIPT = r"""
local req
function init(args)
  req = wrk.format("GET", args[1], {["Host"] = args[2], ["Proxy-Authorization"] = args[3]})
end
function request() return req end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'EGB-WRK {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, "status": %d, ' ..
    '"timeout": %d, "p50_us": %d, "p99_us": %d}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def available() -> str | None:
    """None when wrk is installed, else why the plain-HTTP cells fall back to the Python client."""
    return None if shutil.which("wrk") else "wrk is not installed (apt-get install wrk)"


def run_cell(target: Target, concurrency: int, seconds: float, prefix: Sequence[str] = ()) -> CellResult:
    """One cell: `concurrency` keep-alive connections from one wrk thread for `seconds`, through the proxy."""
    if target.scheme != "http" or not target.via_proxy:
        raise ValueError("wrk_proxy drives plain HTTP through a forward proxy only")
    auth = target.auth_header().decode().split(":", 1)[1].strip() if target.proxy_auth else ""
    url = f"http://{target.authority}{target.path}"
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as fh:
        fh.write(SCRIPT)
        script = fh.name
    cpu0 = _children_cpu()
    try:
        cmd = [*prefix, "wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
               "-s", script, f"http://{target.dial[0]}:{target.dial[1]}/", "--", url, target.authority, auth]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise RuntimeError("wrk did not finish") from None
    finally:
        Path(script).unlink(missing_ok=True)
    client_cpu = _children_cpu() - cpu0  # communicate() waited for wrk: its CPU is in our children's times
    line = next((x for x in out.splitlines() if x.startswith("EGB-WRK ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {err.strip()[-300:]} {out.strip()[-300:]}")
    r = json.loads(line[8:])
    dur = r["duration_us"] / 1e6
    errors = {k: r[k] for k in ("connect", "read", "write", "status", "timeout") if r[k]}
    ok = r["requests"] - r["status"]
    return CellResult(rps=ok / dur, p50_ms=r["p50_us"] / 1000, p99_ms=r["p99_us"] / 1000, ok=ok, errors=errors,
                      seconds=dur, loadgen_cpu=client_cpu / dur)


def _children_cpu() -> float:
    """CPU seconds of waited-for children so far (wrk's CPU = the difference around one run)."""
    t = os.times()
    return t.children_user + t.children_system
