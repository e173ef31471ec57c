"""The sandbox bundle at the system trust paths of a container (docker and gVisor), not only where the CA
variables point (issue 21 item 3): inside Debian's python image, with every CA variable removed, Python's
default context, an OpenSSL CApath-only context and a context per trust file verify a server whose leaf
chains to the bundle's CA, and refuse one that does not. The image's own /etc/ssl/certs is replaced (its
roots are not the sandbox's trust): the positive control runs the same probe with the image's roots only."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import trustme

from egressgate.runtimes import truststore
from egressgate.runtimes.base import SANDBOX_UID, RunSpec
from egressgate.runtimes.docker import DockerAdapter
from tests.runtimes.docker_support import make_spec, run
from tests.runtimes.trust_support import check_probe_output, probe_dir, sandbox_bundle
from tests.support.dockerd import Dockerd

pytestmark = pytest.mark.netns


@pytest.mark.parametrize("runtime", ["docker", "gvisor"])
def test_container_trusts_the_bundle_at_system_paths(dockerd: Dockerd, tmp_path: Path, runtime: str) -> None:
    ca = trustme.CA()
    bundle = sandbox_bundle(ca)
    (tmp_path / "ca.pem").write_bytes(bundle)  # make_spec keeps an existing ca.pem: the spec's bundle
    probe_dir(tmp_path / "ws" / "probe", ca, owner=SANDBOX_UID)
    (tmp_path / "ws" / "probe").chmod(0o755)
    digest = hashlib.sha256(bundle).hexdigest()
    spec = make_spec(tmp_path, dockerd.python_image(),
                     ["python3", "/workspace/probe/trust_probe.py", "/workspace/probe", digest, "/workspace/out.json"],
                     runtime=runtime)
    info = run(dockerd, runtime, spec)
    assert info.exit_code() == 0, info
    result = check_probe_output((tmp_path / "ws" / "out.json").read_text(), bundle)
    assert set(result["files"]) == set(truststore.BUNDLE_PATHS)


def test_image_roots_alone_do_not_trust_the_gateway(dockerd: Dockerd, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Positive control: the image's own trust store (what a container had before) refuses the gateway
    CA's leaf; only the runtime's layout makes it verify."""
    ca = trustme.CA()
    probe_dir(tmp_path / "ws" / "probe", ca, owner=SANDBOX_UID)
    (tmp_path / "ws" / "probe").chmod(0o755)
    script = ("import ssl, sys; sys.argv[1:] = ['/workspace/probe', 'x']; sys.path.insert(0, '/workspace/probe');"
              "import trust_probe as p; port = p.serve('/workspace/probe', 'good'); p.start_server();"
              "open('/workspace/out.json', 'w').write(p.verify(ssl.create_default_context(), port))")
    spec = make_spec(tmp_path, dockerd.python_image(), ["python3", "-c", script])
    # the adapter as it was before issue 21: the bundle only at /etc/egressgate/ca.pem, the image's own
    # /etc/ssl/certs in place
    original = DockerAdapter.create_config

    def image_roots_only(self: DockerAdapter, spec: RunSpec, run_dir: Path) -> dict:
        config = original(self, spec, run_dir)
        config["HostConfig"]["Mounts"] = [m for m in config["HostConfig"]["Mounts"]
                                          if not m["Target"].startswith(("/etc/ssl", "/etc/pki"))]
        return config

    monkeypatch.setattr(DockerAdapter, "create_config", image_roots_only)
    info = run(dockerd, "docker", spec)
    assert info.exit_code() == 0, info
    assert "CERTIFICATE_VERIFY_FAILED" in (tmp_path / "ws" / "out.json").read_text()
