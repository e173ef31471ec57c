"""Where a gateway process spends its CPU, without py-spy: `egressgate` under cProfile, summarized by component.

    python -m loadtests.cprofile_gateway OUT.prof -- run --config gateway.yaml     # profile a gateway
    kill -USR1 PID; <load>; kill -USR2 PID; kill -TERM PID                          # only the load is profiled
    python -m loadtests.cprofile_gateway --summarize OUT.prof                         # print the breakdown

The wrapper runs the `egressgate` console script's own entry point (egressgate.cli:main) with cProfile off;
SIGUSR1 turns it on and SIGUSR2 off (start-up — imports, CA key, policy load — is not what a request costs),
and the stats are written when the gateway returns (SIGTERM stops it cleanly). cProfile
is deterministic and slows the process down (~1.5-2x on this code), so a profiled run's rps is not a figure:
what counts is the split. The summary sums *self* time (tottime, which adds up to the total without double
counting) by component — the same components as loadtests/profile.py's py-spy summary, plus redis-py and
asyncio — and lists the top functions by self time and the egressgate.state functions by inclusive time
(what a request waits for in the state backend, including its I/O calls).
"""

from __future__ import annotations

import cProfile
import pstats
import re
import signal
import sys
from pathlib import Path

from loadtests.profile import COMPONENTS

IDLE = "selector/epoll wait (idle)"
FIRST = [(IDLE, r"method 'poll' of 'select\.epoll'"),
         ("socket syscalls (send/recv/accept)", r"of '_socket\.socket' objects"),
         ("ssl (OpenSSL calls)", r"_ssl\.|SSL_|_openssl|of '_ssl\.")]
LAST = [("redis-py (client, parser, pool)", r"/redis/"),
        ("asyncio (event loop, streams, transports)", r"/asyncio/"),
        ("mitmproxy (other: layer machinery, models, connections)", r"/mitmproxy/"),
        ("egressgate (other modules)", r"/egressgate/"),
        ("h11/h2/hpack/wsproto", r"/(h11|h2|hpack|wsproto)/"),
        ("aiohttp (admin API)", r"/aiohttp/"),
        ("logging", r"/logging/")]


def component(filename: str, func: str) -> str:
    """The component a function belongs to: its file for Python code, its name for C functions ("~")."""
    text = f"{func} ({filename}"
    for name, rx in [*FIRST, *COMPONENTS, *LAST]:
        if re.search(rx, text):
            return name
    if filename.startswith("~") or filename == "":
        return "other builtins (C functions: json, hashlib, str/bytes ops...)"
    return "other python (stdlib)"


def summarize(prof: Path, top: int = 20) -> dict:
    st = pstats.Stats(str(prof))
    by_comp: dict[str, float] = {}
    funcs: list[tuple[float, float, int, str]] = []
    state_funcs: list[tuple[float, int, str]] = []
    total = 0.0
    idle = 0.0
    for (filename, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        comp = component(filename, func)
        if comp == IDLE:
            idle += tt
            continue
        total += tt
        by_comp[comp] = by_comp.get(comp, 0.0) + tt
        where = f"{func} ({Path(filename).name}:{line})" if filename != "~" else func
        funcs.append((tt, ct, nc, where))
        if "egressgate/state/" in filename:
            state_funcs.append((ct, nc, where))
    pct = (lambda x: round(100 * x / total, 1)) if total else (lambda x: 0.0)
    return {
        "busy_s": round(total, 2), "idle_s": round(idle, 2),
        "components_self_pct": dict(sorted(((k, pct(v)) for k, v in by_comp.items()), key=lambda kv: -kv[1])),
        "top_self": [(w, pct(tt), round(1e6 * tt / nc, 1) if nc else None, nc) for tt, _ct, nc, w in
                     sorted(funcs, reverse=True)[:top]],
        "state_inclusive": [(w, round(1e6 * ct / nc, 1) if nc else None, nc) for ct, nc, w in
                            sorted(state_funcs, reverse=True)[:top]],
    }


def describe(s: dict) -> str:
    lines = [f"busy {s['busy_s']} s (self time outside the epoll wait), idle {s['idle_s']} s",
             "self time by component:"]
    lines += [f"  {v:5.1f}%  {k}" for k, v in s["components_self_pct"].items() if v >= 0.5]
    lines.append("top functions by self time (% of busy, µs per call, calls):")
    lines += [f"  {p:5.1f}%  {us} µs  x{n}  {w}" for w, p, us, n in s["top_self"]]
    if s["state_inclusive"]:
        lines.append("egressgate.state functions, inclusive µs per call (profiled, so inflated):")
        lines += [f"  {us} µs  x{n}  {w}" for w, us, n in s["state_inclusive"]]
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--summarize"]:
        print(describe(summarize(Path(argv[1]))))
        return
    out, rest = argv[0], argv[argv.index("--") + 1:]
    sys.argv = ["egressgate", *rest]
    from egressgate.cli import main as egressgate_main

    prof = cProfile.Profile()
    # handlers run in the main thread (the event loop's): the thread cProfile then profiles
    signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
    signal.signal(signal.SIGUSR2, lambda *_: prof.disable())
    try:
        egressgate_main()
    finally:
        prof.disable()
        prof.dump_stats(out)


if __name__ == "__main__":
    main()
