"""Pure credential placement and phantom handling (no mitmproxy types: lists of (name, value) pairs).

The gateway addon calls these after identity, decision, Host/SNI consistency and address pinning have
passed, for the rule that names the capability, and applies the returned header/query lists. Keeping
the logic here makes every edge (duplicate headers, mixed case, the sandbox's own Authorization, a
phantom in the wrong place) testable without a proxy.

Phantom mode: admission hands the sandbox `phantom_value()` (e.g. as OPENAI_API_KEY) and stores only its
SHA-256 (`phantom_hash`). The gateway swaps it for the real value only in the configured header of the
bound route; `find_phantoms` reports it anywhere else (another header, the query, the path, the body, or
any header on another route) so the gateway denies with reason `credential_misuse`.

"It" means the phantom in any form a decoder undoes, not only the raw one: a sandbox that sends
`\u0065gph_…` (JSON), `&#101;gph_…` (HTML) or a partly percent-encoded phantom hands the same token
to whoever decodes it, which is the exfiltration signal this check exists to catch. Every character
may be escaped independently (broker/escapes.py, the one escape-aware matcher; the gateway knows
only the phantom's hash, so it matches the phantom's *shape* and decodes the match to hash it).
An escaped phantom in the bound header itself is not swapped (only the raw form is) but still
stripped by `swap_phantom`: it never goes out as sent.
"""

from __future__ import annotations

import base64
import hmac
import re
import secrets
from dataclasses import dataclass
from typing import Literal

from egressgate.broker.config import (
    BasicPlacement,
    HeaderPlacement,
    JwtCapability,
    QueryPlacement,
    StaticCapability,
    VaultOidcCapability,
)
from egressgate.broker.credential import Credential
from egressgate.broker.escapes import decode_escaped, escape_prefilter, escaped_any
from egressgate.state.base import hash_token

Headers = list[tuple[str, str]]
Query = list[tuple[str, str]]
AnyCapability = StaticCapability | JwtCapability | VaultOidcCapability

PHANTOM_PREFIX = "egph_"
PHANTOM_HEX = 48
PHANTOM_LEN = len(PHANTOM_PREFIX) + PHANTOM_HEX
_PHANTOM = re.compile(r"egph_[0-9a-f]{48}", re.IGNORECASE)
_PHANTOM_B = re.compile(rb"egph_[0-9a-f]{48}", re.IGNORECASE)
_HEX_CHARS = "0123456789abcdefABCDEF"
_ALPHABET = "egphEGPH_" + _HEX_CHARS
_PREFIX_CLASSES = [escaped_any(c + c.upper()) for c in PHANTOM_PREFIX[:-1]] + [escaped_any("_")]
_HEX_CLASS = escaped_any(_HEX_CHARS)
_ESCAPED_B = re.compile(b"".join(p.source for p in _PREFIX_CLASSES)
                        + b"(?:%s){%d}" % (_HEX_CLASS.source, PHANTOM_HEX))
# The longest escaped phantom (+1: the lookahead byte of a `;`-less HTML reference): a streamed body's
# scanner keeps this many bytes minus one, so a phantom escaped and split across chunks is seen whole.
PHANTOM_MAX_LEN = sum(p.max_len for p in _PREFIX_CLASSES) + PHANTOM_HEX * _HEX_CLASS.max_len + 1
_needles, _sources = escape_prefilter([_ALPHABET])
# Cheap gate before the escaped search: some escape of a phantom character is present (innocent `%20`,
# `\n`, `&amp;`, `&#39;` do not open it).
_ESCAPE_GATE = re.compile(b"|".join([re.escape(n) for n in _needles] + _sources))


def phantom_value() -> str:
    """A fresh placeholder: random (192 bits), recognisable by prefix, worthless outside the gateway."""
    return PHANTOM_PREFIX + secrets.token_hex(PHANTOM_HEX // 2)


def phantom_hash(value: str) -> str:
    """What the state store keeps (SandboxRecord.phantoms[capability]); the same digest as tokens."""
    return hash_token(value.lower())


def admission_phantoms(capabilities: dict[str, AnyCapability]) -> tuple[dict[str, str], dict[str, str]]:
    """For admission: (env for the sandbox {phantom_env: phantom}, {capability: phantom_hash} to store
    in SandboxRecord.phantoms). Only phantom-mode capabilities appear; real values never do."""
    env: dict[str, str] = {}
    hashes: dict[str, str] = {}
    for name, cap in sorted(capabilities.items()):
        if cap.mode != "phantom" or cap.phantom_env is None:
            continue
        if cap.phantom_env in env:
            raise ValueError(f"capabilities share phantom_env {cap.phantom_env!r}")
        value = phantom_value()
        env[cap.phantom_env] = value
        hashes[name] = phantom_hash(value)
    return env, hashes


@dataclass(frozen=True, slots=True)
class Injection:
    headers: Headers  # the complete new header list
    query: Query  # the complete new query list
    set_header: str | None  # name of the header now carrying the credential
    set_query: str | None  # name of the query parameter now carrying it
    removed_headers: tuple[str, ...]  # lower-case names stripped from what the sandbox sent
    swapped: bool  # phantom mode: the phantom was present and replaced; always mode: True

    def __repr__(self) -> str:  # the lists hold the credential: never show them
        return (
            f"Injection(set_header={self.set_header!r}, set_query={self.set_query!r}, "
            f"removed_headers={self.removed_headers!r}, swapped={self.swapped})"
        )

    __str__ = __repr__


def _strip(headers: Headers, names: set[str]) -> tuple[Headers, tuple[str, ...]]:
    kept, removed = [], []
    for k, v in headers:
        if k.lower() in names:
            removed.append(k.lower())
        else:
            kept.append((k, v))
    return kept, tuple(sorted(set(removed)))


def _checked(credential: Credential) -> str:
    """Backends already refuse CR/LF/NUL; checked again here because a header value with a line break
    is request smuggling, whatever produced it."""
    value = credential.value
    if not value or any(ch in value for ch in "\r\n\x00"):
        raise ValueError(f"credential for {credential.capability!r} is empty or contains CR/LF/NUL")
    return value


def inject(capability: AnyCapability, credential: Credential, headers: Headers, query: Query) -> Injection:
    """`always` mode: set the credential, replacing whatever the sandbox sent there (no duplicates),
    and strip the sandbox's own Authorization for this route."""
    placement = capability.placement
    value = _checked(credential)
    if isinstance(placement, HeaderPlacement):
        out, removed = _strip(headers, {"authorization", placement.header.lower()})
        out.append((placement.header, placement.render(value)))
        return Injection(out, list(query), placement.header, None, removed, True)
    if isinstance(placement, BasicPlacement):
        out, removed = _strip(headers, {"authorization"})
        pair = f"{placement.basic.username}:{value}".encode()
        out.append(("Authorization", "Basic " + base64.b64encode(pair).decode("ascii")))
        return Injection(out, list(query), "Authorization", None, removed, True)
    assert isinstance(placement, QueryPlacement)
    out, removed = _strip(headers, {"authorization"})
    name = placement.query
    new_query = [(k, v) for k, v in query if k.lower() != name.lower()]
    new_query.append((name, value))
    return Injection(out, new_query, None, name, removed, True)


def swap_phantom(
    capability: AnyCapability, credential: Credential, expected_hash: str, headers: Headers, query: Query
) -> Injection:
    """`phantom` mode: replace the configured header by the real value iff it carries this sandbox's
    phantom for this capability. Other values in that header, and Authorization, are stripped either
    way; when the phantom is absent nothing is injected (`swapped=False`)."""
    placement = capability.placement
    if not isinstance(placement, HeaderPlacement):
        raise ValueError("phantom mode needs a header placement")
    target = placement.header.lower()
    found = False
    for k, v in headers:
        if k.lower() == target:
            for m in _PHANTOM.finditer(v):
                if hmac.compare_digest(phantom_hash(m.group(0)), expected_hash):
                    found = True
    out, removed = _strip(headers, {"authorization", target})
    if not found:
        return Injection(out, list(query), None, None, removed, False)
    out.append((placement.header, placement.render(_checked(credential))))
    return Injection(out, list(query), placement.header, None, removed, True)


@dataclass(frozen=True, slots=True)
class PhantomHit:
    where: Literal["header", "query", "path", "body"]
    name: str | None  # header or query parameter name
    phantom_hash: str  # which phantom (maps to sandbox + capability via the state store)


def _phantom_of(match: bytes) -> str:
    """The phantom an escaped match decodes to (lower case). A match the decoder cannot read (should not
    happen: same alternatives) is returned as is: its hash matches no phantom, so it counts as misuse
    (fail closed) rather than as the allowed one."""
    decoded = decode_escaped(match, _ALPHABET)
    return (decoded if decoded is not None else match.decode("utf-8", "replace")).lower()


def _may_be_escaped(data: bytes) -> bool:
    """Some escape of a phantom character is in `data`: every escape starts with `%`, `\\` or `&` (memchr
    first: most bodies have none), then the prefilter."""
    return (b"%" in data or b"\\" in data or b"&" in data) and _ESCAPE_GATE.search(data) is not None


def scan_bytes(data: bytes) -> list[str]:
    """Every phantom in `data`, raw or with any of its characters escaped (lower case, deduplicated)."""
    found = [m.group(0).decode().lower() for m in _PHANTOM_B.finditer(data)]
    if _may_be_escaped(data):  # a phantom in an encoding a decoder undoes is the same phantom
        found += [_phantom_of(m.group(0)) for m in _ESCAPED_B.finditer(data)]
    return list(dict.fromkeys(found))


def _scan(text: str) -> list[str]:
    return scan_bytes(text.encode("utf-8", "surrogateescape"))


def redact_phantoms(text: str, replacement: str = "egph_[REDACTED]") -> str:
    """`text` with every phantom, raw or escaped, replaced (audit records keep the request's target)."""
    data = text.encode("utf-8", "surrogateescape")
    data = _PHANTOM_B.sub(replacement.encode(), data)
    if _may_be_escaped(data):
        data = _ESCAPED_B.sub(replacement.encode(), data)
    return data.decode("utf-8", "surrogateescape")


def find_phantoms(
    headers: Headers,
    query: Query,
    body_chunk: bytes = b"",
    *,
    path: str = "",
    allowed: tuple[str, str] | None = None,
) -> list[PhantomHit]:
    """Every phantom in the request except the one permitted place.

    `allowed` is (header name, phantom hash) of the capability bound to this route, or None when the
    route has no phantom capability (then a phantom anywhere, even in that header, is misuse). Any hit
    means: deny with reason credential_misuse. For streamed bodies use `PhantomBodyScanner`.
    """
    hits: list[PhantomHit] = []
    allow_name = allowed[0].lower() if allowed else None
    for k, v in headers:
        for p in _scan(k) + _scan(v):
            h = phantom_hash(p)
            if allowed and k.lower() == allow_name and hmac.compare_digest(h, allowed[1]):
                continue
            hits.append(PhantomHit("header", k, h))
    for k, v in query:
        hits += [PhantomHit("query", k, phantom_hash(p)) for p in _scan(k) + _scan(v)]
    hits += [PhantomHit("path", None, phantom_hash(p)) for p in _scan(path)]
    hits += _body_hits(body_chunk)
    return hits


def _body_hits(data: bytes) -> list[PhantomHit]:
    return [PhantomHit("body", None, phantom_hash(p)) for p in scan_bytes(data)]


class PhantomBodyScanner:
    """Streaming body check (phantom split across chunks); usable as `flow.request.stream` wrapper.
    The window is PHANTOM_MAX_LEN - 1 bytes (the longest escaped form), not the raw phantom's length:
    an escaped phantom split across chunks is then seen whole. A phantom lying entirely in the kept
    tail is found again in the next window: hits are reported once per phantom (by hash)."""

    def __init__(self) -> None:
        self.tail = b""
        self.hits: list[PhantomHit] = []

    def feed(self, chunk: bytes) -> list[PhantomHit]:
        data = self.tail + chunk
        seen = {h.phantom_hash for h in self.hits}
        new = [h for h in _body_hits(data) if h.phantom_hash not in seen]
        keep = PHANTOM_MAX_LEN - 1
        self.tail = data[-keep:] if len(data) >= keep else data
        self.hits += new
        return new
