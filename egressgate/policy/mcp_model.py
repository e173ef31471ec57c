"""The `mcp:` section of a policy: which MCP servers a sandbox may use, which tools, with which arguments.

Strict like the rest of the policy language (model.py): unknown keys and wrong types are load errors that
name the key path, never an ignored constraint. Checks that need more than a type (regexes compile, the
server's URL is canonical and allowed by a network rule, names are unique, `min <= max`...) are in
mcp_compile.py, reported in the same `file: key.path: message` form.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# model.py imports this module (Policy.mcp), so the two shared definitions are repeated here, not imported.
PositiveInt = Annotated[int, Field(strict=True, gt=0)]
RuleId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


ServerName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]
# MCP tool names are case-sensitive ASCII identifiers (the spec suggests A-Z a-z 0-9 _ - .); a policy names
# them exactly, so a look-alike (full-width, zero-width joiner, other case) in a call is simply not listed.
ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_./-]{1,128}$")]
ArgumentName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.$-]{1,128}$")]
LabelKey = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Number = int | float
JsonScalar = str | int | float | bool | None

DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
MAX_MESSAGE_BYTES_LIMIT = 64 * 1024 * 1024


class ArgumentConstraint(Strict):
    """Checks on one top-level argument of `tools/call`, on its decoded JSON value. All listed checks
    must hold; a check that cannot apply to the value's type (a pattern on a number) refuses it."""

    type: Literal["string", "integer", "number", "boolean", "object", "array", "null"] | None = None
    enum: list[JsonScalar] | None = None
    pattern: str | None = None  # Python `re`, matched against the WHOLE value (fullmatch)
    min: Number | None = None
    max: Number | None = None
    max_length: Annotated[int, Field(strict=True, ge=0)] | None = None  # code points of a string
    path_prefix: str | None = None  # an absolute path; the value must be under it, in plain canonical form
    allowed_by_network: bool = False  # a URL/host the sandbox's own network policy would let it fetch
    equals_label: LabelKey | None = None  # must equal the value of this sandbox label (tenant ids)
    required: bool = False


class McpBudget(Strict):
    """Calls over the sandbox's lifetime (counted when a call is allowed)."""

    calls: PositiveInt


class ToolAllow(Strict):
    name: ToolName
    id: RuleId | None = None  # default `mcp:<server>/<tool>`
    budget: McpBudget | None = None
    approval: Literal["required", "none"] = "none"
    unlisted_arguments: Literal["allow", "deny"] = "deny"
    arguments: dict[ArgumentName, ArgumentConstraint] = {}


class ToolRules(Strict):
    allow: list[ToolAllow] = []
    deny: list[ToolName] = []


class ServerInfoPin(Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    version: Annotated[str, Field(min_length=1, max_length=256)]


class McpServerModel(Strict):
    name: ServerName
    url: str | None = None  # remote: the streamable HTTP endpoint, or the SSE GET endpoint
    local: bool = False  # started by `egressgate mcp run --server NAME -- CMD...`
    transport: Literal["streamable_http", "sse"] | None = None  # remote only; default streamable_http
    server_info: ServerInfoPin | None = None
    tool_schemas: dict[ToolName, Sha256Hex] = {}
    trust_on_first_use: bool = True
    budget: McpBudget | None = None
    tools: ToolRules = ToolRules()


class McpSection(Strict):
    record_arguments: bool = False
    max_message_bytes: Annotated[int, Field(strict=True, gt=0, le=MAX_MESSAGE_BYTES_LIMIT)] = (
        DEFAULT_MAX_MESSAGE_BYTES)
    servers: list[McpServerModel] = []
