"""`sandbox run --runtime netns`: the gateway's sandbox bundle is where programs look by default (issue 21 item
3), so clients with NO CA flag or variable of their own trust what the gateway CA signed.

Inside the sandbox (tests/runtimes/trust_probe.py, every CA variable removed first): each system trust file
holds the gateway's bundle byte for byte; Python's default context, an OpenSSL CApath-only context and a
context per file, and the host's curl, wget, git and `node --use-openssl-ca`, each with its defaults only,
verify a server on the sandbox's loopback whose leaf the gateway CA signed, and refuse one signed by another
CA (the positive control that they verify at all). Plain node is asserted to refuse the gateway's leaf: it
reads only its compiled-in roots and NODE_EXTRA_CA_CERTS (which `sandbox run` sets; docs/runtimes.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import trustme

from egressgate.runtimes import truststore
from tests.runtimes.harness import Gateway
from tests.runtimes.trust_support import check_probe_output, gateway_leaf, probe_dir

pytestmark = pytest.mark.netns


def test_netns_clients_trust_the_gateway_by_default_paths(gateway: Gateway, host_files: Path) -> None:
    ca_dir = gateway.base / "var" / "ca"
    bundle = (ca_dir / "sandbox-ca-bundle.pem").read_bytes()
    probe = host_files / "trust-probe"
    probe_dir(probe, trustme.CA())  # the probe and a `bad` leaf; the `good` one is the gateway CA's
    gateway_leaf(ca_dir, probe, "good")
    probe.chmod(0o755)
    res = gateway.run("/usr/bin/python3", str(probe / "trust_probe.py"), "--clients", str(probe),
                      hashlib.sha256(bundle).hexdigest(), policy="rt-allow", timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    result = check_probe_output(res.stdout, bundle)
    assert set(result["files"]) == set(truststore.BUNDLE_PATHS)
    for client in ("curl", "wget", "git", "node --use-openssl-ca", "capath:/etc/ssl/certs", "default", "java (recipe)"):
        assert result["good"][client] == "ok", json.dumps(result, indent=1)
