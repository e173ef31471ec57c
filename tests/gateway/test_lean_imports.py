"""The gateway loads only the mitmproxy addons it uses (egressgate/gateway/__init__.py says why): flask and
ldap3 (mitmdump's onboarding and proxyauth addons) stay out of every gateway process. Positive control: the
same import of mitmproxy's master without egressgate.gateway first pulls them in."""

from __future__ import annotations

import subprocess
import sys

PROBE = "import sys; {imports}; print(sorted(m for m in ('flask', 'ldap3') if m in sys.modules))"


def loaded(imports: str) -> str:
    res = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True, text=True,
                         timeout=120, check=True)
    return res.stdout.strip()


def test_the_gateway_does_not_import_mitmdumps_default_addons() -> None:
    assert loaded("import egressgate.gateway.service.app") == "[]"


def test_positive_control_mitmproxy_alone_imports_them() -> None:
    assert loaded("import mitmproxy.master") == "['flask', 'ldap3']"
