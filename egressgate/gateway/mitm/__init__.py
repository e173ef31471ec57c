"""Faster equivalents of mitmproxy internals every flow pays for: hook dispatch, task helpers, typecheck."""
