"""A crash's lost outcome records are reported by `audit verify`, by request id (issue 23, item 4).

A sink is stopped as kill -9 stops it (tests/support/audit_events.crash) while one outcome waits in the
write-behind queue and one request is still in flight; the next start seals the file with a recovery
checkpoint. `verify` must name exactly those two decisions as a recovered gap — not the decisions whose
outcome was written, not denials, not intercepted tunnels (their requests have their own records), and not
a decision whose outcome the next run wrote (as the retry spool does). Control: the same traffic with a
clean close reports no gap (every queued outcome is written by close). The process-level kill -9 of a real
gateway is in tests/gateway/test_audit_faults.py.
"""

from __future__ import annotations

from click.testing import CliRunner

from egressgate.audit.cli import audit
from egressgate.audit.event import EventKind
from egressgate.audit.filesink import FileSink
from egressgate.audit.signer import load_public_keys
from egressgate.audit.verify import verify_files
from tests.support.audit_events import crash, http_event


def _history(path) -> list:
    rotated = sorted(p for p in path.parent.iterdir() if p.suffix == ".jsonl" and p != path)
    return [*rotated, path]


async def _traffic(sink: FileSink) -> dict[str, str]:
    """Decisions and outcomes; returns request ids by role."""
    ids = {}
    connect = EventKind.CONNECT
    for role, kw in (
        ("done", {}),
        ("queued", {}),
        ("in_flight", {}),
        ("denied", {"decision": "deny", "reason": "host_not_allowed", "rule_id": None}),
        ("tunnel", {"kind": connect, "extra": {"egressgate.intercept": True}}),
        ("raw_tcp", {"kind": connect, "scheme": "tcp", "extra": {"egressgate.intercept": False}}),
        ("spooled", {}),
    ):
        ev = http_event(len(ids), **kw)
        await sink.write(ev)
        ids[role] = ev.request_id
    await sink.write_after(http_event(90, kind=EventKind.OUTCOME, request_id=ids["done"], status=200))
    await sink.write_after(http_event(91, kind=EventKind.OUTCOME, request_id=ids["raw_tcp"], scheme="tcp"))
    # behind the response: waits for the next batch (after_delay is an hour here), lost by a kill -9
    sink.enqueue_after(http_event(92, kind=EventKind.OUTCOME, request_id=ids["queued"], status=200))
    sink.enqueue_after(http_event(93, kind=EventKind.OUTCOME, request_id=ids["spooled"], status=200))
    return ids


async def test_verify_names_each_decision_a_crash_left_without_outcome(tmp_path, signer, pubkey):
    path = tmp_path / "audit" / "audit.jsonl"
    sink = await FileSink(path, signer, after_delay=3600).start()
    ids = await _traffic(sink)
    await crash(sink)
    # the next run: seals the crashed file (recovery checkpoint); writes the spooled request's outcome
    again = await FileSink(path, signer).start()
    await again.write_after(
        http_event(
            94,
            kind=EventKind.OUTCOME,
            request_id=ids["spooled"],
            status=200,
            extra={"egressgate.retry.after_restart": True},
        )
    )
    await again.write(http_event(95))
    await again.close()
    files = _history(path)
    assert len(files) == 2
    reports = verify_files(files, load_public_keys([pubkey]))
    assert all(r.ok for r in reports), [r.error for r in reports]
    assert reports[0].missing_outcomes == [ids["queued"], ids["in_flight"]]
    assert reports[1].missing_outcomes == []
    (gap,) = [w for w in reports[0].warnings if "recovered gap" in w]
    assert f"{ids['queued']}, {ids['in_flight']}" in gap and "2 allowed decision(s)" in gap
    r = CliRunner().invoke(audit, ["verify", "--public-key", str(pubkey), *map(str, files)])
    assert r.exit_code == 0, r.output
    assert "recovered gap" in r.stderr and ids["queued"] in r.stderr and ids["in_flight"] in r.stderr
    assert ids["done"] not in r.stderr and ids["spooled"] not in r.stderr and ids["denied"] not in r.stderr


async def test_clean_close_leaves_no_gap(tmp_path, signer, pubkey):
    """Control: close writes every queued outcome; the in-flight request's outcome comes before close, as
    the gateway writes it when the flow ends. No crash, no gap."""
    path = tmp_path / "audit" / "audit.jsonl"
    sink = await FileSink(path, signer, after_delay=3600).start()
    ids = await _traffic(sink)
    sink.enqueue_after(http_event(96, kind=EventKind.OUTCOME, request_id=ids["in_flight"], status=499))
    await sink.close()
    reports = verify_files(_history(path), load_public_keys([pubkey]))
    assert all(r.ok for r in reports) and all(r.missing_outcomes == [] for r in reports)
    assert not any("recovered gap" in w for r in reports for w in r.warnings)


async def test_a_crash_with_every_outcome_written_reports_nothing(tmp_path, signer, pubkey):
    """Control: the crash is reported (recovery checkpoint) but no decision lacks its outcome."""
    path = tmp_path / "audit" / "audit.jsonl"
    sink = await FileSink(path, signer).start()
    ev = http_event(1)
    await sink.write(ev)
    await sink.write_after(http_event(2, kind=EventKind.OUTCOME, request_id=ev.request_id))
    await crash(sink)
    again = await FileSink(path, signer).start()
    await again.close()
    reports = verify_files(_history(path), load_public_keys([pubkey]))
    assert all(r.ok for r in reports)
    assert any("recovery checkpoint" in w for w in reports[0].warnings)
    assert not any("recovered gap" in w for r in reports for w in r.warnings)
