"""Valid audit chains, generated fast (a million records in seconds) for the index tests and the benchmark.

Why not through a sink or a gateway: 1,000,000 records through FileSink take minutes. Each line here is a
template made ONCE by the real encoder (ChainWriter + encode_record), with sentinel values replaced per
record; the chain hash is then computed exactly as chain.py defines it. `test_chaingen_matches_the_encoder`
checks the lines are byte-identical to ChainWriter's and that `audit verify`'s verify_file accepts them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from operator import itemgetter
from pathlib import Path

from egressgate.audit.chain import GENESIS, HASH_FIELD_PREFIX, ChainWriter
from egressgate.audit.encode import encode_record
from egressgate.audit.event import AuditEvent, EventKind
from egressgate.audit.record import (
    K_CHAIN_HASH,
    K_CHAIN_PREV,
    K_CHAIN_SEQ,
    K_OPERATION,
    SEVERITY_INFO,
    Record,
    record_from_event,
)

T0 = 1_795_000_000_000_000_000
_SEQ = 987654321987654
_TIME = 1_799_999_999_123_456_789
_PREV = "f" * 63 + "e"
_RID = "RID-SENTINEL-7f3a"
_RHASH = "sha256:" + "e" * 63 + "d"
_HPOS = len(HASH_FIELD_PREFIX)
PLANTED = "sha256:" + "0" * 64  # a label spelling a request hash on every realistic record: never found
HOSTS = ("api.openai.com", "pypi.org", "files.pythonhosted.org", "github.com", "evil.example")


def request_hash(i: int) -> str:
    """The request hash of generated record `i` (distinct per i, cheap to compute)."""
    return "sha256:%064x" % ((i * 0x9E3779B97F4A7C15F39CC0605CEDC835) % (1 << 256))


def request_id(i: int) -> str:
    return f"req-{i:09d}"


def event(i: int, deny: bool, host: str, realistic: bool = True) -> AuditEvent:
    """The decision event of record `i` (the template's content, with real values); `realistic=False`: the
    smallest decision record (id, hash, sandbox, host, decision, reason: ~0.9 kB instead of ~2.4 kB)."""
    if not realistic:
        return AuditEvent(kind=EventKind.HTTP_REQUEST, time_ns=T0 + i * 1_000_000, request_id=request_id(i),
                          sandbox_id=f"sbx-{HOSTS.index(host)}", decision="deny" if deny else "allow",
                          reason="no_rule_matched" if deny else "rule_matched", host=host,
                          request_hash=request_hash(i))
    return _event(i, deny, host)


def _event(i: int, deny: bool, host: str) -> AuditEvent:
    base: dict = dict(kind=EventKind.HTTP_REQUEST, time_ns=T0 + i * 1_000_000, request_id=request_id(i),
                      sandbox_id=f"sbx-{HOSTS.index(host)}", decision="deny" if deny else "allow",
                      reason="no_rule_matched" if deny else "rule_matched", rule_id=None if deny else "r1",
                      host=host, request_hash=request_hash(i))
    # what a gateway writes for a proxied HTTPS request (tests/support/audit_events.py), and a hostile label
    # spelling a top-level attribute (the index must never read it as the record's own request hash)
    base.update(sandbox_labels={"team": "finance", "egressgate.request.hash": PLANTED},
                policy_name="invoice-analysis", policy_hash="sha256:" + "ab" * 32,
                target_as_sent=f"https://{host}/v1/responses", scheme="https", port=443, method="POST",
                path="/v1/responses", pinned_address="198.18.0.10", bytes_out=120)
    return AuditEvent(**base)


def minimal_record(i: int) -> Record:
    """The cheapest valid decision record to write and index: the operation and the request hash (and the
    chain fields ChainWriter adds)."""
    return Record(T0 + i * 1_000_000, SEVERITY_INFO, "INFO", "egressgate.http_request", "",
                  {K_OPERATION: "http_request", "egressgate.request.hash": request_hash(i)})


def _template(deny: bool, host: str, realistic: bool | None) -> tuple[list[bytes], list[str]]:
    """The line of a record with sentinel values, cut around them: (literal pieces, names between them).
    realistic=None: minimal_record()."""
    if realistic is None:
        rec = minimal_record(0)
        rec.time_ns = _TIME
        rec.attributes["egressgate.request.hash"] = _RHASH
    else:
        ev = event(0, deny, host, realistic)
        ev.time_ns, ev.request_id, ev.request_hash = _TIME, _RID, _RHASH
        rec = record_from_event(ev)
    rec.attributes[K_CHAIN_SEQ] = _SEQ
    rec.attributes[K_CHAIN_PREV] = _PREV
    rec.attributes[K_CHAIN_HASH] = GENESIS
    line = encode_record(rec)
    sentinels = {str(_SEQ).encode(): "seq", str(_TIME).encode(): "time", _PREV.encode(): "prev",
                 _RID.encode(): "rid", _RHASH.encode(): "rhash"}
    pattern = re.compile(b"|".join(re.escape(s) for s in sentinels))
    pieces = pattern.split(line)
    names = [sentinels[m.group(0)] for m in pattern.finditer(line)]
    assert set(names) == set(sentinels.values()) - ({"rid"} if realistic is None else set()), names
    return pieces, names


def lines(n: int, *, start: int = 0, prev: str = GENESIS, realistic: bool | None = True, deny_every: int = 10
          ) -> Iterator[bytes]:
    """`n` chained lines (each with its newline), records start..start+n-1 of a chain whose seq is the record
    number: record 0 is a real chain_start, record i > 0 a decision (a deny when i % deny_every == 0, host
    HOSTS[i % len(HOSTS)]). To continue a chain, pass `start` and `prev` (the last line's chain.hash).
    realistic: True ~2.4 kB gateway records, False ~1.3 kB, None minimal_record() (~0.6 kB, fastest)."""
    if realistic is None:
        yield from _minimal_lines(n, start, prev)
        return
    templates = {(d, h): _template(d, h, realistic) for d in (False, True) for h in HOSTS}
    seq = start
    if start == 0:
        writer = ChainWriter(prev=prev)
        line = writer.append(ChainWriter.start_record(T0, "test-key", None))
        prev = writer.state.prev
        seq = 1
        yield line + b"\n"
    sha = hashlib.sha256
    for i in range(seq, start + n):
        pieces, names = templates[(i % deny_every == 0, HOSTS[i % len(HOSTS)])]
        values = {"seq": b"%d" % seq, "time": b"%d" % (T0 + i * 1_000_000), "prev": prev.encode(),
                  "rid": request_id(i).encode(), "rhash": request_hash(i).encode()}
        out = [pieces[0]]
        for name, piece in zip(names, pieces[1:], strict=True):
            out.append(values[name])
            out.append(piece)
        line = b"".join(out)
        pos = line.find(HASH_FIELD_PREFIX) + _HPOS
        digest = sha(line).hexdigest()  # the hash field holds the 64 "0" placeholder: this is chain.hash
        prev = digest
        seq += 1
        yield line[:pos] + digest.encode() + line[pos + 64 :] + b"\n"


def _minimal_lines(n: int, start: int, prev: str) -> Iterator[bytes]:
    """lines(realistic=None), the 1,000,000-record test's generator, so shaped for speed: everything up to and
    including the 64 "0" hash placeholder is the same on every line (the sentinels all come after it, keys
    sorted), so its SHA-256 state is computed once and copied; the rest is one bytes %-format."""
    pieces, names = _template(False, HOSTS[0], None)
    fmt = b"%s".join(piece.replace(b"%", b"%%") for piece in pieces)
    pick = itemgetter(*[("seq", "time", "prev", "rid", "rhash").index(name) for name in names])
    seq = start
    if start == 0:
        writer = ChainWriter(prev=prev)
        yield writer.append(ChainWriter.start_record(T0, "test-key", None)) + b"\n"
        prev = writer.state.prev
        seq = 1
    pos = fmt.find(HASH_FIELD_PREFIX) + _HPOS  # the hash field comes before every sentinel (sorted keys)
    assert pos + 64 <= fmt.find(b"%s") and fmt[pos : pos + 64] == b"0" * 64
    head = fmt[:pos] % ()  # constant: '%%' back to '%'
    tail = fmt[pos + 64 :] + b"\n"
    base = hashlib.sha256(head + b"0" * 64)
    prev_b = prev.encode()
    for i in range(seq, start + n):
        values = (b"%d" % i, b"%d" % (T0 + i * 1_000_000), prev_b, b"",
                  b"sha256:%064x" % ((i * 0x9E3779B97F4A7C15F39CC0605CEDC835) % (1 << 256)))  # request_hash(i)
        rest = tail % pick(values)
        h = base.copy()
        h.update(rest[:-1])  # the line without its newline: chain.hash is over the record's bytes
        prev_b = h.hexdigest().encode()
        yield head + prev_b + rest


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
