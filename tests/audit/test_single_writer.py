"""One writer per audit file: a second gateway (or worker) pointed at an audit file another one is writing
must refuse to start, not take it over.

Why it matters: a hash chain has one writer. A second process that opens a live file finds it unsealed
(the first has not written its final checkpoint) and "recovers" it: it appends a signed `recovery` seal
and starts a chain of its own in the same file, while the first keeps appending to it; the trail then
fails `audit verify`. Two gateways started with the same config (systemd and a manual start, two
replicas sharing a var dir, a supervisor restarted while its old workers still drain) do exactly this,
and with SO_REUSEPORT listeners nothing else stops the second one from serving.
"""

from __future__ import annotations

import pytest

from egressgate.audit.filesink import FileSink
from egressgate.audit.signer import load_public_keys
from egressgate.audit.verify import verify_files
from tests.support.audit_events import http_event


async def test_a_second_writer_of_a_live_audit_file_is_refused(tmp_path, signer, pubkey):
    path = tmp_path / "audit" / "audit.w0.jsonl"
    first = await FileSink(path, signer).start()
    try:
        await first.write(http_event(0, request_id="first-0"))
        second = FileSink(path, signer)
        with pytest.raises(RuntimeError, match="another process"):
            await second.start()
        await first.write(http_event(1, request_id="first-1"))  # the first writer is unharmed
    finally:
        await first.close()
    reps = verify_files([path], load_public_keys([pubkey]))
    assert all(r.ok for r in reps), [r.error for r in reps]
    # positive control: once the first writer is gone, the file is free, and the chain continues
    third = await FileSink(path, signer).start()
    await third.write(http_event(2, request_id="third-2"))
    await third.close()


async def test_writers_of_different_files_in_one_directory_do_not_block_each_other(tmp_path, signer):
    """Workers of `run --workers N` share the directory, each with its own file: no false refusal."""
    sinks = [await FileSink(tmp_path / "audit" / f"audit.w{i}.jsonl", signer).start() for i in range(2)]
    try:
        for i, sink in enumerate(sinks):
            await sink.write(http_event(i, request_id=f"w{i}"))
    finally:
        for sink in sinks:
            await sink.close()


def test_a_second_gateway_on_the_same_audit_file_does_not_start(tmp_path):
    """Process level: `egressgate run` twice on one audit file (ephemeral ports, so both could bind; its own
    var dir, so the var-dir lock of gateway/service/varlock.py does not refuse it first): the second exits naming
    the audit file; the first keeps serving and its trail verifies."""
    import yaml

    from tests.support.cli import cli, run
    from tests.support.launcher import EGRESSGATE, launch_loopback, stop_process, write_policies

    policies = write_policies(tmp_path / "policies", {"p": {"sandbox": {"name": "p"}, "network": {}}})
    config = {"listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0", "dns": None, "transparent": None},
              "policy": str(policies), "var_dir": str(tmp_path / "var"),
              "broker": {"local_key_dir": str(tmp_path / "var" / "keys")}}
    first = launch_loopback(tmp_path, config)
    try:
        other = tmp_path / "second.yaml"
        other.write_text(yaml.safe_dump({**config, "var_dir": str(tmp_path / "var2"),
                                         "audit": {"path": str(first["var"] / "audit.jsonl")}}))
        second = run([EGRESSGATE, "run", "--config", str(other)], timeout=60)
        assert second.returncode != 0, second.stdout
        assert "another process" in second.stderr and "audit" in second.stderr, second.stderr[-2000:]
        first["proc"].poll()
        assert first["proc"].returncode is None  # the first gateway still runs
    finally:
        assert stop_process(first["proc"]) == 0
    live = first["var"] / "audit.jsonl"
    result = cli("audit", "verify", "--public-key", str(first["var"] / "audit-signing.key.pub"), str(live))
    assert result.returncode == 0, result.stdout + result.stderr
