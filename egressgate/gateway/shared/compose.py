"""The one place a body's stream is set: the callable mitmproxy feeds each body chunk to is built here, in
one stated order, and installed here (`install_request` / `install_response`), and so is the "no
callable" answer (`buffer_body`: read whole, or not at all when an answer is already set).

mitmproxy hands each body chunk to one synchronous callable (`flow.request.stream` /
`flow.response.stream`), then calls it once with b"". Several stages have a say about those bytes;
instead of each stage wrapping whatever the previous one installed (an order nobody could read in one
place, and one stage could undo another's wrapper), the stages only *plan* (typed FlowState fields:
budgets.py `meter_request`/`stream_request`, streaming.py `stream_response`, credential_response.py
`scrub`/`replacement`, the MCP route's `forbid_body`/`answer_filter`) and enforce.py calls the two
install functions below once the decision is recorded. tests/architecture/test_one_stream_builder.py
fails when any other gateway module assigns a body's `stream`.

Request body, per chunk, first to last:
  0. body refused   — a route on which this request may carry no body (the MCP route: a GET or DELETE
                      of undeclared length, HTTP/2): any byte cuts the flow, never hashed, counted or
                      forwarded (`forbid_body`, called once);
  1. request hash   — what the sandbox sent, before anything is held back or cut (audit/reqhash.py);
  2. phantom guard  — a placeholder credential anywhere in the body is misuse: it is never counted nor
                      forwarded (it holds back a phantom's length minus one, so a split one is caught);
  3. budget counter — counts what goes upstream; the chunk that would cross the budget is dropped and
                      the connection cut (the upstream never sees a complete body).
Response body, per chunk, first to last:
  1. budget counter — counts what the upstream sent (wire bytes, before decoding or filtering);
  2. decode + scrub — a credentialed response is decoded and scrubbed of the injected value
                      (credential_streams.scrub_chain), so the sandbox never receives it;
  3. answer filter  — a protocol route reads what steps 1-2 let through, mediates it and re-encodes it
                      (the MCP route: JSON-RPC messages parsed and passed through the session's mediator,
                      gateway/mcp/stream.py), so it decides on the scrubbed bytes;
  4. re-scrub       — what the filter re-encoded is scrubbed once more on a credentialed route (a secret
                      the upstream had escaped in JSON comes out of the re-encoding unescaped).
A response refused at its headers has a replacement body instead: none of the upstream's bytes go out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mitmproxy import http

from egressgate.audit.reqhash import StreamingRequestHash
from egressgate.broker.inject import PhantomHit
from egressgate.broker.redact import Scrubber
from egressgate.gateway.shared.credential_streams import StreamFn, as_chunks, phantom_guard, replace_body, scrub_chain


@dataclass(slots=True, repr=False)
class ScrubPlan:
    """How a streamed credentialed response is decoded and scrubbed (credential_response.py plans it)."""

    codings: list[str]
    scrubber: Scrubber
    max_output: int
    on_error: Callable[[Exception], None]


@dataclass(slots=True, repr=False)
class AnswerFilter:
    """A route's filter over a streamed answer (step 3 of the response order; the MCP route plans it in
    gateway/mcp/answer.py). `wrap(inner)` returns the callable that reads what `inner` (the counter and
    scrub chain, None when there is neither) lets through; `rescrub` is the route's credential scrubber
    (step 4), None on a route without a credential."""

    wrap: Callable[[StreamFn | None], StreamFn]
    rescrub: Scrubber | None = None


def _hashing(hasher: StreamingRequestHash, inner: StreamFn) -> StreamFn:
    def hashing(chunk: bytes) -> object:
        hasher.update(chunk)
        return inner(chunk)

    return hashing


def _body_refused(on_body: Callable[[], None], inner: StreamFn) -> StreamFn:
    """Step 0: the first body byte calls `on_body` (which cuts the flow) once; nothing is passed on."""
    cut = False

    def refused(chunk: bytes) -> object:
        nonlocal cut
        if chunk or cut:
            if not cut:
                cut = True
                on_body()
            return []
        return inner(chunk)

    return refused


def _rescrubbing(scrubber: Scrubber, inner: StreamFn) -> StreamFn:
    def rescrub(chunk: bytes) -> object:
        return [scrubber.scrub(c) for c in as_chunks(inner(chunk))]

    return rescrub


def compose_request(
    hasher: StreamingRequestHash | None,
    on_phantom: Callable[[list[PhantomHit]], None],
    counter: StreamFn | None,
    forbid_body: Callable[[], None] | None = None,
) -> StreamFn:
    """The request body's callable: [body refused →] hash → phantom guard → budget counter (module
    docstring)."""
    stream = phantom_guard(counter, on_phantom)
    if hasher is not None:
        stream = _hashing(hasher, stream)
    return _body_refused(forbid_body, stream) if forbid_body is not None else stream


def compose_response(
    counter: StreamFn | None, scrub: ScrubPlan | None, replacement: bytes | None, answer: AnswerFilter | None = None
) -> StreamFn | bool:
    """The response body's callable: budget counter → decode + scrub → answer filter → re-scrub; or the
    replacement body."""
    if replacement is not None:
        return replace_body(replacement)
    stream: StreamFn | None = counter
    if scrub is not None:
        stream = scrub_chain(counter, scrub.codings, scrub.scrubber, scrub.max_output, scrub.on_error)
    if answer is not None:
        stream = answer.wrap(stream)
        if answer.rescrub is not None:
            stream = _rescrubbing(answer.rescrub, stream)
    return stream if stream is not None else True


def install_request(request: http.Request, stream: StreamFn) -> None:
    """Set the request body's callable (built by `compose_request`)."""
    request.stream = stream


def install_response(response: http.Response, stream: StreamFn | bool) -> None:
    """Set the response body's callable (built by `compose_response`)."""
    response.stream = stream


def buffer_body(message: http.Message) -> None:
    """No callable: the body is read whole before the next hook, or — when the flow already has its answer
    (a refusal before the body, early_answer.py) — not read at all."""
    message.stream = False
