"""`audit find --request-id` returns every record of one request: its decision, its outcome, and the
credential-issue record minted for it (which has its own id and names the request in
`egressgate.trigger_request`). Records of other requests are not returned (the negative control)."""

from __future__ import annotations

from click.testing import CliRunner

from egressgate.audit.cli import audit
from egressgate.audit.event import EventKind
from tests.support.audit_events import http_event


async def test_find_by_request_id_links_decision_outcome_and_credential(make_sink):
    sink = await make_sink()
    await sink.write(http_event(1, request_id="req-a"))
    await sink.write(http_event(2, request_id="cred-1", kind=EventKind.CREDENTIAL_ISSUE, capability="openai",
                                extra={"egressgate.trigger_request": "req-a"}))
    await sink.write(http_event(3, request_id="req-b"))
    await sink.write(http_event(4, request_id="cred-2", kind=EventKind.CREDENTIAL_ISSUE, capability="openai",
                                extra={"egressgate.trigger_request": "req-b"}))
    await sink.write(http_event(5, request_id="req-a", kind=EventKind.OUTCOME, status=200))
    await sink.close()
    r = CliRunner().invoke(audit, ["find", str(sink.path), "--request-id", "req-a"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert len(lines) == 3
    assert all(("req-a" in line) for line in lines)
    assert sum('"credential_issue"' in line for line in lines) == 1
    assert not any("req-b" in line or "cred-2" in line for line in lines)
