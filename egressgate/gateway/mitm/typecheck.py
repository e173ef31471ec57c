"""mitmproxy's type check of every HTTP message, with the same verdicts at a fraction of the cost.

Why: `mitmproxy.http.MessageData.__post_init__` (run for every Request and Response mitmproxy builds,
so twice per proxied request) checks each field with `typecheck.check_option_type`, which calls
`dataclasses.fields` and `typing.get_origin` and builds a TypeError message for every field, even the
ones that pass: ~4 % of the gateway's CPU on plain HTTP (issue 11 profiles). The check is worth keeping
(it catches a str where bytes belong before it reaches the wire), so it is not switched off; it is
answered from a table of accepted types per class, built once from the same annotations.

Same verdicts: a value is accepted here only when `isinstance` matches a type mitmproxy's check accepts
for that annotation (each member of a union, `float` also taking `int`, `Any` taking anything);
anything else, and any annotation this module does not understand, goes to mitmproxy's own check,
which accepts it or raises its own TypeError. tests/gateway/test_typecheck.py compares both.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from mitmproxy import http
from mitmproxy.utils import typecheck

_Accepted = tuple[type, ...] | None  # None: ask mitmproxy's check every time
_TABLE: dict[type, tuple[tuple[str, _Accepted, Any], ...]] = {}
_original_post_init = getattr(http.MessageData, "__post_init__", None)


def accepted_types(annotation: Any) -> _Accepted:
    """The types whose instances mitmproxy's check_option_type accepts for `annotation` without
    looking further, or None when the annotation needs its full logic (tuples, sequences, IO...)."""
    if annotation is typing.Any:
        return (object,)
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        out: list[type] = []
        for member in typing.get_args(annotation):
            sub = accepted_types(member)
            if sub is None:
                return None
            out.extend(sub)
        return tuple(out)
    if origin is not None or not isinstance(annotation, type):
        return None
    if annotation is float:
        return (float, int)
    return (annotation,)


def _checks(cls: type) -> tuple[tuple[str, _Accepted, Any], ...]:
    found = _TABLE.get(cls)
    if found is None:
        found = _TABLE[cls] = tuple((f.name, accepted_types(f.type), f.type) for f in dataclasses.fields(cls))
    return found


def _post_init(self: Any) -> None:
    for name, accepted, annotation in _checks(type(self)):
        value = getattr(self, name)
        if accepted is None or not isinstance(value, accepted):
            typecheck.check_option_type(name, value, annotation)  # mitmproxy's verdict (and its error)


def install() -> bool:
    """Replace MessageData's check in this process; False when mitmproxy has none (python -O)."""
    if _original_post_init is None:
        return False
    http.MessageData.__post_init__ = _post_init  # type: ignore[attr-defined]
    return True
