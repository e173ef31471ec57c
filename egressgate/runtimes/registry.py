"""Runtime adapters by name, imported lazily (`sandbox run` loads only the one it runs: start-up time).
A runtime is added by one line here: name → "module:factory" (a zero-argument callable)."""

from __future__ import annotations

import importlib

from egressgate.policy.enforcement import RUNTIME_KEYS
from egressgate.runtimes.base import RuntimeAdapter

ADAPTERS: dict[str, str] = {
    "netns": "egressgate.runtimes.netns:NetnsAdapter",
    "docker": "egressgate.runtimes.docker:DockerAdapter",
    "gvisor": "egressgate.runtimes.docker:GvisorAdapter",
    "microvm": "egressgate.runtimes.microvm.adapter:MicrovmAdapter",
}

# Which runtime-enforced policy keys (policy/enforcement.py, `by: runtime`) each runtime enforces; `sandbox
# run` refuses (exit 120) a policy that sets one its runtime does not. netns, docker and gVisor enforce them
# all (checked by reading the code: netns.py/sandbox_fs.py/limits.py, docker.py/dockermasks.py, and run.py,
# workload.py, diskfs.py, persist.py for every runtime). A new runtime (the microVM one) declares its own
# set here, one line next to its ADAPTERS line: a key it does not enforce is left out, never assumed.
ENFORCES: dict[str, frozenset[str]] = {
    "netns": RUNTIME_KEYS,
    "docker": RUNTIME_KEYS,
    "gvisor": RUNTIME_KEYS,
    # the guest gets no host path but its workspace (microvm/adapter.py refuses filesystem.allow host paths)
    "microvm": RUNTIME_KEYS - {"filesystem.allow[].path", "filesystem.allow[].read", "filesystem.allow[].write"},
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
