"""Response side of credential injection: what flows back from a credentialed request is scrubbed.

The `ResponseScrub` addon, after Budgets (credentials.py places the credential and records `Applied`
in `FlowState.credential`). Headers (incl. Location, Set-Cookie), the reason phrase and trailers are
scrubbed; a buffered body (known length <= 64 KiB) is decoded and scrubbed whole in `response`; a
streamed body gets a `ScrubPlan` that compose.py chains as `budget counter -> decode -> sliding window
scrubber`, and is reframed. "Decode" means every coding on the body — Content-Encoding *and* a
Transfer-Encoding other than chunked, which mitmproxy forwards undecoded (response_codings.py); a
coding we cannot decode, ambiguous framing or a folded header is refused (502, reason in the body and
in the outcome record as `egressgate.response_refused`) — never forwarded.
"""

from __future__ import annotations

import logging
import re

from mitmproxy import http

from egressgate.broker.redact import cached_scrubber
from egressgate.gateway.shared.compose import ScrubPlan
from egressgate.gateway.shared.context import FlowState, Runtime, flow_state
from egressgate.gateway.shared.credential_streams import as_chunks, fields, reframe, refusal_body, refuse, scrub_chain
from egressgate.gateway.shared.deny import REQUEST_ID_HEADER
from egressgate.gateway.shared.flowtypes import Applied
from egressgate.gateway.shared.response_codings import Uninspectable, body_codings, folded, folded_headers

logger = logging.getLogger(__name__)

STREAM_MAX_DECODED = 1 << 30  # decoded bytes per streamed response (decompression-bomb bound)
BUFFERED_MAX_DECODED = 16 << 20  # a buffered (<= 64 KiB on the wire) body may not inflate beyond this
# a repr'd literal in a mitmproxy error message: b'...', b"...", '...', "..." (upstream bytes it quotes)
_QUOTED = re.compile(r"b?'(?:[^'\\]|\\.)*'" r'|b?"(?:[^"\\]|\\.)*"')
_UNDECODABLE = ("The upstream's compressed response was corrupt or inflated beyond the gateway's limit, so it "
                "was refused; retry with uncompressed responses (Accept-Encoding: identity).")


class ResponseScrub:
    """Addon: the response side of credential injection. Its own addon (after Budgets in master.py) so
    the budget counts a buffered body as the upstream sent it, before the scrub rewrites it."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        applied = fs.credential if fs is not None else None
        resp = flow.response
        if applied is None or resp is None or fs is None or fs.decision is None or not fs.decision.allowed:
            return
        bodiless = flow.request.method.upper() == "HEAD" or resp.status_code in (101, 204, 304)
        if folded_headers(resp):  # before the scrub: it could not see a folded secret
            self._refuse(flow, fs, applied, folded(), bodiless)
            return
        scrubber = cached_scrubber(applied.spec())
        # one search over the raw header block first; rebuilt only when something must go
        if scrubber.contains_secret(b"\n".join(k + b"\n" + v for k, v in resp.headers.fields)):
            resp.headers = fields(scrubber.scrub_headers(list(resp.headers.items(multi=True))))
        if resp.reason and scrubber.contains_secret(resp.reason.encode("utf-8", "surrogateescape")):
            resp.reason = scrubber.scrub_text(resp.reason)  # a reflecting reason phrase
        if bodiless:
            return  # no body follows (a refusal body here would corrupt the connection)
        try:
            codings = body_codings(resp)  # Content-Encoding and Transfer-Encoding, in the order applied
        except Uninspectable as exc:
            self._refuse(flow, fs, applied, exc, bodiless)
            return
        if not fs.stream_response:
            return  # buffered: scrubbed whole in `response`
        client_id = flow.client_conn.id

        def on_error(exc: Exception) -> None:
            logger.warning("killed %s response from %s: %s", applied.capability, fs.host, type(exc).__name__)
            fs.response_refused = "undecodable_body"  # cut mid-stream: corrupt or a bomb
            if self.rt.abort_connection is not None:
                self.rt.abort_connection(client_id)

        fs.scrub = ScrubPlan(codings, scrubber, STREAM_MAX_DECODED, on_error)  # compose.py chains it
        reframe(flow)

    @staticmethod
    def _refuse(flow: http.HTTPFlow, fs: FlowState, applied: Applied, exc: Uninspectable, bodiless: bool) -> None:
        """502 with a reason the client reads and the outcome record keeps (record.py)."""
        logger.warning("refused %s response from %s: %s", applied.capability, fs.host, exc.reason)
        fs.replacement = refuse(flow, fs.request_id, exc.reason, exc.message, bodiless)
        fs.response_refused = exc.reason

    def error(self, flow: http.HTTPFlow) -> None:
        """mitmproxy quotes upstream bytes it could not parse — a malformed Transfer-Encoding,
        Content-Length, header name or line, status line, a cut head — in its 502 page (sent right
        after this hook, with no hook able to change it) and in `flow.error`, which record.py records
        next. On a credentialed flow those bytes may echo the credential (even compressed, inside a
        bytes repr). So when the message quotes anything or holds the secret: cut the client
        connection before the page goes out (the sandbox sees a reset, not a 502), and keep only a
        sanitized message for the audit record."""
        fs = flow_state(flow)
        applied = fs.credential if fs is not None else None
        if applied is None or fs is None or flow.error is None:
            return
        msg = flow.error.msg
        scrubber = cached_scrubber(applied.spec())
        if not (_QUOTED.search(msg) or scrubber.contains_secret(msg.encode("utf-8", "surrogateescape"))):
            return  # mitmproxy's own fixed wording ("server closed connection", ...): nothing quoted
        clean = scrubber.scrub_text(_QUOTED.sub("<upstream bytes>", msg))
        logger.warning("cut %s response from %s: the upstream's response was malformed (%s)",
                       applied.capability, fs.host, clean[:200])
        flow.error.msg = clean
        fs.response_refused = fs.response_refused or "malformed_response"
        cut = self.rt.abort_connection is not None and self.rt.abort_connection(flow.client_conn.id)
        if not cut and flow.killable:
            flow.kill()  # no connection to cut: at least mitmproxy's page after a parse error is suppressed

    def response(self, flow: http.HTTPFlow) -> None:
        fs = flow_state(flow)
        applied = fs.credential if fs is not None else None
        resp = flow.response
        if applied is None or resp is None or fs is None:
            return
        if resp.trailers:  # sent after this hook, for streamed responses too
            scrubber = cached_scrubber(applied.spec())
            resp.trailers = fields(scrubber.scrub_headers(list(resp.trailers.items(multi=True))))
        if fs.stream_response or fs.replacement is not None:
            return
        raw = resp.raw_content
        if not raw or flow.request.method.upper() == "HEAD":
            return
        scrubber = cached_scrubber(applied.spec())
        errors: list[Exception] = []
        try:
            codings = body_codings(resp)  # checked in responseheaders too; the headers may differ now
        except Uninspectable as exc:
            errors.append(exc)
            codings = []
        if not codings and not errors:  # the common case (we asked for identity): scrub in place, one pass
            if scrubber.contains_secret(raw):
                resp.content = scrubber.scrub(raw)  # also rewrites Content-Length
            return
        if not errors:
            run = scrub_chain(None, codings, scrubber, BUFFERED_MAX_DECODED, errors.append)
            out = b"".join(as_chunks(run(raw)) + as_chunks(run(b"")))
        if errors:
            why = errors[0] if isinstance(errors[0], Uninspectable) else Uninspectable("undecodable_body", _UNDECODABLE)
            logger.warning("refused %s response from %s: %s", applied.capability, fs.host, why.reason)
            fs.response_refused = why.reason
            flow.response = http.Response.make(
                502, refusal_body(fs.request_id, why.reason, why.message),
                {"Content-Type": "application/json", REQUEST_ID_HEADER: fs.request_id, "Cache-Control": "no-store"})
            return
        for name in ("content-encoding", "transfer-encoding"):
            if name in resp.headers:
                del resp.headers[name]
        resp.raw_content = out
        resp.headers["content-length"] = str(len(out))
