"""`audit replay` over a forged or corrupted line: a host the gateway would never record (not canonical)
or a path not in origin form is skipped as "lacks the facts", never a traceback in the auditor's tool
(found by `policy learn`, which replays its own output: decide() raised CanonError / IndexError)."""

from __future__ import annotations

import textwrap

from click.testing import CliRunner

from egressgate.audit.cli import audit
from tests.policy_learn.conftest import Session

POLICY = textwrap.dedent("""\
    sandbox: {name: agent}
    network:
      https:
        allow: [{id: ok, host: ok.example.com}]
        deny: [{id: no-admin, host: "*", paths: ["/admin/**"]}]
    """)


async def test_forged_records_are_skipped_not_a_traceback(tmp_path, signer):
    s = Session(POLICY)
    s.admit("s1")
    s.request("s1", "GET https://ok.example.com/fine")
    s.recorded("s1", "host_not_allowed", host="evil.com\n- {host: '*'}", port=443, scheme="https", method="GET",
               path="/x")
    s.recorded("s1", "host_not_allowed", host="ok.example.com", port=443, scheme="https", method="GET", path="x")
    path = await s.write(tmp_path / "audit.jsonl", signer)
    (tmp_path / "p.yaml").write_text(POLICY)
    run = CliRunner().invoke(audit, ["replay", str(path), "--policy", str(tmp_path / "p.yaml")])
    assert run.exception is None or isinstance(run.exception, SystemExit), run.exception
    assert run.exit_code == 0, run.output
    assert "1 replayed" in run.output and "skipped 2: record lacks the facts to re-decide" in run.output
