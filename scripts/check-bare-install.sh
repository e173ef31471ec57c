#!/usr/bin/env bash
# Install egressgate WITHOUT extras into a throwaway venv and use it as a new operator would:
# `egressgate --help`, import every module, `policy check policies/`, then start a gateway (loopback, free
# ports, in a temp dir), `sandbox admit` against it (with a dead HTTP(S)_PROXY in the environment, which
# the admin call must ignore), `sandbox revoke`, and stop it with SIGTERM.
# Why: the test venv has the `dev` extra, so an import of a test-only package (httpx was one) passes every
# test and fails on a plain `pip install egressgate`. Exit 0 when all of it works; non-zero names the step.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=$(scripts/find-python.sh)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/egressgate-bare.XXXXXX")
gw_pid=""
cleanup() {
  if [ -n "$gw_pid" ] && kill -0 "$gw_pid" 2>/dev/null; then
    kill "$gw_pid" 2>/dev/null || true
    wait "$gw_pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
step() { echo "bare-install: [$(( $(date +%s) - ${start:-$(date +%s)} ))s] $*"; }
fail() { echo "bare-install: FAILED: $*" >&2; [ -f "$tmp/gateway.log" ] && tail -n 30 "$tmp/gateway.log" >&2; exit 1; }
unset PYTHONPATH  # only what the venv installed may be imported

start=$(date +%s)
step "venv + pip install . (no extras)"
# Build from a copy: an in-tree build leaves build/ behind, whose stale modules a later build would ship.
mkdir "$tmp/src"
cp -R "$root/pyproject.toml" "$root/README.md" "$root/LICENSE" "$root/egressgate" "$tmp/src/"
find "$tmp/src" -name __pycache__ -prune -exec rm -rf {} +
"$py" -m venv "$tmp/venv"
bin="$tmp/venv/bin"
# The registry's answers are not cacheable by pip, so the wheels of the runtime dependencies are kept in a
# wheelhouse outside the temp dir: later runs install offline (--no-index: nothing but what `pip download`
# resolved for the package WITHOUT extras can get in). A new or changed dependency refills it.
wh=${EGRESSGATE_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/egressgate/bare-wheels}
mkdir -p "$wh"
pip_install() { "$bin/pip" install --disable-pip-version-check --no-compile --no-index --find-links "$wh" "$tmp/src"; }
if ! pip_install >"$tmp/pip.log" 2>&1; then
  step "filling the wheelhouse $wh (first run, or the dependencies changed)"
  build_req=$("$py" -c 'import sys, tomllib; print(" ".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' \
    "$root/pyproject.toml")  # the build backend, as pyproject.toml requires it (offline builds need it here)
  # shellcheck disable=SC2086 # a list of requirement strings without spaces
  "$bin/pip" download --disable-pip-version-check -d "$wh" "$tmp/src" $build_req >>"$tmp/pip.log" 2>&1 \
    || { tail -n 30 "$tmp/pip.log" >&2; fail "pip download"; }
  pip_install >>"$tmp/pip.log" 2>&1 || { tail -n 30 "$tmp/pip.log" >&2; fail "pip install . (no extras)"; }
fi
if "$bin/python" -c 'import httpx' 2>/dev/null; then
  step "note: httpx is installed (pulled in by a runtime dependency); the import scan test still guards it"
fi
cd "$tmp"  # never import the source tree by accident

step "egressgate --help"
"$bin/egressgate" --help >/dev/null || fail "egressgate --help"

step "import every module of the package"
"$bin/python" - <<'EOF' || fail "a module does not import without the dev extra"
import importlib, pkgutil, egressgate
for mod in pkgutil.walk_packages(egressgate.__path__, "egressgate."):
    if not mod.name.endswith(".__main__"):  # runs the CLI
        importlib.import_module(mod.name)
EOF

step "egressgate policy check policies/"
"$bin/egressgate" policy check "$root/policies" >/dev/null || fail "policy check policies/"
policy=$("$bin/python" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["sandbox"]["name"])' \
  "$root/policies/seed-invoice-analysis.yaml")

step "egressgate run (loopback, port 0)"
cat >"$tmp/gateway.yaml" <<EOF
listen: {proxy: "127.0.0.1:0", admin: "127.0.0.1:0", dns: null, transparent: "127.0.0.2:0"}
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

step "egressgate sandbox admit (dead HTTP(S)_PROXY in the environment)"
HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9 \
  "$bin/egressgate" sandbox admit --config "$tmp/gateway.yaml" --policy "$policy" --label ci=bare >"$tmp/admit.json" \
  || fail "sandbox admit"
sandbox_id=$("$bin/python" -c 'import json, sys; d = json.load(open(sys.argv[1])); assert d["token"] and d["proxy_url"]; print(d["id"])' \
  "$tmp/admit.json") || fail "sandbox admit printed no id/token/proxy_url"
if "$bin/egressgate" sandbox admit --config "$tmp/gateway.yaml" --policy no-such-policy >/dev/null 2>"$tmp/refused.txt"; then
  fail "sandbox admit accepted an unknown policy"
fi
grep -q "admission refused" "$tmp/refused.txt" || fail "an unknown policy was not reported as a refused admission"
"$bin/egressgate" sandbox revoke --config "$tmp/gateway.yaml" "$sandbox_id" >/dev/null || fail "sandbox revoke"

step "stop (SIGTERM)"
kill -TERM "$gw_pid"
rc=0
wait "$gw_pid" || rc=$?
gw_pid=""
[ "$rc" -eq 0 ] || fail "the gateway exited $rc on SIGTERM"
step "ok in $(( $(date +%s) - start )) s"
