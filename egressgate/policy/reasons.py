"""Reason codes for every decision egressgate makes.

These strings are a public contract: they appear in deny bodies, audit records and `policy explain`
output, and operators write alerts against them. Add codes; never rename or reuse one.
"""

from __future__ import annotations

from enum import StrEnum


class Effect(StrEnum):
    ALLOW = "allow"
    DENY = "deny"


class Reason(StrEnum):
    # allow
    RULE_MATCHED = "rule_matched"
    APPROVAL_GRANTED = "approval_granted"  # outside the rules, allowed by a live operator approval
    # policy-level denials
    HOST_NOT_ALLOWED = "host_not_allowed"
    SCHEME_NOT_ALLOWED = "scheme_not_allowed"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    PATH_NOT_ALLOWED = "path_not_allowed"
    PATH_AMBIGUOUS = "path_ambiguous"  # a path deny rule cannot tell how the upstream would read the path
    PORT_NOT_ALLOWED = "port_not_allowed"
    QTYPE_NOT_ALLOWED = "qtype_not_allowed"
    DENIED_BY_RULE = "denied_by_rule"
    CONDITION_FAILED = "condition_failed"
    BUDGET_EXCEEDED = "budget_exceeded"
    APPROVAL_REQUIRED = "approval_required"  # outside the allowlist; the policy lets an operator approve it
    PACKAGE_INSTALL_DENIED = "package_install_denied"  # a package-manager request under package_install: deny
    # address checks
    ADDRESS_FORBIDDEN = "address_forbidden"
    METADATA_ENDPOINT = "metadata_endpoint"
    SELF_CONNECTION = "self_connection"
    # request shape / consistency
    INVALID_REQUEST = "invalid_request"
    HOST_MISMATCH = "host_mismatch"
    PROTOCOL_NOT_ALLOWED = "protocol_not_allowed"
    MESSAGE_TOO_LARGE = "message_too_large"  # a websocket message over websocket.max_message_bytes
    TRAILERS_NOT_ALLOWED = "trailers_not_allowed"  # request trailers (HTTP/1 chunked or HTTP/2): never forwarded
    # identity
    IDENTITY_UNKNOWN = "identity_unknown"
    SANDBOX_REVOKED = "sandbox_revoked"
    IDENTITY_ADDRESS_MISMATCH = "identity_address_mismatch"  # a token from outside its admitted addresses
    # dependencies (fail closed)
    CREDENTIAL_UNAVAILABLE = "credential_unavailable"
    CREDENTIAL_MISUSE = "credential_misuse"
    AUDIT_UNAVAILABLE = "audit_unavailable"
    STATE_UNAVAILABLE = "state_unavailable"
    POLICY_UNAVAILABLE = "policy_unavailable"
    UPSTREAM_UNRESOLVABLE = "upstream_unresolvable"
    # connection limits and timeouts (gateway/pipeline/connguard.py, `limits:` in the gateway config)
    CONNECTION_LIMIT = "connection_limit"
    HEADER_TIMEOUT = "header_timeout"
    HEADER_TOO_LARGE = "header_too_large"
    TLS_HANDSHAKE_TIMEOUT = "tls_handshake_timeout"
    CLIENT_HELLO_TOO_LARGE = "client_hello_too_large"  # over limits.max_client_hello_bytes (tls_limits.py)
    INTERNAL_ERROR = "internal_error"  # a gateway component failed on this request: refused, never passed
    # MCP tool calls (policy/mcp_decide.py; the `mcp:` policy section)
    MCP_TOOL_DENIED = "mcp_tool_denied"  # tool in tools.deny, not in tools.allow, or server not in the policy
    MCP_ARGUMENT_DENIED = "mcp_argument_denied"  # an argument constraint does not hold
    MCP_SCHEMA_DRIFT = "mcp_schema_drift"  # the tool's schema hash differs from its pin / first sight
    MCP_SERVER_CHANGED = "mcp_server_changed"  # serverInfo differs from its pin / first sight
    MCP_MALFORMED = "mcp_malformed"  # a JSON-RPC body that does not parse strictly: refused whole
    MCP_LOCAL_DENIED = "mcp_local_denied"  # a local MCP server the policy does not allow to start
    # persistent workspaces (runtimes/persist.py): a workspace changed outside a run is not restored
    WORKSPACE_CHANGED = "workspace_changed"
