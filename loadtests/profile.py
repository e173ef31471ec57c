"""Where a proxy process spends its time under load: py-spy samples while a load cell runs.

`py-spy record --format raw` writes collapsed stacks ("frame;frame;frame count"). We summarize them as
(a) self time by function and (b) inclusive time by component — a stack counts for every component it
passes through (an egressgate addon module, a mitmproxy layer, TLS, the event loop's I/O) — which is the
question a profile has to answer before anyone optimizes. The profiling run is separate from the measured
cells: sampling with py-spy pauses the target, so its rps is not a figure.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

PY_SPY = str(Path(sys.executable).parent / "py-spy")

# component -> regex over one frame text ("function (file.py:line)")
COMPONENTS: list[tuple[str, str]] = [
    ("egressgate.identity", r"egressgate/gateway/identity\.py"),
    ("egressgate.consistency", r"egressgate/gateway/consistency\.py"),
    ("egressgate.sanitize", r"egressgate/gateway/sanitize\.py"),
    ("egressgate.decision (gateway)", r"egressgate/gateway/decision\.py"),
    ("egressgate.policy (decide/canon)", r"egressgate/policy/"),
    ("egressgate.pinning+resolver", r"egressgate/gateway/(pinning|resolver)\.py"),
    ("egressgate.streaming", r"egressgate/gateway/streaming\.py"),
    ("egressgate.budgets", r"egressgate/gateway/budgets\.py"),
    ("egressgate.audit_emit", r"egressgate/gateway/audit_emit\.py"),
    ("egressgate.audit sink (encode/chain/write)", r"egressgate/audit/"),
    ("egressgate.state", r"egressgate/state/"),
    ("egressgate.revocation", r"egressgate/gateway/revocation\.py"),
    ("egressgate.tunnel (next layer)", r"egressgate/gateway/tunnel\.py"),
    ("egressgate.context", r"egressgate/gateway/context\.py"),
    ("mitmproxy addon dispatch (hooks)", r"mitmproxy/addonmanager\.py"),
    ("mitmproxy http layer", r"mitmproxy/proxy/layers/http/"),
    ("mitmproxy tls layer", r"mitmproxy/proxy/layers/tls\.py"),
    ("mitmproxy server/connection handler", r"mitmproxy/proxy/server\.py"),
    ("mitmproxy default addons", r"mitmproxy/addons/"),
    ("ssl (OpenSSL calls)", r"ssl\.py|_ssl|OpenSSL"),
    ("event loop select/idle", r"select \(selectors\.py"),
]


def record(pid: int, seconds: float, out: Path, rate: int = 200) -> subprocess.Popen:
    """Start py-spy on `pid` for `seconds` (it stops by itself); wait() on the returned process."""
    return subprocess.Popen(
        [PY_SPY, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
         "--format", "raw", "--output", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def summarize(raw: Path, top: int = 15) -> dict:
    """Self time by function and inclusive share by component, in % of non-idle samples."""
    self_time: Counter[str] = Counter()
    comp: Counter[str] = Counter()
    total = idle = 0
    line_re = re.compile(r"^(.*) (\d+)$")
    compiled = [(name, re.compile(rx)) for name, rx in COMPONENTS]
    for line in raw.read_text(errors="replace").splitlines():
        m = line_re.match(line)
        if not m:
            continue
        stack, count = m.group(1), int(m.group(2))
        frames = stack.split(";")
        leaf = frames[-1]
        if "select (selectors.py" in leaf or leaf.startswith("_worker (concurrent"):
            idle += count
            continue
        if not any("MainThread" in f or "run_forever" in f or "_run_once" in f for f in frames):
            continue  # only the event-loop thread: executor threads idle or resolve off-loop
        total += count
        self_time[re.sub(r":\d+\)$", ")", leaf)] += count
        for name, rx in compiled:
            if rx.search(stack):
                comp[name] += count
    pct = (lambda n: round(100.0 * n / total, 1)) if total else (lambda n: 0.0)
    return {
        "busy_samples": total,
        "idle_samples": idle,
        "components_pct": {k: pct(v) for k, v in comp.most_common()},
        "self_top_pct": [(k, pct(v)) for k, v in self_time.most_common(top)],
    }


def profile_during(pid: int, seconds: float, out: Path, run_load) -> dict:
    """Record `pid` while `run_load()` runs (run_load blocks for about `seconds`)."""
    spy = record(pid, seconds, out)
    time.sleep(0.3)
    try:
        run_load()
    finally:
        try:
            _, err = spy.communicate(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
    if not out.exists():
        return {"error": f"py-spy wrote no profile: {err.strip()[-300:]}"}
    return summarize(out)
