"""`query:` on an HTTP rule: the values a request's query parameters may have (allow) or must not have (deny).

Why: path rules never see the query string, and many servers name the operation there: git's
`GET …/info/refs?service=git-receive-pack` opens a push under a clone-only path rule, `?action=delete` turns
a read into a write. A rule can constrain named parameters:

    query: {service: [git-upload-pack]}

How a query is read (canonicalisation), the same way for every rule, assuming the most any server reads:

* the raw query (after `?`, as sent) is split on `&`; each pair at its first `=` (no `=`: the value "");
* names and values are percent-decoded as UTF-8; `+` is read both as itself and as a space (form
  encoding), and a value that still holds an escape after decoding is also read decoded twice: every
  reading counts;
* names compare case-insensitively (servers differ), values exactly;
* every occurrence of a repeated name counts (servers take the first, the last, or all of them);
* ambiguous: a `;` anywhere (some servers split pairs on it), an invalid escape, bytes that are not UTF-8.

An **allow** rule matches when every constrained name occurs and every reading of every occurrence is one of
its listed values; an ambiguous query never matches. A **deny** rule matches when any reading of any
occurrence of a constrained name is a listed value, or when the query is ambiguous (fail closed, as for
ambiguous paths). Names the rule does not list are not constrained. Pure; no I/O.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

_HEX = frozenset("0123456789abcdefABCDEF")


class AmbiguousQuery(ValueError):
    """The query can be read in ways no model covers: allow rules do not match, deny rules do."""


def _decode(text: str) -> str:
    """Strict percent-decoding: every `%` starts a valid escape and the bytes are UTF-8."""
    i = text.find("%")
    while i != -1:
        escape = text[i + 1 : i + 3]
        if len(escape) != 2 or not set(escape) <= _HEX:
            raise AmbiguousQuery(f"invalid percent escape in {text[:80]!r}")
        i = text.find("%", i + 3)
    try:
        return unquote_to_bytes(text).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AmbiguousQuery("percent escapes that are not UTF-8") from exc


def readings(raw: str) -> frozenset[str]:
    """Every text a server may read for one name or value as sent."""
    once = _decode(raw)
    out = {once, _decode(raw.replace("+", " "))}
    if "%" in once:
        with contextlib.suppress(AmbiguousQuery):  # a server (or a framework behind it) that decodes twice
            out.add(_decode(once))
    return frozenset(out)


def parse(query: str | None) -> list[tuple[frozenset[str], frozenset[str]]]:
    """(name readings, lower-cased; value readings) per pair, in order. Raises AmbiguousQuery."""
    if not query:
        return []
    if ";" in query:
        raise AmbiguousQuery("';' in the query (some servers separate parameters with it)")
    pairs = []
    for part in query.split("&"):
        if part == "":
            continue
        name, _, value = part.partition("=")
        pairs.append((frozenset(n.lower() for n in readings(name)), readings(value)))
    return pairs


@dataclass(frozen=True, slots=True)
class QueryMatcher:
    """Compiled `query:` of one rule: (lower-cased name, allowed or denied values) pairs."""

    constraints: tuple[tuple[str, frozenset[str]], ...]

    def allows(self, query: str | None) -> bool:
        """Allow rules: every constrained name present, every reading of every occurrence listed."""
        try:
            pairs = parse(query)
        except AmbiguousQuery:
            return False
        for name, values in self.constraints:
            seen = [vals for names, vals in pairs if name in names]
            if not seen or any(not vals <= values for vals in seen):
                return False
        return True

    def denies(self, query: str | None) -> bool:
        """Deny rules: any reading of any occurrence of a constrained name listed, or an ambiguous query."""
        try:
            pairs = parse(query)
        except AmbiguousQuery:
            return True
        return any(name in names and vals & values for name, values in self.constraints for names, vals in pairs)

    def describe(self) -> str:
        return "&".join(f"{name}={'|'.join(sorted(values))}" for name, values in self.constraints)


def compile_query(raw: dict[str, list[str]], path: str, problems: list[tuple[str, str]]) -> QueryMatcher | None:
    """The matcher for a rule's `query:`, or None after appending problems (`file: key.path: message`)."""
    before = len(problems)
    if not raw:
        problems.append((path, "an empty query matcher matches nothing; omit it for any query"))
    seen: set[str] = set()
    constraints = []
    for name, values in raw.items():
        key = f"{path}.{name}"
        if not name or any(c in name for c in "&=;#%+ ") or not name.isprintable():
            problems.append((key, "a parameter name is plain text without & = ; # % + or spaces"))
        if name.lower() in seen:
            problems.append((key, "parameter names compare case-insensitively: this one is listed twice"))
        seen.add(name.lower())
        if not values:
            problems.append((key, "an empty value list matches nothing"))
        constraints.append((name.lower(), frozenset(values)))
    return QueryMatcher(tuple(constraints)) if len(problems) == before else None
