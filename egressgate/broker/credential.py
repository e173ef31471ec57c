"""The value object the broker hands the gateway, and the one error the gateway turns into a deny.

A `Credential` travels through code that logs, formats and audits things; its `repr`/`str` therefore
show the capability name and key id only. The value is reachable solely as `.value`, so a secret can
only leak through code that asks for it by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class CredentialUnavailable(RuntimeError):
    """The backend could not produce the credential (unreachable, denied, missing field).

    The gateway denies the request with reason `credential_unavailable`. Messages never contain a value.
    """


@dataclass(frozen=True, slots=True, repr=False, eq=False)
class Credential:
    capability: str
    value: str = field(repr=False)
    key_id: str
    issued_at: float
    expires_at: float

    def __repr__(self) -> str:
        return (
            f"Credential(capability={self.capability!r}, key_id={self.key_id!r}, "
            f"issued_at={self.issued_at}, expires_at={self.expires_at}, value=<redacted>)"
        )

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)

    def __reduce__(self):  # pickling would copy the value into caches, queues or crash dumps
        raise TypeError("Credential cannot be pickled")

    def reusable(self, now: float, fraction: float) -> bool:
        """True while less than `fraction` of the lifetime has elapsed (reuse, do not mint again)."""
        return now < self.issued_at + fraction * (self.expires_at - self.issued_at)
