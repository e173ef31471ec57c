#!/usr/bin/env bash
# Install the Debian packages the tests and benchmarks use (nftables, iproute2, dig, curl; Squid, dnsmasq, wrk; redis-server for the shared-state tests;
# Debian chromium (its headless shell) for the console's browser tests; Docker, gVisor runsc, static busybox, mmdebstrap and bubblewrap for the runtime adapters)
# when they are missing. Needs root; otherwise it says what is missing and the tests that need it skip
# (outside CI) or fail (in CI).
set -eu
need=()
have() { command -v "$1" >/dev/null 2>&1; }
# Squid built with OpenSSL (Debian's squid-openssl; it conflicts with the GnuTLS `squid` package and replaces it):
# the same binary serves `make bench`'s forward proxy / CONNECT tunnel and its ssl-bump MITM candidate
{ squid -v || /usr/sbin/squid -v; } 2>/dev/null | grep -q -- '--with-openssl' || need+=(squid-openssl)
have redis-server || need+=(redis-server)
have dnsmasq || need+=(dnsmasq-base)
have nft || need+=(nftables)
have ip || need+=(iproute2)
have dig || need+=(dnsutils)
have curl || need+=(curl)
# tests/runtimes/test_client_matrix.py and the trust tests: the real clients an agent runs inside a sandbox
# (their Python clients are installed for /usr/bin/python3 by tests/support/sandbox_pylibs.py, at exit below)
have wget || need+=(wget)
have git || need+=(git)
have openssl || need+=(openssl)
have node || need+=(nodejs)
have npm || need+=(npm)  # also scripts/install-axe.sh (axe-core for the console's accessibility test)
[ -x /usr/bin/python3 ] && /usr/bin/python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
# requests, httpx, aiohttp, the OpenAI SDK, websockets and grpcio for the sandbox's /usr/bin/python3, cached
# under /var/cache/egressgate-tests (the matrix's fixture builds it too when this step could not); on every
# exit of this script, after the packages (pip among them) are in place
prefetch_pylibs() {
  [ "$(id -u)" = 0 ] && [ -x .venv/bin/python ] && [ -x /usr/bin/python3 ] || return 0
  .venv/bin/python -m tests.support.sandbox_pylibs >/dev/null || echo "sandbox client libraries: prefetch failed" >&2
}
trap prefetch_pylibs EXIT
have wrk || need+=(wrk)
have dockerd || need+=(docker.io)
have runsc || need+=(runsc)
have mmdebstrap || need+=(mmdebstrap)
have bwrap || need+=(bubblewrap)
# the test images copy /bin/busybox into containers: it must be the statically linked build
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'install ok installed' || need+=(busybox-static)
# tests/render: Debian docker-compose 1.29 brings compose.yaml up against the private dockerd
have docker-compose || need+=(docker-compose)
# tests/runtimes/test_seccomp_units.py cross-checks the syscall numbers against the kernel's headers
dpkg-query -W -f='${Status}' linux-libc-dev 2>/dev/null | grep -q 'install ok installed' || need+=(linux-libc-dev)
# tests/approvals/test_opclass_clients.py: real `git push` (git http-backend ships with git), `npm install`
# and `npm publish` through the gateway (pip, uv and twine come from the Python dev extra)
have git || need+=(git)
[ -x /usr/lib/git-core/git-http-backend ] || need+=(git)
have node || need+=(nodejs)
have npm || need+=(npm)
# tests/console: Playwright drives Debian's chromium headless shell (no browser download; the full browser
# /usr/bin/chromium cost three times the CPU per page: tests/console/conftest.py)
[ -x /usr/bin/chromium-headless-shell ] || need+=(chromium-headless-shell)
# tests/runtimes/test_microvm.py: QEMU (no recommends: ~80 MiB), lz4 (the cloud kernel's compression), mkfs.ext4
have qemu-system-x86_64 || need+=(qemu-system-x86)
have lz4 || need+=(lz4)
have mkfs.ext4 || need+=(e2fsprogs)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "missing Debian packages (run as root to install): ${need[*]}" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# the microvm runtime's guest kernel (Debian's cloud kernel, extracted), initramfs and root image, cached under
# ~/.cache/egressgate/microvm (a no-op once built: ~45 s the first time)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ "$(id -u)" = 0 ] && [ -x "$ROOT/.venv/bin/egressgate" ] && have qemu-system-x86_64; then
  "$ROOT/.venv/bin/egressgate" runtime image build >/dev/null
fi
