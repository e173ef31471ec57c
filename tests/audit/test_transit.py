"""Checkpoints signed by a real OpenBao transit key (the broker's TransitSigner) verify end to end, and a
Vault that stops signing makes the sink fail closed."""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner

from egressgate.audit.cli import audit
from egressgate.audit.event import AuditUnavailable
from egressgate.audit.filesink import FileSink
from egressgate.broker.signer import TransitSigner
from egressgate.broker.vault import VaultBackend
from tests.audit.conftest import http_event
from tests.broker.bao import BaoServer
from tests.broker.test_vault import vault_config


async def test_transit_signed_checkpoints_verify_and_vault_down_denies(tmp_path):
    bao = BaoServer().start().configure()
    backend = VaultBackend(vault_config(bao))
    try:
        await backend.start()
        signer = await TransitSigner.create(backend)
        sink = await FileSink(tmp_path / "a" / "audit.jsonl", signer, checkpoint_every=3).start()
        for i in range(7):
            await sink.write(http_event(i))
        await sink.close()
        pub = tmp_path / "transit.pub"
        pub.write_bytes(signer.public_pem())
        r = CliRunner().invoke(audit, ["verify", "--public-key", str(pub), str(sink.path)])
        assert r.exit_code == 0 and "3 checkpoints, sealed" in r.output, r.output

        down = await FileSink(tmp_path / "b" / "audit.jsonl", signer, checkpoint_every=2).start()
        await down.write(http_event(1))  # chain_start, record, checkpoint
        bao.stop()
        await down.write(http_event(2))  # no checkpoint due: durable without Vault
        with pytest.raises(AuditUnavailable):  # its checkpoint cannot be signed: fail closed
            await down.write(http_event(3))
        assert not down.healthy()
        await asyncio.wait_for(down.close(), 10)  # the final checkpoint cannot be signed; close still ends
    finally:
        bao.stop()
        await backend.aclose()
