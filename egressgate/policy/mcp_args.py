"""Argument constraints of an allowed tool, checked on the decoded JSON arguments of one `tools/call`.

Values are the parser's Python objects (strings already decoded from `\\u` escapes, numbers as int or
float). Every check is exact and typed: `True` is not the integer 1 (Python says `True == 1`; JSON says
otherwise), an enum matches a value of the same JSON type only, a pattern must match the WHOLE string
(fullmatch: `^a$` does not accept `a\\n`), and a check that cannot apply to the value's type refuses it.
What is reported back is the argument's name and a short detail, never the value: values may be secrets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from egressgate.policy.mcp_compile import McpArgument, McpTool
from egressgate.policy.mcp_path import PathRefused, canon_tool_path, under_prefix

# A policy regex runs on sandbox-controlled input: bound its input so a backtracking pattern stays cheap.
MAX_PATTERN_INPUT = 8192
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.$-]{1,64}")
UNLISTED = "<unlisted argument>"  # reported instead of a name that is not safe to echo


@dataclass(frozen=True, slots=True)
class ArgumentFailure:
    argument: str  # the argument's name (or UNLISTED), never its value
    detail: str  # machine detail: missing, unlisted, type, enum, pattern, min, max, max_length,
    #              path:<code>, path_prefix, label_missing, label_mismatch, network:<reason>, not_object


UrlCheck = Callable[[str], str | None]  # value -> None when the sandbox could fetch it, else a reason


def check_arguments(
    tool: McpTool, arguments: Any, labels: Mapping[str, str], url_check: UrlCheck
) -> ArgumentFailure | None:
    """None when every constraint of `tool` holds for `arguments`, else the first failure."""
    if not isinstance(arguments, Mapping):
        return ArgumentFailure("<arguments>", "not_object")
    if not tool.unlisted_allowed:
        for name in arguments:
            if name not in tool.arguments:
                shown = name if isinstance(name, str) and _SAFE_NAME.fullmatch(name) else UNLISTED
                return ArgumentFailure(shown, "unlisted")
    for name, spec in tool.arguments.items():
        if name not in arguments:
            if spec.required:
                return ArgumentFailure(name, "missing")
            continue
        detail = _check_value(spec, arguments[name], labels, url_check)
        if detail is not None:
            return ArgumentFailure(name, detail)
    return None


def _is_number(value: Any) -> bool:
    if type(value) is int:
        return True
    return type(value) is float and math.isfinite(value)


_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: type(v) is str,
    "integer": lambda v: type(v) is int,  # bool is a subclass of int in Python, never an integer here
    "number": _is_number,
    "boolean": lambda v: type(v) is bool,
    "object": lambda v: isinstance(v, Mapping),
    "array": lambda v: type(v) is list,
    "null": lambda v: v is None,
}


def _check_value(spec: McpArgument, value: Any, labels: Mapping[str, str], url_check: UrlCheck) -> str | None:
    if spec.type is not None and not _TYPES[spec.type](value):
        return "type"
    if spec.enum is not None and not any(type(value) is type(e) and value == e for e in spec.enum):
        return "enum"
    if spec.min is not None or spec.max is not None:
        if not _is_number(value):
            return "type"
        if spec.min is not None and value < spec.min:
            return "min"
        if spec.max is not None and value > spec.max:
            return "max"
    if not spec.needs_string:
        return None
    if type(value) is not str:
        return "type"
    if spec.max_length is not None and len(value) > spec.max_length:
        return "max_length"
    if spec.pattern is not None and (len(value) > MAX_PATTERN_INPUT or spec.pattern.fullmatch(value) is None):
        return "pattern"
    if spec.path_prefix is not None:
        try:
            path = canon_tool_path(value)
        except PathRefused as exc:
            return f"path:{exc.code}"
        if not under_prefix(path, spec.path_prefix):
            return "path_prefix"
    if spec.equals_label is not None:
        expected = labels.get(spec.equals_label)
        if not expected:
            return "label_missing"  # no label, no tenant: nothing can equal it
        if value != expected:
            return "label_mismatch"
    if spec.allowed_by_network:
        refused = url_check(value)
        if refused is not None:
            return f"network:{refused}"
    return None
