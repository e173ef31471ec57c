#!/usr/bin/env bash
# Install egressgate with EVERY runtime dependency at the lower bound pyproject.toml declares (a constraints
# file of `name==min`, generated from [project].dependencies) into a throwaway venv, and smoke-test it:
# `egressgate --version`, import every module (the admin server and console, the Redis backend), build a
# Redis state store (no connection), `policy check` each policies/*.yaml, start `egressgate run` on free
# loopback ports with a temp var dir, GET /readyz (200), stop it with SIGTERM (exit 0).
# Why: the test venv gets the newest releases, so a lower bound nobody installs rots: `aiohttp>=3.9` and
# `redis>=5.0` were declared while the code needed aiohttp's web.RequestKey (3.14) and
# redis.maint_notifications (7.0); a user whose resolver kept an older release got an import error.
# Wheels only (--only-binary): a bound whose release has no wheel for this Python cannot be installed by a
# user without a compiler either, so it is too low here. Exit 0 when all works; non-zero names the step.
# Fast on reruns: the wheels are kept in a wheelhouse outside the temp dir and later runs install offline.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=$(scripts/find-python.sh)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/egressgate-lowest.XXXXXX")
gw_pid=""
cleanup() {
  if [ -n "$gw_pid" ] && kill -0 "$gw_pid" 2>/dev/null; then
    kill "$gw_pid" 2>/dev/null || true
    wait "$gw_pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
start=$(date +%s)
step() { echo "lowest-deps: [$(( $(date +%s) - start ))s] $*"; }
fail() { echo "lowest-deps: FAILED: $*" >&2; [ -f "$tmp/gateway.log" ] && tail -n 30 "$tmp/gateway.log" >&2; exit 1; }
unset PYTHONPATH  # only what the venv installed may be imported

step "constraints from pyproject.toml's lower bounds"
"$py" - "$root/pyproject.toml" >"$tmp/constraints.txt" <<'EOF' || fail "a runtime dependency has no lower bound"
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
missing = []
for req in project["dependencies"]:
    name = re.match(r"[A-Za-z0-9._-]+", req).group(0)
    low = re.search(r">=\s*([^,;\s]+)", req)
    if low is None:
        missing.append(req)
    else:
        print(f"{name}=={low.group(1)}")
if missing:
    sys.exit(f"no lower bound (>=) on: {', '.join(missing)}")
EOF
sed 's/^/  /' "$tmp/constraints.txt"
build_req=$("$py" -c 'import sys, tomllib; print(" ".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' \
  "$root/pyproject.toml")

step "venv + pip install . -c constraints (wheels only)"
mkdir "$tmp/src"  # build from a copy: an in-tree build leaves build/ behind
cp -R "$root/pyproject.toml" "$root/README.md" "$root/LICENSE" "$root/egressgate" "$tmp/src/"
find "$tmp/src" -name __pycache__ -prune -exec rm -rf {} +
"$py" -m venv "$tmp/venv"
bin="$tmp/venv/bin"
wh=${EGRESSGATE_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/egressgate/lowest-wheels}
mkdir -p "$wh"
pip_opts=(--disable-pip-version-check --only-binary=:all: -c "$tmp/constraints.txt")
pip_install() { "$bin/pip" install "${pip_opts[@]}" --no-compile --no-index --find-links "$wh" "$tmp/src"; }
if ! pip_install >"$tmp/pip.log" 2>&1; then
  step "filling the wheelhouse $wh (first run, or the bounds changed)"
  # shellcheck disable=SC2086 # build_req is a list of requirement strings without spaces
  "$bin/pip" download "${pip_opts[@]}" -d "$wh" "$tmp/src" $build_req >>"$tmp/pip.log" 2>&1 \
    || { tail -n 30 "$tmp/pip.log" >&2; fail "pip download with the lowest versions"; }
  pip_install >>"$tmp/pip.log" 2>&1 || { tail -n 30 "$tmp/pip.log" >&2; fail "pip install with the lowest versions"; }
fi
"$bin/python" - "$tmp/constraints.txt" <<'EOF' || fail "an installed version is not the declared lower bound"
import importlib.metadata as md, re, sys
for line in open(sys.argv[1]):
    name, want = line.strip().split("==")
    have = md.version(name)
    if re.sub(r"(\.0)+$", "", have) != re.sub(r"(\.0)+$", "", want):
        sys.exit(f"{name}: installed {have}, lower bound {want}")
EOF
cd "$tmp"  # never import the source tree by accident

step "egressgate --version"
"$bin/egressgate" --version >/dev/null || fail "egressgate --version"

step "import every module (admin server, console, Redis backend) and build a Redis store"
"$bin/python" - <<'EOF' || fail "a module does not work with the lowest versions"
import importlib, pkgutil, egressgate
for mod in pkgutil.walk_packages(egressgate.__path__, "egressgate."):
    if not mod.name.endswith(".__main__"):  # runs the CLI
        importlib.import_module(mod.name)
from egressgate.state.redis import RedisState
RedisState("redis://127.0.0.1:9/0")  # pool, scripts and subscriber objects; connects only at start()
EOF

step "egressgate policy check policies/*.yaml"
for file in "$root"/policies/*.yaml; do
  "$bin/egressgate" policy check "$file" >/dev/null || fail "policy check $file"
done

step "egressgate run (loopback, port 0) + GET /readyz"
cat >"$tmp/gateway.yaml" <<EOF
listen: {proxy: "127.0.0.1:0", admin: "127.0.0.1:0", dns: "127.0.0.1:0", transparent: "127.0.0.2:0"}
policy: "$root/policies"
var_dir: "$tmp/var"
EOF
"$bin/egressgate" run --config "$tmp/gateway.yaml" >"$tmp/gateway.out" 2>"$tmp/gateway.log" &
gw_pid=$!
for _ in $(seq 1 300); do
  [ -s "$tmp/gateway.out" ] && break
  kill -0 "$gw_pid" 2>/dev/null || fail "the gateway exited during startup"
  sleep 0.1
done
[ -s "$tmp/gateway.out" ] || fail "the gateway did not announce its addresses within 30 s"
"$bin/python" - "$tmp/gateway.out" <<'EOF' || fail "/readyz"
import json, sys, time, urllib.request
admin = json.loads(open(sys.argv[1]).readline())["admin"]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, never a proxy
for _ in range(50):
    try:
        with opener.open(f"http://{admin}/readyz", timeout=5) as res:
            if res.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.1)
sys.exit(f"http://{admin}/readyz never answered 200")
EOF

step "stop (SIGTERM)"
kill -TERM "$gw_pid"
rc=0
wait "$gw_pid" || rc=$?
gw_pid=""
[ "$rc" -eq 0 ] || fail "the gateway exited $rc on SIGTERM"
step "ok in $(( $(date +%s) - start )) s"
