#!/usr/bin/env bash
# axe-core (the accessibility rules engine) for tests/console/test_console_layout.py, from the npm registry into
# the user's cache, once per version: the test injects axe.min.js into the console page and fails on any
# serious or critical violation. Prints nothing when it is already there.
set -eu
VERSION=4.10.3
DIR="${XDG_CACHE_HOME:-$HOME/.cache}/egressgate/npm/axe-core-$VERSION"
[ -f "$DIR/node_modules/axe-core/axe.min.js" ] && exit 0
if ! command -v npm >/dev/null 2>&1; then
  echo "install-axe: npm is missing (Debian package npm; scripts/install-test-deps.sh installs it)" >&2
  exit 0
fi
mkdir -p "$DIR"
npm install --silent --no-audit --no-fund --prefix "$DIR" "axe-core@$VERSION" >/dev/null
test -f "$DIR/node_modules/axe-core/axe.min.js"
