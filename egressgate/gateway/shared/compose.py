"""The one place a body's stream callable is built: the order of its wrappers is stated here only.

mitmproxy hands each body chunk to one synchronous callable (`flow.request.stream` /
`flow.response.stream`), then calls it once with b"". Several stages have a say about those bytes;
instead of each stage wrapping whatever the previous one installed (an order nobody could read in one
place, and one stage could undo another's wrapper), the stages only *plan* (typed FlowState fields:
budgets.py `meter_request`/`stream_request`, streaming.py `stream_response`, credential_response.py
`scrub`/`replacement`) and enforce.py calls the two functions below once the decision is recorded.

Request body, per chunk, first to last:
  1. request hash   — what the sandbox sent, before anything is held back or cut (audit/reqhash.py);
  2. phantom guard  — a placeholder credential anywhere in the body is misuse: it is never counted nor
                      forwarded (it holds back a phantom's length minus one, so a split one is caught);
  3. budget counter — counts what goes upstream; the chunk that would cross the budget is dropped and
                      the connection cut (the upstream never sees a complete body).
Response body, per chunk, first to last:
  1. budget counter — counts what the upstream sent (wire bytes, before decoding);
  2. decode + scrub — a credentialed response is decoded and scrubbed of the injected value
                      (credential_streams.scrub_chain), so the sandbox never receives it.
A response refused at its headers has a replacement body instead: none of the upstream's bytes go out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from egressgate.audit.reqhash import StreamingRequestHash
from egressgate.broker.inject import PhantomHit
from egressgate.broker.redact import Scrubber
from egressgate.gateway.shared.credential_streams import StreamFn, phantom_guard, replace_body, scrub_chain


@dataclass(slots=True, repr=False)
class ScrubPlan:
    """How a streamed credentialed response is decoded and scrubbed (credential_response.py plans it)."""

    codings: list[str]
    scrubber: Scrubber
    max_output: int
    on_error: Callable[[Exception], None]


def _hashing(hasher: StreamingRequestHash, inner: StreamFn) -> StreamFn:
    def hashing(chunk: bytes) -> object:
        hasher.update(chunk)
        return inner(chunk)

    return hashing


def compose_request(hasher: StreamingRequestHash | None, on_phantom: Callable[[list[PhantomHit]], None],
                    counter: StreamFn | None) -> StreamFn:
    """The request body's callable: hash → phantom guard → budget counter (module docstring)."""
    stream = phantom_guard(counter, on_phantom)
    return _hashing(hasher, stream) if hasher is not None else stream


def compose_response(counter: StreamFn | None, scrub: ScrubPlan | None, replacement: bytes | None) -> StreamFn | bool:
    """The response body's callable: budget counter → decode + scrub; or the replacement body."""
    if replacement is not None:
        return replace_body(replacement)
    if scrub is not None:
        return scrub_chain(counter, scrub.codings, scrub.scrubber, scrub.max_output, scrub.on_error)
    return counter if counter is not None else True
