#!/usr/bin/env bash
# Install the Debian packages the tests and benchmarks use (nftables, iproute2, dig, curl; Squid, dnsmasq, wrk)
# when they are missing. Needs root; otherwise it says what is missing and the tests that need it skip
# (outside CI) or fail (in CI).
set -eu
need=()
have() { command -v "$1" >/dev/null 2>&1; }
have squid || need+=(squid)
have dnsmasq || need+=(dnsmasq-base)
have nft || need+=(nftables)
have ip || need+=(iproute2)
have dig || need+=(dnsutils)
have curl || need+=(curl)
have wrk || need+=(wrk)
# tests/render: a private dockerd + Debian docker-compose 1.29 bring compose.yaml up; mmdebstrap builds the
# images' base offline (scripts/build-images.sh)
have dockerd || need+=(docker.io)
have docker-compose || need+=(docker-compose)
have mmdebstrap || need+=(mmdebstrap)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "missing Debian packages (run as root to install): ${need[*]}" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
