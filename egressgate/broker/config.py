"""Schema of credential capabilities (policy `credentials.capabilities`) and of the broker itself.

A capability is what a policy rule names with `credential:`; it says where the secret comes from and
where the gateway puts it, never the secret. The models are strict and forbid unknown keys because a typo
in a credential binding (say `heder:`) must be a load error, not a request sent without, or with a
misplaced, credential. `policy/model.py` embeds the `Capability` union; `BrokerConfig` is part of the
gateway config (the sandbox never sees either).
"""

from __future__ import annotations

import re
import string
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

# RFC 9110 token characters: a header name outside this set would be a request-smuggling vector.
_HEADER_NAME = r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,128}$"
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
# Names the gateway owns or that change message framing; a capability must never write them.
_FORBIDDEN_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "proxy-connection",
        "keep-alive",
        "cookie",
    }
)

PositiveInt = Annotated[int, Field(strict=True, gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# --- sources ------------------------------------------------------------------------------------


class VaultSecretRef(_Strict):
    """A field of a KV v2 secret: `secret/data/<path>` -> data[<field>]."""

    path: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-/]+$")]
    field: Annotated[str, Field(min_length=1)]
    mount: str | None = None  # default: BrokerConfig.kv_mount

    @field_validator("path")
    @classmethod
    def _no_traversal(cls, v: str) -> str:
        if v.startswith("/") or ".." in v.split("/"):
            raise ValueError("vault path must be relative and must not contain '..'")
        return v


class VaultSource(_Strict):
    vault: VaultSecretRef


class FileSource(_Strict):
    """A file holding exactly the secret (one trailing newline is dropped); must be mode 0600 or stricter."""

    file: Annotated[str, Field(min_length=1)]


# --- placements ---------------------------------------------------------------------------------


class HeaderPlacement(_Strict):
    header: Annotated[str, Field(pattern=_HEADER_NAME)]
    format: str = "{value}"

    @field_validator("header")
    @classmethod
    def _allowed_header(cls, v: str) -> str:
        if v.lower() in _FORBIDDEN_HEADERS:
            raise ValueError(f"header {v!r} is owned by the gateway and cannot carry a credential")
        return v

    @field_validator("format")
    @classmethod
    def _one_value_field(cls, v: str) -> str:
        fields = [f for _, f, _, _ in string.Formatter().parse(v) if f is not None]
        if fields != ["value"]:
            raise ValueError("format must contain exactly one '{value}' and no other '{...}' field")
        if re.search(r"[\x00-\x1f\x7f]", v):
            raise ValueError("format must not contain control characters")
        return v

    def render(self, value: str) -> str:
        # str.format does not re-parse the substituted value, so braces inside a secret are safe.
        return self.format.format(value=value)


class BasicAuth(_Strict):
    username: Annotated[str, Field(pattern=r"^[^:\x00-\x1f\x7f]*$")]


class BasicPlacement(_Strict):
    """HTTP basic auth: `Authorization: Basic base64(username:value)`."""

    basic: BasicAuth


class QueryPlacement(_Strict):
    query: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-~]+$")]


Placement = HeaderPlacement | BasicPlacement | QueryPlacement

_DEFAULT_PLACEMENT = HeaderPlacement(header="Authorization", format="Bearer {value}")


# --- capabilities -------------------------------------------------------------------------------


class _CapabilityBase(_Strict):
    placement: Placement = _DEFAULT_PLACEMENT
    mode: Literal["always", "phantom"] = "always"
    phantom_env: Annotated[str, Field(pattern=_ENV_NAME)] | None = None

    @model_validator(mode="after")
    def _phantom_shape(self) -> _CapabilityBase:
        if self.mode == "phantom":
            if not isinstance(self.placement, HeaderPlacement):
                raise ValueError("mode phantom needs a header placement (the phantom is swapped in a header)")
            if self.phantom_env is None:
                raise ValueError("mode phantom needs phantom_env (the variable admission hands the sandbox)")
        elif self.phantom_env is not None:
            raise ValueError("phantom_env is only meaningful with mode: phantom")
        return self


class StaticCapability(_CapabilityBase):
    """A long-lived secret fetched from KV v2 or a local file; `ttl_seconds` is how long it is cached."""

    type: Literal["static"]
    source: VaultSource | FileSource
    ttl_seconds: PositiveInt = 300


class JwtCapability(_CapabilityBase):
    """A JWT minted per (sandbox, audience); aud = `audience` or, when unset, the destination host."""

    type: Literal["jwt"]
    audience: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    ttl_seconds: PositiveInt = 300  # clamped to credentials.max_ttl_seconds at issue time


class VaultOidcCapability(_CapabilityBase):
    """A Vault identity OIDC token for a named role (its audience is the role's client_id)."""

    type: Literal["vault_oidc"]
    role: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")]


Capability = Annotated[StaticCapability | JwtCapability | VaultOidcCapability, Field(discriminator="type")]


# --- broker -------------------------------------------------------------------------------------


class BrokerConfig(_Strict):
    """How the gateway reaches its secrets. Credentials for Vault come from here or the gateway's env."""

    backend: Literal["local", "vault"] = "local"
    issuer: Annotated[str, Field(min_length=1)] = "egressgate"
    # local backend
    local_key_dir: str = "./var/keys"
    # vault / openbao backend
    vault_addr: Annotated[str, Field(pattern=r"^https?://[^\s/]+(/.*)?$")] | None = None
    auth: Literal["approle", "token"] = "approle"
    approle_mount: str = "approle"
    role_id: SecretStr | None = None  # else env EGRESSGATE_VAULT_ROLE_ID
    secret_id: SecretStr | None = None  # else secret_id_file, else env EGRESSGATE_VAULT_SECRET_ID
    secret_id_file: str | None = None
    token_file: str | None = None  # auth: token; else env EGRESSGATE_VAULT_TOKEN
    kv_mount: str = "secret"
    transit_mount: str = "transit"
    transit_key: str = "egressgate-jwt"
    ca_bundle: str | None = None
    timeout_seconds: Annotated[float, Field(gt=0, le=60)] = 5.0
    renew_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.66  # renew the token at this share of its TTL
    # cache
    reuse_fraction: Annotated[float, Field(gt=0, le=1)] = 0.8
    cache_max_entries: PositiveInt = 10000

    @model_validator(mode="after")
    def _vault_needs_addr(self) -> BrokerConfig:
        if self.backend == "vault" and not self.vault_addr:
            raise ValueError("backend vault needs vault_addr")
        return self
