"""Checkpoints signed by a real OpenBao transit key (the broker's TransitSigner) verify end to end. When
the OpenBao process is really stopped, checkpoints are deferred (records keep being written and allowed),
and when the same OpenBao comes back the deferred range is signed; `verify` reports it. The exposure is
bounded by `max_unsigned`."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from click.testing import CliRunner

from egressgate.audit.cli import audit
from egressgate.audit.event import AuditUnavailable
from egressgate.audit.filesink import FileSink
from egressgate.audit.signer import load_public_keys
from egressgate.audit.verify import verify_files
from egressgate.broker.signer import TransitSigner
from egressgate.broker.vault import VaultBackend
from tests.audit.forge import line_index, rewrite_chain
from tests.support.audit_events import http_event
from tests.support.bao import vault_config
from tests.support.bao_persistent import PersistentBao


@pytest.fixture(scope="module")
def persistent_bao(tmp_path_factory):
    """One OpenBao with on-disk storage for the module (initializing one takes seconds); tests stop it."""
    bao = PersistentBao(home=tmp_path_factory.mktemp("bao")).start()
    try:
        yield bao.configure()
    finally:
        bao.stop()


@pytest.fixture
async def vault(persistent_bao, tmp_path):
    bao = persistent_bao
    if bao.proc is None or bao.proc.poll() is not None:
        bao.start()  # an earlier test left it stopped
    backend = VaultBackend(vault_config(bao, timeout_seconds=2))
    try:
        await backend.start()
        signer = await TransitSigner.create(backend)
        pub = tmp_path / "transit.pub"
        pub.write_bytes(signer.public_pem())
        yield bao, signer, pub
    finally:
        await backend.aclose()


async def wait_for(cond, timeout: float = 30) -> None:
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_transit_signed_checkpoints_verify(vault, tmp_path):
    _, signer, pub = vault
    sink = await FileSink(tmp_path / "a" / "audit.jsonl", signer, checkpoint_every=3).start()
    for i in range(7):
        await sink.write(http_event(i))
    await sink.close()
    r = CliRunner().invoke(audit, ["verify", "--public-key", str(pub), str(sink.path)])
    assert r.exit_code == 0 and "3 checkpoints, sealed" in r.output, r.output


async def test_vault_outage_defers_checkpoints_then_signs_them(vault, tmp_path):
    bao, signer, pub = vault
    sink = await FileSink(tmp_path / "b" / "audit.jsonl", signer, checkpoint_every=2, probe_interval=0.2).start()
    await sink.write(http_event(1))  # chain_start, record, signed checkpoint
    bao.stop()  # the real OpenBao process is gone
    written = [http_event(10 + i) for i in range(9)]
    for ev in written:  # four checkpoints fall due while Vault is down: no record is refused
        await sink.write(ev)
    assert sink.healthy()
    status = sink.status()
    assert not status["signer"]["available"] and status["signer"]["deferred_checkpoints"] >= 4
    assert status["unsigned_records"] >= 9
    # control: at this point no signature covers the records written during the outage
    snap = tmp_path / "snapshot.jsonl"
    shutil.copy(sink.path, snap)
    reps = verify_files([snap], load_public_keys([pub]))
    assert "not covered by a signature" in reps[-1].error, reps[-1].error

    bao.start()  # the same Vault (same storage, same key) comes back
    await wait_for(lambda: sink.status()["signer"]["available"] and sink.status()["unsigned_records"] <= 1)
    await sink.write(http_event(99))
    await sink.close()
    r = CliRunner().invoke(audit, ["verify", "--public-key", str(pub), str(sink.path)])
    assert r.exit_code == 0, r.output
    assert "deferred (signer unavailable)" in r.output and "signed late" in r.output, r.output

    # positive control: an attacker rewrites a record of the deferred range and re-hashes the chain;
    # the late signature no longer matches
    idx = line_index(sink.path, lambda a: a.get("egressgate.request.id") == written[3].request_id)
    rewrite_chain(sink.path, idx, "server.address", "evil.example")
    r = CliRunner().invoke(audit, ["verify", "--public-key", str(pub), str(sink.path)])
    assert r.exit_code == 1 and "bad signature on checkpoint" in r.output, r.output


async def test_unsigned_records_are_bounded(vault, tmp_path):
    bao, signer, _ = vault
    sink = await FileSink(tmp_path / "c" / "audit.jsonl", signer, checkpoint_every=2, max_unsigned=6,
                          probe_interval=0.2).start()
    await sink.write(http_event(1))
    bao.stop()
    accepted = 0
    with pytest.raises(AuditUnavailable, match="not covered by a signature"):
        for i in range(20):
            await sink.write(http_event(10 + i))
            accepted += 1
    assert 3 <= accepted <= 6 and not sink.healthy()
    await asyncio.wait_for(sink.close(), 20)
