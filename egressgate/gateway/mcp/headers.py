"""The few headers the MCP route reads, gathered in ONE pass over a message's header fields.

Why: mitmproxy's `Headers` answers every lookup (`in`, `get`, `get_all`) by lower-casing each field
name again; the route asks 6-8 questions per message (upgrade, session id, coding, length, framing,
content type), which was ~90 extra name conversions per MCP request (loadtests/RESULTS.md, issue 13).
The answers are the same as mitmproxy's: names compared case-insensitively, values decoded like
`Headers` does (UTF-8, surrogateescape), several fields of one name folded with ", " by `get` (so two
Content-Length fields still read as "5, 5", which is not a number and is refused) and listed by
`get_all`. A view is a snapshot: build it where the headers are read, not before an addon changes them.
"""

from __future__ import annotations

from mitmproxy import http

# the only names the route reads (others are skipped while scanning: nothing else is decided on here)
WANTED = frozenset({b"upgrade", b"mcp-session-id", b"content-encoding", b"content-length",
                    b"transfer-encoding", b"content-type", b"mcp-protocol-version"})


class HeaderView:
    __slots__ = ("_values",)

    def __init__(self, message: http.Message) -> None:
        values: dict[bytes, list[str]] = {}
        for name, value in message.headers.fields:
            key = name.lower()
            if key in WANTED:
                values.setdefault(key, []).append(value.decode("utf-8", "surrogateescape"))
        self._values = values

    def __contains__(self, name: bytes) -> bool:
        return name in self._values

    def get(self, name: bytes, default: str | None = None) -> str | None:
        found = self._values.get(name)
        return ", ".join(found) if found else default

    def get_all(self, name: bytes) -> list[str]:
        return list(self._values.get(name, ()))

    def content_type(self) -> str:
        return (self.get(b"content-type") or "").split(";", 1)[0].strip().lower()

    def coded(self) -> bool:
        """A content coding other than identity: the body could not be read as sent."""
        return any(v.strip().lower() not in ("", "identity") for v in self.get_all(b"content-encoding"))
