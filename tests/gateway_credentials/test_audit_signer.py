"""With a Vault broker, audit checkpoints are signed by the broker's Vault transit key (`audit.signer: auto`):
the signing key never exists on the gateway host."""

from __future__ import annotations

import base64
import json

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from egressgate.audit.signer import key_id_for
from tests.support.launcher import flatten_otlp


def test_checkpoints_use_the_vault_transit_key(cgw, cbao):
    keys = cbao.root().secrets.transit.read_key("egressgate-audit")["data"]["keys"]
    latest = max(keys, key=int)
    transit_key_id = key_id_for(Ed25519PublicKey.from_public_bytes(base64.b64decode(keys[latest]["public_key"])))
    cgw.admit("cred-kv")  # an audited admission: the file's chain starts with the signer's key id
    first = json.loads((cgw.var / "audit.jsonl").read_text().splitlines()[0])
    attrs = flatten_otlp(first)
    assert attrs["egressgate.operation"] == "chain_start"
    assert attrs["egressgate.key_id"] == transit_key_id
    assert not (cgw.var / "audit-signing.key").exists()  # no local signing key was ever created
