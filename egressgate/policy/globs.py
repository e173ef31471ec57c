"""Host patterns and path globs: the only two pattern languages in a policy.

Hosts: an exact canonical name or IP literal, or `*.suffix` (subdomains at any depth, never the apex),
or `*` alone (deny rules only). Nothing else: `api.*.com`, `*foo.com`, `**.x` are errors, because a glob
a security engineer cannot read at a glance is a glob that will be wrong.

Paths: canonical origin-form paths (policy.canon.canon_path) where `*` matches within one segment and
`**` (a whole segment) matches any number of segments; a trailing `/**` also matches the bare prefix
(`/v1/**` matches `/v1`). Wildcards never match `%2F` or `%5C`: an encoded slash or backslash can only
be matched by literal rule text, so a server that decodes them cannot be walked outside an allowed
subtree (`/repos/*` does not match `/repos/x%2F..%2Fadmin`).

Globs are matched segment-wise by policy.pathmatch, never by a backtracking regex: the request path is
the sandbox's to choose, and a regex per glob cost O(n^k) for k wildcards (seconds per request).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

from egressgate.policy.canon import CanonError, canon_host, canon_path, parse_ip_literal
from egressgate.policy.pathmatch import GLOBSTAR, Element, SegmentPattern
from egressgate.policy.readings import fold_separators


class GlobError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class HostPattern:
    kind: str  # "exact" | "suffix" | "any"
    value: str  # canonical host, or the canonical suffix without "*." ("" for any)

    def matches(self, host: str) -> bool:
        if self.kind == "exact":
            return host == self.value
        if self.kind == "suffix":
            return host.endswith("." + self.value) and parse_ip_literal(host) is None
        return True

    def __str__(self) -> str:
        return {"exact": self.value, "suffix": f"*.{self.value}", "any": "*"}[self.kind]


def parse_host_pattern(raw: str, *, allow_any: bool) -> HostPattern:
    if raw == "*":
        if not allow_any:
            raise GlobError("'*' alone is only valid in deny rules; name the hosts to allow")
        return HostPattern("any", "")
    if raw.startswith("*."):
        suffix = raw[2:]
        if "*" in suffix:
            raise GlobError("only one leading '*.' is allowed in a host pattern")
        try:
            canonical = canon_host(suffix)
        except CanonError as exc:
            raise GlobError(f"bad host pattern: {exc}") from None
        if parse_ip_literal(canonical) is not None:
            raise GlobError("'*.' cannot prefix an IP address")
        return HostPattern("suffix", canonical)
    if "*" in raw:
        raise GlobError("bad host pattern: '*' is allowed only as a leading '*.' label or alone")
    try:
        return HostPattern("exact", canon_host(raw))
    except CanonError as exc:
        raise GlobError(f"bad host: {exc}") from None


@dataclass(frozen=True, slots=True)
class PathGlob:
    source: str
    exact: str | None  # set when the glob has no wildcard
    pattern: SegmentPattern | None  # the wildcard glob, matched segment-wise (policy.pathmatch)

    def matches(self, path: str) -> bool:
        if self.exact is not None:
            return path == self.exact
        assert self.pattern is not None
        return self.pattern.matches(path)


def parse_path_glob(raw: str) -> PathGlob:
    if not raw.startswith("/"):
        raise GlobError("a path must start with '/'")
    if "?" in raw or "#" in raw:
        raise GlobError("a path rule cannot contain '?' or '#' (queries are not matched)")
    if "***" in raw:
        raise GlobError("'***' is not a glob; use '*' (one segment) or '**' (any depth)")
    segments = raw.split("/")[1:]
    for segment in segments:
        if "**" in segment and segment != "**":
            raise GlobError("'**' must be a whole path segment, e.g. /v1/**")
        if segment in (".", ".."):
            raise GlobError("dot segments are not allowed in path rules")
    try:
        canonical = canon_path(raw)
    except CanonError as exc:
        raise GlobError(f"bad path: {exc}") from None
    if canonical != raw:
        raise GlobError(f"path is not in canonical form; write it as {canonical!r}")
    if "*" not in raw:
        return PathGlob(raw, raw, None)
    # Wildcards never consume %2F/%5C (guard); canonical form makes every '%' start a whole escape
    # inside one literal part, which the greedy segment matcher relies on (pathmatch.segment_matches).
    return PathGlob(raw, None, SegmentPattern(_elements(segments, lambda text: text), guard=True))


def _elements(segments: list[str], literal: Callable[[str], str]) -> tuple[Element, ...]:
    """Glob segments as pattern elements, each literal part mapped through ``literal``. A mapped
    literal may contain '/' (a deny glob's decoded %2F): it then splits into further segments, as the
    same text would have in a regex."""
    out: list[Element] = []
    for segment in segments:
        if segment == "**":
            out.append(GLOBSTAR)
            continue
        parts = [""]
        for i, piece in enumerate(segment.split("*")):
            if i:
                parts.append("")  # a star between literal parts
            first, *rest = literal(piece).split("/")
            parts[-1] += first
            for chunk in rest:
                out.append(tuple(parts))
                parts = [chunk]
        out.append(tuple(parts))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DenyGlob:
    """A deny rule's path glob, widened so it fails closed (see policy.readings).

    ``canonical`` matches the canonical path, ignoring case, with wildcards that DO cross ``%2F``/``%5C``
    (a server that keeps an encoded slash as data serves ``/a/x%2Fy`` from the resource ``/a/*`` names);
    ``reading`` matches server readings: its literal text decoded and folded like the readings."""

    source: str
    canonical: SegmentPattern
    reading: SegmentPattern


def deny_glob(glob: PathGlob) -> DenyGlob:
    segments = glob.source.split("/")[1:]
    canonical = _elements(segments, str.lower)
    reading = _elements(segments, lambda text: fold_separators(_decode_literal(text)))
    return DenyGlob(
        glob.source,
        SegmentPattern(canonical, guard=False, fold_case=True),
        SegmentPattern(reading, guard=False),
    )


def _decode_literal(text: str) -> str:
    """Rule text is canonical, so its escapes are well formed; bytes that are not UTF-8 stay escaped
    as surrogates (a reading never contains them: such a path is refused as ambiguous)."""
    return unquote(text, errors="surrogateescape") if "%" in text else text
