"""The one shape of every error the control API answers: `{"error": <code>, "message": <one sentence>}`.

Codes are stable snake_case identifiers (clients branch on them); the message says what to do. Extra
members may follow (e.g. `policies` on an unknown policy) but these two are always there
(docs/openapi.yaml, `Error`).
"""

from __future__ import annotations

from aiohttp import web


def error_response(status: int, code: str, message: str, **extra: object) -> web.Response:
    return web.json_response({"error": code, "message": message, **extra}, status=status)


def state_unavailable() -> web.Response:
    return error_response(503, "state_unavailable",
                          "the state store (registry and budgets) did not answer; retry when /readyz is ready")
