"""The policy language: a strict pydantic schema.

The article's policy (policies/seed-invoice-analysis.yaml) must load unchanged, so its keys and nesting
are the core of this schema; everything egressgate adds is optional. Every model forbids unknown keys
and is strict about types: a typo in a security policy must be an error naming the key path, never a
silently ignored rule. Semantic checks that need canonicalization (hosts, globs, credential bindings)
live in compiler.py, which reports errors in the same `file: key.path[i]: message` form.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from egressgate.broker.config import Capability
from egressgate.policy.mcp_model import McpSection
from egressgate.policy.persistence import Persistence

PositiveInt = Annotated[int, Field(strict=True, gt=0)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
Port = Annotated[int, Field(strict=True, ge=1, le=65535)]
RuleId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")]
SandboxName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$")]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# --- sandbox ------------------------------------------------------------------------------------


class Workspace(Strict):
    path: str
    persistent: bool = False
    max_bytes: PositiveInt | None = None


class Tmp(Strict):
    """The sandbox's /tmp: a tmpfs of at most max_bytes (and max_bytes / 4096 inodes, at least 1024)."""

    max_bytes: PositiveInt = 256 * 1024 * 1024


class Resources(Strict):
    cpu_millis: PositiveInt | None = None
    memory_mb: PositiveInt | None = None
    pids_max: PositiveInt | None = None
    wall_time_seconds: PositiveInt | None = None
    outbound_bytes_max: PositiveInt | None = None


class SandboxSection(Strict):
    name: SandboxName
    root_fs: Literal["read_only", "read_write"] = "read_only"
    workspace: Workspace | None = None
    tmp: Tmp = Tmp()
    resources: Resources = Resources()


# --- filesystem (enforced by runtime adapters, carried here so one file describes a sandbox) ---


class FilesystemAllow(Strict):
    path: str
    read: bool = False
    write: bool = False


class Filesystem(Strict):
    allow: list[FilesystemAllow] = []
    deny: list[str] = []


# --- network ------------------------------------------------------------------------------------


class Conditions(Strict):
    """`when:` on a rule. All listed conditions must hold (AND); lists inside one condition are OR."""

    labels: dict[str, str | list[str]] | None = None
    sandbox: list[str] | None = None  # sandbox ids
    within_seconds: PositiveInt | None = None  # elapsed since admission < N
    after_seconds: NonNegativeInt | None = None  # elapsed since admission >= N
    after_request_to: list[str] | None = None  # the sandbox earlier made an allowed request to one of these
    unless_request_to: list[str] | None = None  # ...and never to any of these


class Budget(Strict):
    """Per-rule budget over the sandbox's lifetime."""

    requests: PositiveInt | None = None
    bytes: PositiveInt | None = None


class HttpRule(Strict):
    id: RuleId | None = None
    host: str
    except_hosts: list[str] = []
    ports: list[Port] | None = None
    methods: list[str] | None = None
    paths: list[str] | None = None
    # query parameter name -> values (policy/querymatch.py: allow rules require one of them, deny rules refuse them)
    query: dict[str, list[str]] | None = None
    credential: str | None = None
    when: Conditions | None = None
    budget: Budget | None = None
    # network.https allow rules only (compiler.py): `passthrough` splices the client's TLS to the pinned
    # address without interception, after checking the ClientHello's SNI names the CONNECT host; such a
    # rule can carry nothing that needs to read HTTP (docs/policy.md, "Passthrough routes").
    tls: Literal["intercept", "passthrough"] | None = None


class TcpRule(Strict):
    id: RuleId | None = None
    host: str
    except_hosts: list[str] = []
    ports: list[Port]
    when: Conditions | None = None
    budget: Budget | None = None


class HttpRules(Strict):
    allow: list[HttpRule] = []
    deny: list[HttpRule] = []


class TcpRules(Strict):
    allow: list[TcpRule] = []
    deny: list[TcpRule] = []


DEFAULT_QUERY_TYPES = ("A", "AAAA", "CNAME", "HTTPS", "SVCB")


class DnsBudget(Strict):
    queries: PositiveInt | None = None
    name_bytes: PositiveInt | None = None
    per_second: Annotated[float, Field(gt=0)] | None = None


class DnsSection(Strict):
    allow: list[str] = []
    deny_rcode: Literal["NXDOMAIN", "REFUSED"] = "NXDOMAIN"
    # a name not allowed: "gateway" answers the gateway's address (its transparent listener then answers the
    # request with the deny body; no upstream query), "rcode" answers deny_rcode (docs/policy.md)
    deny_answer: Literal["gateway", "rcode"] = "gateway"
    query_types: list[str] = list(DEFAULT_QUERY_TYPES)
    budget: DnsBudget | None = None


class Network(Strict):
    default: Literal["deny"] = "deny"
    allow_private: list[str] = []
    dns: DnsSection = DnsSection()
    https: HttpRules = HttpRules()
    http: HttpRules = HttpRules()
    tcp: TcpRules = TcpRules()
    metadata_endpoints: Literal["deny"] = "deny"


# --- credentials / execution ----------------------------------------------------------------------


class Credentials(Strict):
    inject_via: Literal["egress_gateway"] = "egress_gateway"
    agent_visibility: Literal["none"] = "none"
    max_ttl_seconds: Annotated[int, Field(strict=True, gt=0, le=3600)] = 300
    capabilities: dict[str, Capability] = {}


class Execution(Strict):
    commands: list[str] = []
    # enforced by the gateway on requests recognised as package installs (policy/opclass.py); "approval":
    # each one waits for an operator (approval kind package_install)
    package_install: Literal["allow", "deny", "approval"] = "deny"
    local_mcp_servers: Literal["allow", "deny"] = "deny"
    require_approval_for: list[str] = []


class Policy(Strict):
    sandbox: SandboxSection
    description: str | None = None
    filesystem: Filesystem = Filesystem()
    network: Network = Network()
    credentials: Credentials = Credentials()
    execution: Execution = Execution()
    mcp: McpSection = McpSection()  # MCP servers and tool-call rules (mcp_model.py)
    persistence: Persistence | None = None  # what a persistent workspace keeps (policy/persistence.py)
