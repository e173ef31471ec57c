"""`/ui/api/{stats,search,replay-diff,learn}`: the console's views of the audit trail.

The JSONL files stay the record of truth. Search and stats read the SQLite index (audit/index, derived
and checked against the hash chain): every hit's record is read back from the JSONL at its offset and
re-checked (`AuditIndex.record`), so a record edited after indexing is reported as not verified, never
shown as if it were. Replay-diff and learn (audit.replay / policy.learn, pure) are fed only records the
index verified (chain link checked) and whose bytes still match (re-read and re-checked one by one): a
record edited or inserted in a file can never make the learner propose a rule or hide a flip; the answer
counts what was left out (`unverified`). They read at most MAX_REPLAY_RECORDS, the newest.

Cost for the gateway: nothing until the console is used. The index follower (a thread, IndexFollower)
starts at the first login or audit query of this process, not at gateway start, so a gateway whose
console is never opened never reads its trail back. SQLite queries and file reads run in threads, never on
the event loop, and at most one replay/learn runs at a time per process (503 `busy` otherwise).

Which files: the gateway's audit file and its rotated files, and with `run --workers N` every worker's
chain (`audit.wN.jsonl`, `audit.wN.<stamp>.jsonl`); never the retry spool. The index lives next to them
as `<audit file>.index.sqlite`, the name `audit find` looks for; several workers share it (one writer at
a time, audit/index).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from egressgate.admin.errors import error_response
from egressgate.admin.jsonbody import BodyError
from egressgate.admin.ui.api import bad, body_with, labels_of
from egressgate.audit.filewatch import chain_name
from egressgate.audit.find import Found
from egressgate.audit.index import AuditIndex, IndexFollower, IndexStale
from egressgate.audit.record import RecordFormatError, parse_line
from egressgate.audit.replay import replay_diff
from egressgate.policy.errors import PolicyError
from egressgate.policy.learn import LearnError, Selector, learn
from egressgate.policy.loader import parse_policy

if TYPE_CHECKING:
    from egressgate.admin.ui import Console

logger = logging.getLogger(__name__)

SEARCH_KEYS = ("request_id", "request_hash", "sandbox", "host", "reason", "since", "until", "limit", "before")
MAX_LIMIT = 1000
MAX_BUCKETS = 2000
MAX_FLIPS = 10_000
MAX_REPLAY_RECORDS = 200_000
CATCH_UP_S = 2.0
RETRY_S = 30.0
_STAMP = r"\d{8}T\d{6}_\d{6}Z(?:-\d+)?"


def trail_files(audit_file: Path) -> list[Path]:
    """Every chain of this gateway's trail, each in chain order (rotated files by time, the live file
    last); a worker's `audit.wN.jsonl` names the same trail as `audit.jsonl`."""
    stem = re.sub(r"\.w\d+$", "", audit_file.stem)
    pattern = re.compile(rf"{re.escape(stem)}(?:\.w\d+)?(?:\.{_STAMP})?{re.escape(audit_file.suffix)}")
    try:
        names = [p for p in audit_file.parent.iterdir() if pattern.fullmatch(p.name) and p.is_file()]
    except OSError:
        return []

    def order(p: Path) -> tuple[str, bool, str, int]:  # as audit/filewatch.py names them: stamp, then -n
        stamp = re.search(rf"\.(\d{{8}}T\d{{6}}_\d{{6}}Z)(?:-(\d+))?{re.escape(p.suffix)}$", p.name)
        if stamp is None:
            return (chain_name(p), True, "", 0)
        return (chain_name(p), False, stamp.group(1), int(stamp.group(2) or 0))

    return sorted(names, key=order)


def index_path(audit_file: Path) -> Path:
    stem = re.sub(r"\.w\d+$", "", audit_file.stem)
    return audit_file.with_name(f"{stem}{audit_file.suffix}.index.sqlite")


class Verified:
    """The verified records of the trail (optionally of one sandbox), oldest first, as `Found` with their
    real file and line; `unverified` counts what was left out, `truncated` says the window was full."""

    def __init__(self, index: AuditIndex, files: list[Path], sandbox: str | None = None) -> None:
        self.unverified = 0
        self.truncated = False
        self.records: list[Found] = []
        rank = {os.path.abspath(p): i for i, p in enumerate(files)}  # as the index names files
        hits, before = [], None
        while len(hits) < MAX_REPLAY_RECORDS:  # newest first, page by page
            page = index.find(sandbox=sandbox, files=list(rank), limit=MAX_REPLAY_RECORDS - len(hits),
                              before_rowid=before)
            if not page:
                break
            hits.extend(page)
            before = page[-1].rowid
        self.truncated = len(hits) >= MAX_REPLAY_RECORDS
        hits.sort(key=lambda h: (rank.get(h.file, len(rank)), h.line))
        for hit in hits:
            if not hit.verified:
                self.unverified += 1
                continue
            try:
                raw = index.record_line(hit)  # the bytes again, re-checked against the indexed hash
                self.records.append(Found(hit.file, hit.line, raw, parse_line(raw)))
            except (IndexStale, RecordFormatError):
                self.unverified += 1

    def summary(self) -> dict[str, Any]:
        return {"records": len(self.records), "unverified": self.unverified, "truncated_records": self.truncated}


def _seconds(raw: str | None, name: str) -> int | None:
    """Unix seconds (a number) → ns; None when absent."""
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BodyError(400, "invalid_request", f"{name}: unix seconds") from None
    if not 0 <= value < 2**33:
        raise BodyError(400, "invalid_request", f"{name}: unix seconds")
    return int(value * 1e9)


def _int(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise BodyError(400, "invalid_request", f"{name}: an integer {low}..{high}")
    return int(raw)


class AuditApi:
    def __init__(self, console: Console) -> None:
        self.console = console
        rt = console.server.rt
        self.audit_file: Path | None = rt.config.audit_path()
        self.index: AuditIndex | None = None
        self.follower: IndexFollower | None = None
        self._busy = asyncio.Lock()
        self._retry_at = 0.0  # after a failure to open the index: not before (one log line, not one per query)

    # --- the index, started on first use ------------------------------------------------------------
    def files(self) -> list[Path]:
        return trail_files(self.audit_file) if self.audit_file is not None else []

    def start_index(self) -> IndexFollower | None:
        """The follower of this process, started now if it was not (a failure: None, said in the log)."""
        now = time.monotonic()
        if self.follower is None and self.audit_file is not None and now >= self._retry_at:
            try:
                self.index = AuditIndex(index_path(self.audit_file))
                self.follower = IndexFollower(self.index, self.files).start()
            except Exception:
                logger.exception("console: the audit index cannot be opened (next try in %.0f s)", RETRY_S)
                self.index, self._retry_at = None, now + RETRY_S
        return self.follower

    async def stop(self, _app: web.Application) -> None:
        if self.follower is not None:
            follower, self.follower = self.follower, None
            await asyncio.to_thread(follower.stop)

    async def _ready_index(self) -> AuditIndex | web.Response:
        follower = self.start_index()
        if follower is None or self.index is None:
            return error_response(503, "index_unavailable", "the audit index is not available (no local audit "
                                  "file, or it cannot be opened: see the gateway log)")
        live = self.console.live
        if live.written:  # records written before this request are searchable (no wait when none were)
            live.written = False
            await follower.caught_up(CATCH_UP_S)
        return self.index

    # --- routes -----------------------------------------------------------------------------------
    async def stats(self, request: web.Request) -> web.Response:
        """Denies by reason per bucket and the top denied hosts over [since, until) (unix seconds)."""
        try:
            if set(request.query) - {"since", "until", "bucket"}:
                raise BodyError(400, "invalid_request", "query parameters: since, until, bucket")
            until = _seconds(request.query.get("until"), "until") or time.time_ns()
            since = _seconds(request.query.get("since"), "since")
            since = until - 3600 * 10**9 if since is None else since
            bucket = _int(request.query.get("bucket"), "bucket", 60, 1, 7 * 86400)
            if since >= until or (until - since) // (bucket * 10**9) > MAX_BUCKETS:
                raise BodyError(400, "invalid_request", f"since < until, at most {MAX_BUCKETS} buckets")
        except BodyError as exc:
            return exc.response()
        index = await self._ready_index()
        if isinstance(index, web.Response):
            return index
        stats = await asyncio.to_thread(index.stats, since_ns=since, until_ns=until, bucket_s=bucket)
        return web.json_response({"since_ns": stats.since_ns, "until_ns": stats.until_ns, "bucket_s": stats.bucket_s,
                                  "buckets": stats.buckets, "top_denied_hosts": stats.top_denied_hosts})

    async def search(self, request: web.Request) -> web.Response:
        """Records by request id/hash, sandbox, host, reason, time; each read back from the JSONL and
        re-checked. Paging: `before` = the previous page's `next_before`."""
        q = request.query
        try:
            if set(q) - set(SEARCH_KEYS) or any(len(q.getall(k)) > 1 or len(q[k]) > 512 for k in q):
                raise BodyError(400, "invalid_request", f"query parameters (each once): {', '.join(SEARCH_KEYS)}")
            filters = {k: q[k] for k in ("request_id", "request_hash", "sandbox", "host", "reason") if q.get(k)}
            since, until = _seconds(q.get("since"), "since"), _seconds(q.get("until"), "until")
            limit = _int(q.get("limit"), "limit", 100, 1, MAX_LIMIT)
            before = _int(q.get("before"), "before", 0, 1, 2**62) or None
        except BodyError as exc:
            return exc.response()
        index = await self._ready_index()
        if isinstance(index, web.Response):
            return index

        def run() -> list[dict[str, Any]]:
            out = []
            for hit in index.find(**filters, since_ns=since, until_ns=until, limit=limit, before_rowid=before):
                item = {"file": hit.file, "line": hit.line, "chain_index": hit.chain_index, "verified": hit.verified,
                        "time_ns": hit.time_ns, "kind": hit.kind, "record_hash": hit.record_hash, "rowid": hit.rowid,
                        "record": None, "problem": None}
                try:
                    item["record"] = index.record(hit)
                except IndexStale as exc:  # the bytes changed since indexing: never shown as verified
                    item["verified"], item["problem"] = False, str(exc)
                out.append(item)
            return out

        try:
            hits = await asyncio.to_thread(run)
        except ValueError as exc:  # a malformed request hash, say
            return bad(str(exc))
        return web.json_response({"hits": hits, "next_before": hits[-1]["rowid"] if len(hits) == limit else None})

    async def replay_diff(self, request: web.Request) -> web.Response:
        """The recorded decisions a candidate policy would flip (audit.replay.replay_diff over the trail)."""
        try:
            body = await body_with(request, {"policy_yaml", "sandbox", "since", "limit"})
            text, sandbox = body.get("policy_yaml"), body.get("sandbox")
            if not isinstance(text, str) or not text.strip():
                raise BodyError(400, "invalid_request", "policy_yaml: the candidate policy's text")
            if sandbox is not None and not isinstance(sandbox, str):
                raise BodyError(400, "invalid_request", "sandbox: a sandbox id")
            since = body.get("since")
            if since is not None and (type(since) not in (int, float) or not 0 <= since < 2**33):
                raise BodyError(400, "invalid_request", "since: unix seconds")
            limit = body.get("limit", 1000)
            if type(limit) is not int or not 1 <= limit <= MAX_FLIPS:
                raise BodyError(400, "invalid_request", f"limit: an integer 1..{MAX_FLIPS}")
        except BodyError as exc:
            return exc.response()
        try:
            candidate = parse_policy(text, "<console>")
        except PolicyError as exc:
            return error_response(422, "invalid_policy", str(exc))
        since_ns = int(since * 1e9) if since is not None else None
        index = await self._ready_index()
        if isinstance(index, web.Response):
            return index
        files = self.files()

        def run() -> dict[str, Any]:
            verified = Verified(index, files, sandbox or None)
            flips = replay_diff(verified.records, candidate, sandbox=sandbox or None, since_ns=since_ns, limit=limit)
            return {"flips": [f.to_json() for f in flips], "truncated": len(flips) >= limit, **verified.summary()}

        result = await self._exclusive(run)
        if isinstance(result, web.Response):
            return result
        return web.json_response({**result, "policy": candidate.name, "policy_hash": candidate.hash})

    async def learn(self, request: web.Request) -> web.StreamResponse:
        """`policy learn` over the trail for one sandbox or a label selector: a YAML attachment."""
        try:
            body = await body_with(request, {"sandbox", "labels"})
            sandbox, labels = body.get("sandbox"), labels_of(body.get("labels"))
            if sandbox is not None and (not isinstance(sandbox, str) or not sandbox):
                raise BodyError(400, "invalid_request", "sandbox: a sandbox id")
            selector = Selector(sandbox=sandbox, labels=labels)
        except BodyError as exc:
            return exc.response()
        except LearnError as exc:
            return bad(str(exc))
        index = await self._ready_index()
        if isinstance(index, web.Response):
            return index
        files = self.files()
        # every sandbox's verified records: labels resolve to sandboxes, and any record showing a name
        # resolved to a private address keeps that name out (policy/learn.py)
        result = await self._exclusive(lambda: learn(Verified(index, files).records, selector))
        if isinstance(result, web.Response):
            return result
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", sandbox or "-".join(f"{k}-{v}" for k, v in labels.items()))[:60]
        return web.Response(text=result.policy_yaml, headers={
            "Content-Type": "application/yaml; charset=utf-8",
            "Content-Disposition": f'attachment; filename="learned-{name or "policy"}.yaml"'})

    async def _exclusive(self, fn) -> Any:
        """Run `fn` in a thread, one at a time per process (these read the whole trail)."""
        if self._busy.locked():
            return error_response(503, "busy", "another replay or learn is running on this gateway; retry shortly")
        async with self._busy:
            try:
                return await asyncio.to_thread(fn)
            except (LearnError, PolicyError) as exc:
                return error_response(422, "invalid_request", str(exc))
            except OSError as exc:
                return error_response(503, "audit_unreadable", f"the audit files cannot be read: {exc.strerror}")


def audit_routes(console: Console, guard) -> tuple[AuditApi, list[web.AbstractRouteDef]]:
    api = AuditApi(console)
    return api, [
        web.get("/ui/api/stats", guard(api.stats), allow_head=False),
        web.get("/ui/api/search", guard(api.search), allow_head=False),
        web.post("/ui/api/replay-diff", guard(api.replay_diff, mutating=True)),
        web.post("/ui/api/learn", guard(api.learn, mutating=True)),
    ]
