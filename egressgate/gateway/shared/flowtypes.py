"""The types FlowState's and Runtime's fields use (context.py), kept with no gateway imports.

They used to live in the stage modules that create them (credential_response.Applied, ws_layer.Refusal,
limit_audit.LimitAudit), so context.py imported stage modules and every stage imported every other one
through it (an import circle of 17 modules, issue 25). Here they depend on nothing of the gateway, so
context.py reaches no stage (tests/architecture/test_stage_imports.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from egressgate.broker.credential import Credential
from egressgate.broker.redact import SecretSpec
from egressgate.policy.reasons import Reason


@dataclass(slots=True, repr=False)
class Applied:
    """The credential placed on a flow (credentials.py); what its response is scrubbed of
    (credential_response.py). repr never shows the value."""

    capability: str
    credential: Credential
    username: str | None

    def spec(self) -> SecretSpec:
        return SecretSpec(self.credential.value, self.username)

    def __repr__(self) -> str:
        return f"Applied(capability={self.capability!r}, key_id={self.credential.key_id!r})"


@dataclass(frozen=True, slots=True)
class WsRefusal:
    """Why the gateway closed a websocket (ws_layer.refuse): the reason code (audit + Close reason) and a
    sentence."""

    reason: Reason
    code: int  # the Close code sent to both peers
    message: str
    detail: str | None = None

    def close_reason(self) -> str:
        """What the sandbox reads in the Close frame (wsproto truncates to 123 bytes; code first)."""
        return f"egressgate {self.reason}: {self.message}"


class LimitRecords(Protocol):
    """The rate-limited audit of limit events (limit_audit.LimitAudit), as other layers use it."""

    def record(
        self,
        reason: Reason,
        source: str,
        message: str,
        *,
        sandbox_id: str | None = None,
        request_id: str | None = None,
        extra: dict | None = None,
    ) -> None: ...

    def close(self) -> None: ...
