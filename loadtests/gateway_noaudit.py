"""Benchmark-only launcher: the real `egressgate run`, with the audit file sink swapped for a discard sink.

Issue 6 asks for gateway rps with audit on vs off in one run. The gateway config has no switch to turn
audit off (on purpose: a security product should not have one), so the "off" side of the ratio runs the
same Gateway (same addons: AuditEmit still builds every event) through this module, which replaces
`open_audit_sink` with `DiscardSink` before the gateway starts. The difference therefore measures the sink
itself: chaining, OTLP/JSON encoding, hashing, the group-commit write — not event construction.

NEVER use this outside the benchmark: it records nothing.

    python -m loadtests.gateway_noaudit --config gateway.yaml   (same stdout contract as `egressgate run`)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from egressgate.audit.event import AuditEvent
from egressgate.config import load_config
from egressgate.gateway.service import app


class DiscardSink:
    """AuditSink that accepts and drops every event (healthy, never raises)."""

    def __init__(self) -> None:
        self.count = 0

    async def write(self, event: AuditEvent) -> None:
        self.count += 1

    async def write_after(self, event: AuditEvent) -> bool:
        self.count += 1
        return True

    def enqueue_after(self, event: AuditEvent) -> None:
        self.count += 1

    def healthy(self) -> bool:
        return True

    def status(self) -> dict:
        return {"status": "ok", "sink": "discard (bench only)"}

    async def close(self) -> None:
        return None


async def _open_discard_sink(*_args, **_kwargs) -> DiscardSink:
    return DiscardSink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    cfg = load_config(args.config)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    for noisy in ("mitmproxy", "hpack", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not hasattr(app, "open_audit_sink"):
        raise SystemExit("egressgate.gateway.service.app no longer uses open_audit_sink; update this launcher")
    app.open_audit_sink = _open_discard_sink  # type: ignore[assignment]

    def announce(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    asyncio.run(app.serve(cfg, announce))


if __name__ == "__main__":
    main()
