"""What every canonicalizer shares: the one error type and the input screening.

Kept apart from canon.py (hosts, ports, methods) and canon_path.py (paths) so both can raise the same
`CanonError` and screen input identically; callers import everything from `egressgate.policy.canon`.
"""

from __future__ import annotations

import re

MAX_HOST_INPUT = 1024
"""Longest raw host accepted (before mapping); longer input is ``too_long`` without further work."""
MAX_PATH_INPUT = 65536
"""Longest raw request target accepted."""
MAX_METHOD = 32
MAX_LABEL = 63
MAX_NAME = 253


class CanonError(ValueError):
    """Input that has no single canonical meaning. ``code`` is a stable snake_case identifier."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"CanonError({self.code!r}, {self.message!r})"

    def __reduce__(self) -> tuple[type[CanonError], tuple[str, str]]:
        return (CanonError, (self.code, self.message))  # picklable despite the two-argument __init__


def show(raw: str) -> str:
    """A short, escaped rendering of untrusted input for error messages."""
    return repr(raw[:60] + ("..." if len(raw) > 60 else ""))


def require_text(raw: object, what: str) -> str:
    if not isinstance(raw, str):
        raise CanonError("not_text", f"{what} must be text, got {type(raw).__name__}")
    return raw


# C0/C1 controls, DEL, and every character str.isspace() or Unicode Zs/Zl/Zp calls whitespace.
_FORBIDDEN = re.compile("[\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")


def reject_controls(raw: str, what: str) -> None:
    """Reject C0/C1 controls and every kind of whitespace (they split or smuggle in other parsers)."""
    found = _FORBIDDEN.search(raw)
    if found is None:
        return
    o = ord(found.group())
    if o < 0x20 or 0x7F <= o < 0xA0:
        raise CanonError("control_char", f"{what} contains control character U+{o:04X}: {show(raw)}")
    raise CanonError("whitespace", f"{what} contains whitespace U+{o:04X}: {show(raw)}")
