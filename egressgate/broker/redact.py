"""Scrub injected credentials, and their common encodings, from everything that flows back.

An upstream that reflects a request (echo services, error pages, debug endpoints, redirects carrying a
token in Location, cookies) would hand the sandbox the very secret it must never hold. `Scrubber`
compiles every value's encodings once; `Scrubber.stream()` returns a per-response callable for
mitmproxy's `flow.response.stream` (sync, called per chunk, then once with b"").

Split secrets: the stream keeps the last `max_pattern_len - 1` bytes back, so a value cut across chunk
boundaries is still matched; a match is only acted on when the window proves no longer pattern could
start there. Overlapping matches are merged, and a redaction that runs past the emitted part is
remembered so the rest of it is suppressed next time (no partial secret leaks out at a boundary).
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, quote_plus

from egressgate.broker.escapes import EscapedPattern, escape_prefilter, escaped_pattern

REPLACEMENT = b"[REDACTED]"
MIN_EMBEDDED_B64 = 8  # shorter mid-blob base64 fragments would redact innocent data


@dataclass(frozen=True, slots=True)
class SecretSpec:
    """A value to scrub; `username` adds the HTTP basic `username:value` encodings."""

    value: str
    username: str | None = None


def _b64_forms(raw: bytes, embedded: bool) -> set[bytes]:
    """Standard and URL-safe base64 of `raw`, padded and unpadded, and (when `embedded`) the stable
    middle part of its encoding at the two other alignments, which is how it appears inside a larger
    base64 blob (a JSON document or form base64-encoded as a whole)."""
    forms: set[bytes] = set()
    for enc in (base64.b64encode, base64.urlsafe_b64encode):
        full = enc(raw)
        forms.add(full)
        forms.add(full.rstrip(b"="))
        if not embedded:
            continue
        for shift in (0, 1, 2):
            padded = enc(b"\0" * shift + raw)
            # Characters depending on unknown neighbours: the first ceil(shift*8/6) and, unless the
            # value ends on a 3-byte boundary, the last group's tail.
            head = (shift * 8 + 5) // 6
            total_bits = (shift + len(raw)) * 8
            stable_end = total_bits // 6  # chars fully determined by our bytes
            middle = padded[head:stable_end]
            if len(middle) >= MIN_EMBEDDED_B64:
                forms.add(middle)
    return forms


def _url_forms(text: str) -> set[bytes]:
    forms: set[bytes] = set()
    for encoded in (quote(text, safe=""), quote(text), quote_plus(text), quote_plus(text, safe="/")):
        forms.add(encoded.encode())
        forms.add(re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), encoded).encode())
    return forms


def _json_forms(text: str) -> set[bytes]:
    forms: set[bytes] = set()
    for ascii_only in (True, False):
        body = json.dumps(text, ensure_ascii=ascii_only)[1:-1]
        forms.add(body.encode("utf-8"))
        forms.add(body.replace("/", "\\/").encode("utf-8"))
    return forms


def encodings(spec: SecretSpec) -> set[bytes]:
    """Every byte pattern under which `spec` is scrubbed."""
    raw = spec.value.encode("utf-8")
    forms = {raw, raw.hex().encode(), raw.hex().upper().encode()}
    forms |= _url_forms(spec.value)
    forms |= _json_forms(spec.value)
    forms |= _b64_forms(raw, embedded=True)
    if spec.username is not None:
        pair = f"{spec.username}:{spec.value}"
        forms |= _b64_forms(pair.encode("utf-8"), embedded=False)
        forms |= _url_forms(pair)
    return {f for f in forms if f}


class Scrubber:
    """Compiled patterns for a set of secrets; immutable, share it across responses."""

    def __init__(self, secrets: Iterable[SecretSpec | str], replacement: bytes = REPLACEMENT) -> None:
        literal: set[bytes] = set()
        raws: set[bytes] = set()
        escaped: dict[str, EscapedPattern] = {}
        for s in secrets:
            spec = SecretSpec(s) if isinstance(s, str) else s
            if not spec.value:
                raise ValueError("cannot scrub an empty secret")
            literal |= encodings(spec)
            raws.add(spec.value.encode("utf-8"))
            escaped.setdefault(spec.value, escaped_pattern(spec.value))
        # One regex per value (an alternation of them would lose sre's first-character skip).
        self._escaped = [re.compile(p.source) for p in escaped.values()]
        # A fixed form an escape-aware regex matches whole (percent, JSON) is found by it; the raw value
        # stays a literal: it is how the fast path below sees a value with no escape in it.
        self.patterns = sorted((p for p in literal if p in raws or not any(r.fullmatch(p) for r in self._escaped)),
                               key=len, reverse=True)  # longest first: regex takes the first
        self._triggers = [bytes([t]) for t in sorted(set().union(*(p.triggers for p in escaped.values())))]
        needles, sources = escape_prefilter(list(escaped))
        self._needles, self._prefilters = needles, [re.compile(src) for src in sources]
        self.replacement = replacement
        self.max_len = max([len(p) for p in self.patterns] + [p.max_len for p in escaped.values()], default=0)
        alternation = b"|".join(re.escape(p) for p in self.patterns)
        # Plain alternation keeps sre's first-character skip (a lookahead would test every position);
        # overlapping matches are found by searching again from one byte after each match start.
        self._regex = re.compile(alternation) if self.patterns else None

    def spans(self, data: bytes, limit: int | None = None) -> list[tuple[int, int]]:
        """Merged [start, end) intervals of all matches (overlapping ones included) that start before
        `limit` (default: anywhere). Matches may end after `limit`; `data` must hold their bytes."""
        if self._regex is None:
            return []
        # Fast path (the common case: nothing to redact). Literal forms: bytes.find per literal is ~10x
        # faster than sre's alternation scan. Escape-aware: a match is either the raw value (a literal)
        # or holds an escape of one of the secret's characters, which starts with a trigger byte (`\\`,
        # `%`, `&`, `+` for a space) and which the prefilter (needles, regexes) finds; with neither in `data`, there is
        # no span at all. Sound for any `data`, so for the stream's window too: a match is only ever
        # found wholly inside the bytes searched, and so is the escape it holds.
        literal = any(p in data for p in self.patterns)
        escaped = literal or (any(t in data for t in self._triggers) and (
            any(n in data for n in self._needles) or any(r.search(data) for r in self._prefilters)))
        if not escaped:
            return []
        end_pos = len(data) if limit is None else limit
        found = _matches(self._regex, data, end_pos) if literal else []
        for regex in self._escaped:  # `escaped` holds here
            found += _matches(regex, data, end_pos)
        found.sort()
        merged: list[tuple[int, int]] = []
        for start, stop in found:
            if merged and start <= merged[-1][1]:
                if stop > merged[-1][1]:
                    merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        return merged

    def scrub(self, data: bytes) -> bytes:
        """Scrub a complete value (a header, a whole body)."""
        out, pos = [], 0
        for start, stop in self.spans(data):
            out.append(data[pos:start])
            out.append(self.replacement)
            pos = stop
        out.append(data[pos:])
        return b"".join(out)

    def scrub_text(self, text: str) -> str:
        """Header values are str in mitmproxy (utf-8 with surrogate escapes); round-trip losslessly."""
        return self.scrub(text.encode("utf-8", "surrogateescape")).decode("utf-8", "surrogateescape")

    def scrub_headers(self, headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Every header value (Location, Set-Cookie, WWW-Authenticate, custom echoes...) is scrubbed; a
        header whose *name* carries a secret is dropped (a redacted name would not be a valid token)."""
        out = []
        for k, v in headers:
            if self.contains_secret(k.encode("utf-8", "surrogateescape")):
                continue
            out.append((k, self.scrub_text(v)))
        return out

    def contains_secret(self, data: bytes) -> bool:
        return bool(self.spans(data))

    def stream(self) -> StreamScrubber:
        return StreamScrubber(self)


def _matches(regex: re.Pattern[bytes], data: bytes, end_pos: int) -> list[tuple[int, int]]:
    """Every match starting before `end_pos`, overlapping ones included (searched again from one byte
    after each match start)."""
    out: list[tuple[int, int]] = []
    search = regex.search
    pos = 0
    while pos < end_pos:
        m = search(data, pos)
        if m is None or m.start() >= end_pos:
            break
        out.append(m.span())
        pos = m.start() + 1
    return out


@functools.lru_cache(maxsize=1024)
def cached_scrubber(*specs: SecretSpec) -> Scrubber:
    """Building a Scrubber costs ~35 us (encodings + regex); a credential is reused for minutes, so
    the gateway asks here per response. Holds only values the broker's cache holds anyway."""
    return Scrubber(specs)


class StreamScrubber:
    """Per-response streaming state; call with each chunk and finally with b"" (mitmproxy's contract)."""

    def __init__(self, scrubber: Scrubber) -> None:
        self.s = scrubber
        self.hold = max(scrubber.max_len - 1, 0)
        self.buf = b""
        self.suppress = 0  # leading bytes of buf already covered by an emitted REPLACEMENT
        self.touching = False
        self.finished = False

    def __call__(self, chunk: bytes) -> bytes:
        if self.finished:
            return b""
        final = chunk == b""
        data = self.buf + chunk
        # Every pattern starting before `safe` lies wholly inside `data`, so matches there are final;
        # bytes from `safe` on are kept back because a pattern starting there may continue next chunk.
        safe = len(data) if final else max(len(data) - self.hold, 0)
        spans = [(a, b, False) for a, b in self.s.spans(data, safe)]
        if self.suppress or self.touching:  # a replacement already emitted covers data[:suppress]
            spans.insert(0, (0, self.suppress, True))
            spans = _merge(spans)
        out: list[bytes] = []
        pos = 0
        for start, stop, already in spans:
            out.append(data[pos:start])
            if not already:
                out.append(self.s.replacement)
            pos = stop
        if pos < safe:
            out.append(data[pos:safe])
        self.buf, self.suppress = data[safe:], max(pos - safe, 0)
        # A match ending exactly at the boundary: one touching the next chunk's start joins it (same
        # output as scrubbing the whole body at once).
        self.touching = bool(spans) and pos == safe
        if final:
            self.finished, self.buf, self.suppress = True, b"", 0
        return b"".join(out)


def _merge(spans: list[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    """Merge overlapping spans; a merged span counts as already replaced if its first part was."""
    merged: list[tuple[int, int, bool]] = []
    for start, stop, already in spans:
        if merged and start <= merged[-1][1]:
            a, b, done = merged[-1]
            merged[-1] = (a, max(b, stop), done)
        else:
            merged.append((start, stop, already))
    return merged
