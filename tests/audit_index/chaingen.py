"""Valid audit chains, generated fast (a million records in seconds) for the index tests and the benchmark.

Why not through a sink or a gateway: 1,000,000 records through FileSink take minutes. Each line here is a
template made ONCE by the real encoder (ChainWriter + encode_record), with sentinel values replaced per
record; the chain hash is then computed exactly as chain.py defines it. `test_chaingen_matches_the_encoder`
checks the lines are byte-identical to ChainWriter's and that `audit verify`'s verify_file accepts them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from egressgate.audit.chain import GENESIS, HASH_FIELD_PREFIX, ChainWriter
from egressgate.audit.encode import encode_record
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.record import K_CHAIN_HASH, K_CHAIN_PREV, K_CHAIN_SEQ, record_from_event

T0 = 1_795_000_000_000_000_000
_SEQ = 987654321987654
_TIME = 1_799_999_999_123_456_789
_PREV = "f" * 63 + "e"
_RID = "RID-SENTINEL-7f3a"
_RHASH = "sha256:" + "e" * 63 + "d"
_HPOS = len(HASH_FIELD_PREFIX)
HOSTS = ("api.openai.com", "pypi.org", "files.pythonhosted.org", "github.com", "evil.example")


def request_hash(i: int) -> str:
    """The request hash of generated record `i` (distinct per i, cheap to compute)."""
    return "sha256:%064x" % ((i * 0x9E3779B97F4A7C15F39CC0605CEDC835) % (1 << 256))


def request_id(i: int) -> str:
    return f"req-{i:09d}"


def event(i: int, deny: bool, host: str, realistic: bool = True) -> AuditEvent:
    """The decision event of record `i` (the template's content, with real values)."""
    base: dict = dict(kind=EventKind.HTTP_REQUEST, time_ns=T0 + i * 1_000_000, request_id=request_id(i),
                      sandbox_id=f"sbx-{HOSTS.index(host)}", decision="deny" if deny else "allow",
                      reason="no_rule_matched" if deny else "rule_matched", rule_id=None if deny else "r1",
                      host=host, request_hash=request_hash(i))
    if realistic:  # what a gateway writes for a proxied HTTPS request (tests/support/audit_events.py)
        base.update(sandbox_labels={"team": "finance", "egressgate.request.hash": "sha256:" + "0" * 64},
                    policy_name="invoice-analysis", policy_hash="sha256:" + "ab" * 32,
                    target_as_sent=f"https://{host}/v1/responses", scheme="https", port=443, method="POST",
                    path="/v1/responses", pinned_address="198.18.0.10", bytes_out=120)
    return AuditEvent(**base)


def _template(deny: bool, host: str, realistic: bool) -> bytes:
    ev = event(0, deny, host, realistic)
    ev.time_ns, ev.request_id, ev.request_hash = _TIME, _RID, _RHASH
    rec = record_from_event(ev)
    rec.attributes[K_CHAIN_SEQ] = _SEQ
    rec.attributes[K_CHAIN_PREV] = _PREV
    rec.attributes[K_CHAIN_HASH] = GENESIS
    line = encode_record(rec).replace(b"%", b"%%")
    for sentinel, name in ((str(_SEQ), "seq"), (str(_TIME), "time"), (_PREV, "prev"), (_RID, "rid"),
                           (_RHASH, "rhash")):
        assert line.count(sentinel.encode()) >= 1, sentinel
        line = line.replace(sentinel.encode(), b"%(" + name.encode() + b")s")
    return line


def lines(n: int, *, start: int = 0, prev: str = GENESIS, realistic: bool = True, deny_every: int = 10,
          chain_start: bool = True) -> Iterator[bytes]:
    """`n` chained lines (each with its newline): a real chain_start record, then decision records
    1..n-1 (record i is a deny when i % deny_every == 0, host HOSTS[i % len(HOSTS)])."""
    templates = {(d, h): _template(d, h, realistic) for d in (False, True) for h in HOSTS}
    seq = 0
    if chain_start:
        writer = ChainWriter(prev=prev)
        line = writer.append(ChainWriter.start_record(T0, "test-key", None))
        prev = writer.state.prev
        seq = 1
        yield line + b"\n"
    sha = hashlib.sha256
    for i in range(start + seq, start + n):
        tpl = templates[(i % deny_every == 0, HOSTS[i % len(HOSTS)])]
        line = tpl % {b"seq": b"%d" % seq, b"time": b"%d" % (T0 + i * 1_000_000), b"prev": prev.encode(),
                      b"rid": request_id(i).encode(), b"rhash": request_hash(i).encode()}
        pos = line.find(HASH_FIELD_PREFIX) + _HPOS
        digest = sha(line).hexdigest()  # the hash field holds the 64 "0" placeholder: this is chain.hash
        prev = digest
        seq += 1
        yield line[:pos] + digest.encode() + line[pos + 64 :] + b"\n"


def write_chain(path: Path, n: int, **kw) -> Path:
    """Write `n` chained records to `path` (in 4 MiB writes)."""
    buf: list[bytes] = []
    size = 0
    with open(path, "wb") as fh:
        for line in lines(n, **kw):
            buf.append(line)
            size += len(line)
            if size >= 4 << 20:
                fh.write(b"".join(buf))
                buf, size = [], 0
        fh.write(b"".join(buf))
    return path
