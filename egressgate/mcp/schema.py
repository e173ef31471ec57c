"""Hashes that pin what an MCP server is: its tools (as listed) and its identity (serverInfo).

A tool's hash covers the WHOLE tool object as `tools/list` returned it (name, title, description,
inputSchema, outputSchema, annotations, _meta ...): a changed description is drift too, because the
description is what the model reads (tool poisoning rewrites it and leaves the schema alone).

Canonical JSON (stated once, used for tool pins and for the audit's arguments hash): keys sorted by
code point, separators "," and ":", no insignificant whitespace, UTF-8 without escaping non-ASCII,
integers as integers, floats as Python's shortest repr. An operator computes a pin with
`python -c 'import json,hashlib,sys; t=json.load(sys.stdin); print(hashlib.sha256(json.dumps(t,
sort_keys=True,separators=(",",":"),ensure_ascii=False).encode()).hexdigest())'` over the tool object.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def sha256_hex(value: Any) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def tool_hash(tool: dict) -> str:
    """sha256 hex of the canonical JSON of the whole tool object."""
    return sha256_hex(tool)


def arguments_hash(arguments: Any) -> str:
    """The audit's `egressgate.mcp.arguments_sha256`: the same canonical JSON, of the decided arguments."""
    return sha256_hex(arguments)


def server_info(initialize_result: Any) -> tuple[str, str] | None:
    """(name, version) from an `initialize` result, or None when it carries no usable serverInfo (a
    pinned server then does not match: None is never equal to a pin)."""
    if not isinstance(initialize_result, dict):
        return None
    info = initialize_result.get("serverInfo")
    if not isinstance(info, dict):
        return None
    name, version = info.get("name"), info.get("version")
    if not isinstance(name, str) or not isinstance(version, str):
        return None
    return name, version


SERVER_INFO_STAMP = "io.modelcontextprotocol/serverInfo"  # MCP 2026-07-28: in every result's _meta


def stamped_server_info(result: Any) -> tuple[str, str] | None:
    """(name, version) from the serverInfo stamp a 2026-07-28 server puts in every result's `_meta`
    (`server/discover` replaces `initialize` there: the SDK's default client never sends `initialize`),
    or None when the result carries no usable stamp."""
    meta = result.get("_meta") if isinstance(result, dict) else None
    return server_info({"serverInfo": meta.get(SERVER_INFO_STAMP)}) if isinstance(meta, dict) else None


def tools_of(list_result: Any) -> list[dict] | None:
    """The `tools` array of a tools/list result, or None when it is not a list of named objects (the
    mediator then refuses the answer instead of guessing which tools the client will see)."""
    if not isinstance(list_result, dict):
        return None
    tools = list_result.get("tools")
    if not isinstance(tools, list):
        return None
    if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
        return None
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        return None  # two tools of one name: which one would a call run?
    return tools
