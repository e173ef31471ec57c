"""Server-sent events (text/event-stream): an incremental decoder and an encoder for MCP streams.

Why our own decoder: MCP answers (streamable HTTP) and the old HTTP+SSE transport carry JSON-RPC
messages as SSE events, and the gateway must decide on every event the client will act on, while the
stream flows (never buffering it whole). So the decoder takes chunks as the network cuts them (a line
terminator, even a CRLF pair, may be split across chunks), follows the WHATWG event-stream rules (CR,
LF or CRLF end a line; `:` starts a comment; several `data:` lines join with LF; an event is dispatched
at a blank line; an unterminated event at the end of the stream is dropped, as a browser would), and
bounds what it holds: one event (its data plus the unfinished line) above `max_event_bytes` is an
error (SseMalformed), not an ever-growing buffer. Data stay bytes: the JSON parser (mcp/jsonrpc.py)
decides about their encoding; event names and ids must be UTF-8.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_MAX_EVENT_BYTES = 1024 * 1024
_EOL = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


class SseMalformed(ValueError):
    def __init__(self, detail: str, message: str) -> None:
        super().__init__(f"{detail}: {message}")
        self.detail = detail
        self.message = message


@dataclass(frozen=True, slots=True)
class SseEvent:
    data: bytes
    event: str = "message"
    id: str | None = None  # the event's own id field (None: the event had none)
    retry: int | None = None


class SseDecoder:
    """feed(chunk) -> the events completed by it. One decoder per stream."""

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._buf = b""
        self._skip_lf = False  # the last chunk ended in CR: a leading LF of the next one is its pair
        self._started = False  # a leading BOM is stripped once, at the start of the stream
        self._data: list[bytes] = []
        self._data_bytes = 0
        self._event = ""
        self._id: str | None = None
        self._retry: int | None = None
        self._fields = False  # some field line was seen since the last dispatch
        self.comments = 0

    @property
    def pending(self) -> bool:
        """Bytes of an event not yet dispatched (at EOF: a truncated event, dropped)."""
        return bool(self._buf or self._fields)

    def feed(self, chunk: bytes) -> list[SseEvent]:
        if not chunk:
            return []
        buf = self._buf + chunk
        pos = 0
        if not self._started:
            if len(buf) < len(_BOM) and _BOM.startswith(buf):
                self._buf = buf
                return []
            self._started = True
            if buf.startswith(_BOM):
                pos = len(_BOM)
        if self._skip_lf and pos < len(buf):
            if buf[pos:pos + 1] == b"\n":
                pos += 1
            self._skip_lf = False
        events: list[SseEvent] = []
        search = _EOL.search
        while True:
            m = search(buf, pos)
            if m is None:
                break
            line = buf[pos:m.start()]
            if m.group() == b"\r" and m.end() == len(buf):
                self._skip_lf = True
            pos = m.end()
            event = self._line(line)
            if event is not None:
                events.append(event)
        self._buf = buf[pos:]
        if self._data_bytes + len(self._buf) > self.max_event_bytes:
            raise SseMalformed("event_too_large", f"an event is over {self.max_event_bytes} bytes")
        return events

    def _line(self, line: bytes) -> SseEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(b":"):
            self.comments += 1
            return None
        name, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        self._fields = True
        if name == b"data":
            self._data_bytes += len(value) + 1
            if self._data_bytes > self.max_event_bytes:
                raise SseMalformed("event_too_large", f"an event is over {self.max_event_bytes} bytes")
            self._data.append(value)
        elif name == b"event":
            self._event = _text(value, "event")
        elif name == b"id":
            if b"\0" not in value:  # WHATWG: an id with NUL is ignored
                self._id = _text(value, "id")
        elif name == b"retry" and value.isdigit():
            self._retry = int(value)
        # other field names are ignored (WHATWG)
        return None

    def _dispatch(self) -> SseEvent | None:
        data, event, id_, retry = self._data, self._event, self._id, self._retry
        self._data, self._data_bytes, self._event, self._id, self._retry = [], 0, "", None, None
        self._fields = False
        if not data:
            return None  # WHATWG: an event without data is not dispatched
        return SseEvent(data=b"\n".join(data), event=event or "message", id=id_, retry=retry)


def _text(value: bytes, what: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise SseMalformed("not_utf8", f"the {what} field is not UTF-8") from None


def encode(data: bytes, event: str | None = None, id: str | None = None, retry: int | None = None) -> bytes:
    """One event, LF-terminated; every line of `data` becomes a `data:` line (a CR or LF inside data
    can never end the event early or start a field of the attacker's choosing)."""
    out = []
    if event is not None and event != "message":
        out.append(b"event: " + _field(event))
    if id is not None:
        out.append(b"id: " + _field(id))
    if retry is not None:
        out.append(b"retry: %d" % retry)
    out.extend(b"data: " + line for line in _EOL.split(data))
    return b"\n".join(out) + b"\n\n"


def _field(value: str) -> bytes:
    raw = value.encode("utf-8")
    if _EOL.search(raw):
        raise ValueError("an SSE field value cannot contain a line break")
    return raw


def comment(text: str = "") -> bytes:
    """A comment line (keep-alive); line breaks in `text` are refused like in a field."""
    return b":" + (_field(text) if text else b"") + b"\n\n"
