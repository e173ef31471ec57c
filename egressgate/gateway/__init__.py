"""The egress gateway: mitmproxy embedded as a library, one addon module per concern.

Start-up cost: importing any `mitmproxy.addons.X` (and `mitmproxy.master`, which imports
`mitmproxy.addons.termlog`) first runs the package's `__init__`, which imports all ~40 default addons
of mitmdump: flask (onboarding), ldap3 (proxyauth), the script loader, the browser launcher ... None of
them is one of ours: the gateway builds its Master with its own addon list (gateway/master.py). Loading
them anyway cost ~0.25 CPU-seconds and ~320 modules of every gateway start (and of every worker,
`sandbox run` and test process that imports the gateway). So, unless something in this process already
imported the package, it is registered here as a namespace-only package: `from mitmproxy.addons import
proxyserver` loads exactly that module. Nothing in mitmproxy outside `mitmproxy.tools` (not used here)
reads the package's own attributes (`default_addons`).
"""

from __future__ import annotations

import importlib.util
import sys
import types


def _lean_mitmproxy_addons() -> None:
    name = "mitmproxy.addons"
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        return  # mitmproxy missing or reshaped: the normal import will say so
    package = types.ModuleType(name, "mitmproxy's addons, without the default-addon imports of its __init__")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__package__ = name
    sys.modules[name] = package


_lean_mitmproxy_addons()
