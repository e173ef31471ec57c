"""verify catches each kind of tampering and names the first bad record; find returns a request's records."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from click.testing import CliRunner

from egressgate.audit.chain import compute_line_hash, hash_field_span
from egressgate.audit.cli import audit
from egressgate.audit.signer import LocalEd25519Signer, load_public_keys
from egressgate.audit.verify import verify_file, verify_files
from tests.support.audit_events import http_event


@pytest.fixture
async def sealed(make_sink, tmp_path):
    sink = await make_sink(checkpoint_every=4)
    for i in range(10):
        await sink.write(http_event(i, request_hash=f"sha256:{i:064x}"))
    await sink.close()
    return sink.path


@pytest.fixture
def keys(pubkey):
    return load_public_keys([pubkey])


def lines_of(path):
    return path.read_bytes().splitlines(keepends=True)


def rehash(line: bytes) -> bytes:
    """What an attacker without the key can do: make the edited line's own hash consistent."""
    body = line.rstrip(b"\n")
    pos = hash_field_span(body)
    return body[:pos] + compute_line_hash(body).encode() + body[pos + 64 :] + b"\n"


def set_attr(line: bytes, key: str, new: str) -> bytes:
    doc = json.loads(line)
    for kv in doc["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]["attributes"]:
        if kv["key"] == key:
            kv["value"] = {"stringValue": new}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def test_untouched_file_verifies(sealed, keys):
    rep = verify_file(sealed, keys)
    assert rep.ok, rep.error
    assert rep.sealed and rep.records == 14 and rep.checkpoints == 3  # start + 10 + 2 periodic + final


def test_line_hash_recomputable_with_sha256_alone(sealed):
    for raw in sealed.read_bytes().splitlines():
        pos = hash_field_span(raw)
        assert hashlib.sha256(raw[:pos] + b"0" * 64 + raw[pos + 64 :]).hexdigest() == raw[pos : pos + 64].decode()


def test_edit_a_field(sealed, keys):
    ls = lines_of(sealed)
    ls[5] = ls[5].replace(b'"stringValue":"allow"', b'"stringValue":"deny"')
    sealed.write_bytes(b"".join(ls))
    rep = verify_file(sealed, keys)
    assert rep.error == "line 6 (seq 5): record edited (its content does not match its chain hash)"


def test_edit_and_rehash_is_caught_by_the_next_link(sealed, keys):
    ls = lines_of(sealed)
    ls[5] = rehash(set_attr(ls[5], "egressgate.decision", "deny"))
    sealed.write_bytes(b"".join(ls))
    rep = verify_file(sealed, keys)
    assert rep.error.startswith("line 7 (seq 6): chain.prev does not match")
    assert "seq 5 was edited" in rep.error


def test_rewrite_whole_chain_is_caught_by_signature(sealed, keys):
    """Attacker edits a record and recomputes every following prev/hash: the checkpoint signature fails."""
    ls = lines_of(sealed)
    ls[2] = set_attr(ls[2], "egressgate.decision", "deny")
    prev = None
    for i in range(len(ls)):
        if prev is not None:
            ls[i] = set_attr(ls[i], "egressgate.chain.prev", prev)
            doc = json.loads(ls[i])
            for kv in doc["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]["attributes"]:
                if kv["key"] == "egressgate.checkpoint.head":
                    kv["value"] = {"stringValue": prev}
            ls[i] = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"
        ls[i] = rehash(ls[i])
        prev = compute_line_hash(ls[i].rstrip(b"\n"))
    sealed.write_bytes(b"".join(ls))
    rep = verify_file(sealed, keys)
    assert rep.error == "line 5 (seq 4): bad signature on checkpoint (records 0..3 altered, or forged)"


def test_delete_a_line(sealed, keys):
    ls = lines_of(sealed)
    del ls[3]
    sealed.write_bytes(b"".join(ls))
    assert verify_file(sealed, keys).error == "line 4 (seq 4): records removed (seq 3..3 missing before this line)"


def test_swap_two_lines(sealed, keys):
    ls = lines_of(sealed)
    ls[2], ls[3] = ls[3], ls[2]
    sealed.write_bytes(b"".join(ls))
    assert verify_file(sealed, keys).error == "line 3 (seq 3): records reordered (expected seq 2 here)"


@pytest.mark.parametrize("keep", [13, 12, 10, 5, 1])
def test_truncate_tail(sealed, keys, keep):
    ls = lines_of(sealed)
    sealed.write_bytes(b"".join(ls[:keep]))
    rep = verify_file(sealed, keys)
    assert rep.error is not None and rep.error.startswith(f"truncated after seq {keep - 1}: no final checkpoint")
    assert verify_file(sealed, keys, allow_unsealed=True).ok  # the live file may be open


def test_truncate_mid_line(sealed, keys):
    data = sealed.read_bytes()
    sealed.write_bytes(data[:-40])
    assert "partial last line" in verify_file(sealed, keys).error


def test_truncate_to_nothing(sealed, keys):
    sealed.write_bytes(b"")
    assert "empty file" in verify_file(sealed, keys).error


def test_forged_signature(sealed, keys):
    ls = lines_of(sealed)
    other = LocalEd25519Signer.generate()
    forged = base64.b64encode(other._key.sign(b"anything")).decode()
    ls[-1] = rehash(set_attr(ls[-1], "egressgate.checkpoint.signature", forged))
    sealed.write_bytes(b"".join(ls))
    assert verify_file(sealed, keys).error.startswith("line 14 (seq 13): bad signature on checkpoint")


def test_checkpoint_by_untrusted_key(sealed, tmp_path):
    other = LocalEd25519Signer.load_or_create(tmp_path / "other.key")
    rep = verify_file(sealed, load_public_keys([tmp_path / "other.key.pub"]))
    assert "untrusted or unknown key" in rep.error and other.key_id not in rep.error


def test_append_after_seal(sealed, keys):
    ls = lines_of(sealed)
    sealed.write_bytes(b"".join(ls) + ls[3])
    assert (
        "records reordered" in verify_file(sealed, keys).error or "after the final" in verify_file(sealed, keys).error
    )


def test_cli_verify_exit_codes(sealed, pubkey, tmp_path, monkeypatch):
    # verify also trusts ./var/audit-signing.key.pub (`make run`'s var dir): a checkout where the gateway
    # once ran has one, so "no key beside the log" is only true from a directory without it
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(audit, ["verify", "--public-key", str(pubkey), str(sealed)])
    assert r.exit_code == 0 and r.output.startswith("OK ")
    ls = lines_of(sealed)
    del ls[4]
    sealed.write_bytes(b"".join(ls))
    r = CliRunner().invoke(audit, ["verify", "--public-key", str(pubkey), str(sealed)])
    assert r.exit_code == 1 and "records removed" in r.output and "line 5 (seq 5)" in r.output
    r = CliRunner().invoke(audit, ["verify", str(sealed)])  # no key beside the log, none given
    assert r.exit_code == 2 and "no trusted public key" in r.output


def test_find_by_request_hash(sealed):
    from egressgate.audit.find import find_records

    found = find_records([sealed], request_hash=f"sha256:{7:064x}")
    assert len(found) == 1 and found[0].record.attributes["egressgate.request.hash"] == f"sha256:{7:064x}"
    r = CliRunner().invoke(audit, ["find", str(sealed), "--request-hash", f"{7:064x}"])
    assert r.exit_code == 0 and len(r.output.splitlines()) == 1
    r = CliRunner().invoke(audit, ["find", str(sealed), "--request-hash", "sha256:" + "f" * 64])
    assert r.exit_code == 1


def test_verify_files_requires_links(sealed, keys, tmp_path):
    reps = verify_files([sealed], keys)
    assert reps[0].ok
