#!/usr/bin/env bash
# Install the Debian packages the tests and benchmarks use (nftables, iproute2, dig, curl; Squid, dnsmasq, wrk; redis-server for the shared-state tests;
# Debian chromium for the console's browser tests; Docker, gVisor runsc, static busybox, mmdebstrap and bubblewrap for the runtime adapters)
# when they are missing. Needs root; otherwise it says what is missing and the tests that need it skip
# (outside CI) or fail (in CI).
set -eu
need=()
have() { command -v "$1" >/dev/null 2>&1; }
have squid || need+=(squid)
have redis-server || need+=(redis-server)
have dnsmasq || need+=(dnsmasq-base)
have nft || need+=(nftables)
have ip || need+=(iproute2)
have dig || need+=(dnsutils)
have curl || need+=(curl)
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
# tests/console: Playwright drives Debian's chromium at /usr/bin/chromium (no browser download)
[ -x /usr/bin/chromium ] || need+=(chromium)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "missing Debian packages (run as root to install): ${need[*]}" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
