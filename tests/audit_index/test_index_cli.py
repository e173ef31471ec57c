"""`egressgate audit index` and `audit find` with the index: same answers as the scan, the index found next to
the files, lines always re-read from the JSONL, a stale or broken index falls back to the scan."""

from __future__ import annotations

from click.testing import CliRunner

from egressgate.admin.ui.audit_api import index_path
from egressgate.audit.cli import audit
from egressgate.audit.event import EventKind
from egressgate.audit.find import default_index_path
from tests.support.audit_events import http_event
from tests.support.cli import cli

RH = "sha256:" + "a7" * 32


async def _trail(make_sink):
    sink = await make_sink(max_bytes=5000)
    for i in range(10):
        await sink.write(http_event(i, request_id=f"r{i}", request_hash=RH if i == 7 else None))
    await sink.write(http_event(11, request_id="cred", kind=EventKind.CREDENTIAL_ISSUE, capability="openai",
                                extra={"egressgate.trigger_request": "r7"}))
    await sink.write(http_event(12, request_id="r7", kind=EventKind.OUTCOME, status=200))
    await sink.close()
    files = sorted(p for p in sink.path.parent.iterdir() if p.name.endswith(".jsonl") and p != sink.path)
    return [*files, sink.path]


def _run(*args):
    return CliRunner().invoke(audit, [str(a) for a in args])


async def test_index_then_find_uses_it_and_agrees_with_the_scan(make_sink):
    files = await _trail(make_sink)
    assert len(files) >= 2  # rotated: the records of r7 span files
    db = default_index_path(files[0])
    assert db == files[-1].with_name("audit.jsonl.index.sqlite")  # named after the chain, not the stamp
    # worker chains share it, and it is the index the console keeps (so `audit find` finds the console's)
    for name in ("audit.w1.jsonl", "audit.w12.20261129T140102_123456Z-2.jsonl", "audit.20261129T140102_123456Z.jsonl"):
        assert default_index_path(files[-1].with_name(name)) == db
    for live in ("audit.jsonl", "audit.w3.jsonl"):  # the console is given the configured (live) file
        assert index_path(files[-1].with_name(live)) == db
    scan = _run("find", *files, "--request-hash", RH)
    assert scan.exit_code == 0 and len(scan.output.splitlines()) == 3  # decision, credential, outcome
    built = _run("index", *files)
    assert built.exit_code == 0, built.output
    assert f"{db}: " in built.output and " new records from " in built.output
    indexed = CliRunner().invoke(audit, ["find", *map(str, files), "--request-hash", RH])
    assert indexed.exit_code == 0 and indexed.stdout == scan.stdout
    assert "warning" not in indexed.stderr  # it used the index (below: a broken index is reported, then scanned)
    assert _run("find", *files, "--request-id", "r7").output == scan.output
    missing = _run("find", *files, "--request-hash", "sha256:" + "00" * 32)
    assert missing.exit_code == 1 and "no matching record" in missing.output
    # a second `audit index` reads nothing new
    again = _run("index", *files)
    assert again.exit_code == 0 and ": 0 new records from" in again.output


async def test_find_never_prints_bytes_the_index_did_not_recheck(make_sink):
    files = await _trail(make_sink)
    assert _run("index", *files).exit_code == 0
    target = next(f for f in files if RH.encode() in f.read_bytes())
    target.write_bytes(target.read_bytes().replace(b'"allow"', b'"ALLOW"'))  # same length: index can't tell
    r = CliRunner().invoke(audit, ["find", *map(str, files), "--request-hash", RH])
    assert r.exit_code == 0
    decision = next(line for line in r.stdout.splitlines() if RH in line)
    assert '"ALLOW"' in decision  # what the file says now, never what was indexed
    assert "not used" in r.stderr and "changed since it was indexed" in r.stderr


async def test_a_stale_mark_outlives_the_find_that_found_it(make_sink):
    """`audit find` refused a row whose line changed in place (same length: none of the cheap checks see
    it); the next `audit index` — another process — must re-index that file and report the break, not say
    "0 new records" (issue 23, item 2). Control: without the edit, the second run reads nothing."""
    files = await _trail(make_sink)
    assert _run("index", *files).exit_code == 0
    clean = _run("index", *files)
    assert clean.exit_code == 0 and ": 0 new records from" in clean.output and "re-indexed" not in clean.output
    target = next(f for f in files if RH.encode() in f.read_bytes())
    target.write_bytes(target.read_bytes().replace(b'"allow"', b'"ALLOW"'))
    quiet = _run("index", *files)  # control: the same-length edit alone is invisible to `audit index`
    assert quiet.exit_code == 0 and ": 0 new records from" in quiet.output, quiet.output
    found = CliRunner().invoke(audit, ["find", *map(str, files), "--request-hash", RH])
    assert "changed since it was indexed" in found.stderr
    r = CliRunner().invoke(audit, ["index", *map(str, files)])
    assert f"warning: re-indexed {target}: a record read back did not match the indexed bytes" in r.stderr, r.output
    assert r.exit_code == 1 and f"FAIL chain broken: {target}: line " in r.stdout  # the edit is now reported
    assert ": 0 new records from" not in r.stdout
    after = _run("index", *files)  # re-indexed once: the mark is gone
    assert ": 0 new records from" in after.output and "re-indexed" not in after.output
    found = CliRunner().invoke(audit, ["find", *map(str, files), "--request-hash", RH])
    assert found.exit_code == 0 and "not used" not in found.stderr  # the index serves the file as it is now


async def test_broken_index_file_falls_back_to_the_scan(make_sink):
    files = await _trail(make_sink)
    db = default_index_path(files[0])
    db.write_bytes(b"this is not a database" * 100)
    r = CliRunner().invoke(audit, ["find", *map(str, files), "--request-hash", RH])
    assert r.exit_code == 0 and len(r.stdout.splitlines()) == 3
    assert f"index {db} not used" in r.stderr


async def test_index_reports_a_broken_chain_and_verify_option(make_sink, tmp_path):
    files = await _trail(make_sink)
    data = files[0].read_bytes().split(b"\n")
    data[2] = data[2].replace(b"api.openai.com", b"api.openai.org", 1)  # edited, not re-hashed
    files[0].write_bytes(b"\n".join(data))
    db = tmp_path / "elsewhere" / "i.sqlite"
    r = _run("index", "--db", db, *files)
    assert r.exit_code == 1
    assert f"FAIL chain broken: {files[0]}: line 3 (seq 2): record edited" in r.output
    v = _run("index", "--db", db, "--verify", *files)
    assert v.exit_code == 1 and f"FAIL {files[0]}: line 3 (seq 2)" in v.output
    assert f"OK   {files[-1]}" in v.output


async def test_the_console_script(make_sink):
    """The real entry point, as an operator runs it."""
    files = await _trail(make_sink)
    built = cli("audit", "index", *map(str, files))
    assert built.returncode == 0, built.stderr
    found = cli("audit", "find", *map(str, files), "--request-hash", RH, "--index", str(default_index_path(files[0])))
    assert found.returncode == 0, found.stderr
    out = found.stdout.splitlines()
    assert len(out) == 3 and all('"r7"' in line for line in out)


def test_parallel_build_through_the_console_script(tmp_path):
    """`--workers 2` on a backlog past PARALLEL_MIN_BYTES parses in worker processes started from the real
    entry point (`python -m egressgate`); they must work there (no fallback warning) and give the same index."""
    from egressgate.audit.index.store import PARALLEL_MIN_BYTES
    from tests.audit_index.chaingen import request_hash, write_chain

    path = write_chain(tmp_path / "audit.jsonl", 8000)
    assert path.stat().st_size > PARALLEL_MIN_BYTES  # control: big enough to use the workers
    built = cli("audit", "index", "--workers", "2", str(path))
    assert built.returncode == 0, built.stderr
    assert ": 8000 new records from 1 files" in built.stdout
    assert "worker processes failed" not in built.stderr and "Traceback" not in built.stderr, built.stderr
    found = cli("audit", "find", str(path), "--request-hash", request_hash(4321))
    assert found.returncode == 0 and "req-000004321" in found.stdout and found.stderr == ""
