"""Runtime adapters by name, imported lazily (`sandbox run` loads only the one it runs: start-up time).
A runtime is added by one line here: name → "module:factory" (a zero-argument callable)."""

from __future__ import annotations

import importlib

from egressgate.runtimes.base import RuntimeAdapter

ADAPTERS: dict[str, str] = {
    "netns": "egressgate.runtimes.netns:NetnsAdapter",
    "docker": "egressgate.runtimes.docker:DockerAdapter",
    "gvisor": "egressgate.runtimes.docker:GvisorAdapter",
    "microvm": "egressgate.runtimes.microvm.adapter:MicrovmAdapter",
}


class UnknownRuntime(LookupError):
    pass


def adapter(name: str) -> RuntimeAdapter:
    try:
        target = ADAPTERS[name]
    except KeyError:
        raise UnknownRuntime(f"unknown runtime {name!r}; known: {', '.join(sorted(ADAPTERS))}") from None
    module, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownRuntime(f"runtime {name!r} is not available in this build ({exc})") from None
    return factory()
