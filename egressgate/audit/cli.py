"""`egressgate audit verify|hash|find|index|replay`: auditor tools (exit 0 clean, 1 finding, 2 usage)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from egressgate.audit.filewatch import chain_name
from egressgate.audit.find import default_index_path, find_indexed, find_records
from egressgate.audit.reqhash import RequestHashError, canonical_fields, canonical_request, request_hash
from egressgate.audit.signer import SigningKeyError, load_public_keys
from egressgate.audit.verify import verify_files

DEFAULT_PUBLIC_KEY = "audit-signing.key.pub"


@click.group()
def audit() -> None:
    """Verify, search and replay the audit trail."""


def _trusted_keys(files: tuple[str, ...], given: tuple[str, ...]) -> dict:
    paths = list(given)
    if not paths:
        candidates = {Path(f).resolve().parent / DEFAULT_PUBLIC_KEY for f in files}
        candidates.add(Path("var") / DEFAULT_PUBLIC_KEY)
        paths = [str(c) for c in sorted(candidates) if c.is_file()]
        for p in paths:
            click.echo(
                f"warning: trusting {p} found beside the log; pass --public-key from a trusted copy", err=True
            )
    if not paths:
        raise click.UsageError("no trusted public key: pass --public-key (the signing key's .pub file)")
    try:
        return load_public_keys(paths)
    except (OSError, ValueError, SigningKeyError) as exc:
        raise click.UsageError(f"cannot load public key: {exc}") from exc


@audit.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--public-key",
    "public_keys",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Trusted Ed25519 public key (PEM, or the private key file). Repeatable.",
)
@click.option(
    "--allow-unsealed",
    is_flag=True,
    help="Accept a missing final checkpoint on the last file (the live file) of each chain.",
)
@click.option(
    "--per-worker",
    is_flag=True,
    help="FILES hold several chains (one per worker of `run --workers N`: audit.w0.jsonl, audit.w1.jsonl and "
         "their rotated files): verify each chain on its own, rotated files oldest first, the live file last.",
)
def verify(files: tuple[str, ...], public_keys: tuple[str, ...], allow_unsealed: bool, per_worker: bool) -> None:
    """Check the hash chain and checkpoint signatures of FILES (in chain order, oldest first)."""
    keys = _trusted_keys(files, public_keys)
    chains = _chains(files)
    if not per_worker and len(chains) > 1 and all(_WORKER.search(name) for name in chains):
        click.echo(f"warning: FILES belong to {len(chains)} worker chains ({', '.join(chains)}): "
                   "pass --per-worker to verify each on its own", err=True)
    groups = chains.values() if per_worker else [list(files)]
    failed = False
    for group in groups:
        failed |= _verify_chain(group, keys, allow_unsealed)
    sys.exit(1 if failed else 0)


_WORKER = re.compile(r"\.w\d+\.[^.]*$")  # gateway/service/workers.py: audit.jsonl -> audit.w<slot>.jsonl


def _chains(files: tuple[str, ...]) -> dict[str, list[str]]:
    """FILES by chain (the live file name they belong to), each in chain order: rotated files by their
    time stamp, then the live file."""
    chains: dict[str, list[str]] = {}
    for f in files:
        chains.setdefault(str(Path(f).parent / chain_name(Path(f))), []).append(f)
    for members in chains.values():
        members.sort(key=lambda f: (Path(f).name == chain_name(Path(f)), Path(f).name))
    return chains


def _verify_chain(files: list[str], keys: dict, allow_unsealed: bool) -> bool:
    """Verify one chain and print a line per file; True when it failed."""
    reports = verify_files(files, keys, allow_unsealed=allow_unsealed)
    failed = False
    for rep in reports:
        for w in rep.warnings:
            click.echo(f"warning: {rep.path}: {w}", err=True)
        if rep.ok:
            state = "sealed" if rep.sealed else "open"
            click.echo(f"OK   {rep.path}: {rep.records} records, {rep.checkpoints} checkpoints, {state}")
        else:
            failed = True
            click.echo(f"FAIL {rep.path}: {rep.error}")
    if len(reports) < len(files):
        click.echo(f"not checked after the failure: {', '.join(files[len(reports) :])}")
    return failed


@audit.command("hash")
@click.argument("request", nargs=-1, required=True)
@click.option("--header", "headers", multiple=True, help="K:V header as sent (only Content-Type counts).")
@click.option("--body-file", type=click.Path(exists=True, dir_okay=False), help="Request body as sent.")
@click.option("--canonical", is_flag=True, help="Also print the canonical form that is hashed.")
def hash_cmd(
    request: tuple[str, ...], headers: tuple[str, ...], body_file: str | None, canonical: bool
) -> None:
    """Print the canonical request hash of 'METHOD URL' (docs/audit.md, "Request hash")."""
    method, _, url = " ".join(request).strip().partition(" ")
    if not url:
        raise click.UsageError("expected 'METHOD URL', e.g. 'GET https://api.example.com/v1/x?y=1'")
    pairs = []
    for h in headers:
        name, sep, value = h.partition(":")
        if not sep:
            raise click.UsageError(f"--header must be K:V, got {h!r}")
        pairs.append((name, value))
    body = Path(body_file).read_bytes() if body_file else b""
    try:
        fields = canonical_fields(method, url.strip(), pairs, body)
    except RequestHashError as exc:
        raise click.UsageError(str(exc)) from exc
    if canonical:
        click.echo(canonical_request(*fields).decode("utf-8", "backslashreplace"), nl=False)
    click.echo(request_hash(*fields))


@audit.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--request-hash", help="sha256:<hex> (from `audit hash` or a record).")
@click.option("--request-id", help="egressgate.request.id of a decision.")
@click.option("--index", "index_db", type=click.Path(dir_okay=False),
              help="SQLite index (`audit index`) to search; default: <first file>.index.sqlite when it exists. "
                   "It is updated with FILES first, and every line printed is re-read from FILES.")
def find(files: tuple[str, ...], request_hash: str | None, request_id: str | None, index_db: str | None) -> None:
    """Print the records (raw lines) of one request: its decision and its outcome."""
    if not request_hash and not request_id:
        raise click.UsageError("give --request-hash or --request-id")
    found = None
    db = Path(index_db) if index_db else default_index_path(files[0])
    if index_db or db.is_file():
        found = _find_indexed(db, files, request_hash, request_id)
    if found is None:
        found = find_records(list(files), request_hash=request_hash, request_id=request_id)
    for f in found:
        click.echo(f.raw.decode("ascii", "backslashreplace"))
    if not found:
        click.echo("no matching record", err=True)
    sys.exit(0 if found else 1)


def _find_indexed(db: Path, files: tuple[str, ...], request_hash: str | None, request_id: str | None) -> list | None:
    """find through the index; None (after a warning) when the index cannot be used: the scan answers."""
    import sqlite3

    from egressgate.audit.index import IndexStale

    try:
        found, warnings = find_indexed(db, list(files), request_hash=request_hash, request_id=request_id)
    except (IndexStale, sqlite3.Error, OSError) as exc:
        click.echo(f"warning: index {db} not used ({exc}); scanning the files", err=True)
        return None
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    return found


@audit.command("index")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--db", type=click.Path(dir_okay=False),
              help="Index database (default: <first file>.index.sqlite, named after the trail's live file: "
                   "audit.jsonl.index.sqlite for audit.jsonl, its rotated files and audit.w<N>.jsonl).")
@click.option("--verify", "reverify", is_flag=True,
              help="Also re-read every indexed line and re-index files whose bytes changed.")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Processes that parse and hash a large backlog (a first build) in parallel.")
def index_cmd(files: tuple[str, ...], db: str | None, reverify: bool, workers: int) -> None:
    """Build or update the SQLite index of FILES (only new lines are read); exit 1 when a hash chain breaks."""
    from egressgate.audit.index import AuditIndex, IndexBusy

    path = Path(db) if db else default_index_path(files[0])
    try:
        with AuditIndex(path, workers=workers) as index:
            stats = index.add_files(list(files))
            report = index.verify() if reverify else None
    except IndexBusy as exc:
        raise click.UsageError(str(exc)) from exc
    for line in stats.renamed:
        click.echo(f"renamed: {line} (rotated; rows kept)", err=True)
    for line in stats.rebuilt:
        click.echo(f"warning: re-indexed {line}", err=True)
    for line in stats.broken:
        click.echo(f"FAIL chain broken: {line}")
    rate = stats.added / stats.seconds if stats.seconds else 0.0
    click.echo(f"{path}: {stats.added} new records from {stats.files} files in {stats.seconds:.2f}s "
               f"({rate:,.0f} records/s)" + (f"; {stats.partial_bytes} bytes of a partial last line left for "
                                              "next time" if stats.partial_bytes else ""))
    failed = bool(stats.broken)
    if report is not None:
        for check in report.files:
            if check.rebuilt:
                click.echo(f"warning: re-indexed {check.path}: {check.rebuilt}", err=True)
            if check.broken:
                failed = True
                click.echo(f"FAIL {check.path}: {check.broken}")
            elif not check.missing:
                click.echo(f"OK   {check.path}: {check.records} records, {check.verified} verified")
        for link in report.links:
            failed = True
            click.echo(f"FAIL {link}")
    sys.exit(1 if failed else 0)


@audit.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--policy",
    "policy_path",
    required=True,
    type=click.Path(exists=True),
    help="Policy file (applies to every record) or directory (matched by sandbox.name).",
)
def replay(files: tuple[str, ...], policy_path: str) -> None:
    """Re-decide recorded requests, CONNECTs, DNS queries and MCP tool calls under POLICY; list decisions that
    change."""
    from egressgate.audit.replay import format_table
    from egressgate.audit.replay import replay as run_replay
    from egressgate.policy.errors import PolicyError

    try:
        result = run_replay(list(files), policy_path)
    except PolicyError as exc:
        raise click.UsageError(f"policy does not load:\n{exc}") from exc
    click.echo(format_table(result))
    sys.exit(1 if result.changes else 0)
