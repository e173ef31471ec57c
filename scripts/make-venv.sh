#!/usr/bin/env bash
# Create the venv (default .venv) with a Python >= 3.12 and install egressgate editable with the given extras
# (default: dev). Used by `make venv`, `make test` and `make bench`.
#
# Why uv and not pip: on these machines the registry's answers are not cacheable by pip, so every fresh clone
# downloaded all ~130 wheels again and compiled them one file at a time: ~100 s of a fresh clone's `make test`
# (a third of the time the issue allows the whole suite). uv keeps a wheel cache and unpacks and compiles in
# parallel: ~15-30 s for the same set. uv does not read pip's configuration, so pip's own settings (indexes,
# find-links, constraints: `pip config list`) are handed to it here, and it merges indexes as pip does
# (unsafe-best-match: pip picks the best version over all indexes). If uv cannot be installed, pip does it all.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
extras=${2:-dev}
py=$(scripts/find-python.sh)
echo "using $py"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
bin=$venv/bin

uv_args=(--python "$bin/python" --index-strategy unsafe-best-match --compile-bytecode)
while IFS= read -r line; do
  key=${line%%=*}
  value=${line#*=}
  value=${value#\'}
  value=${value%\'}
  case "${key##*.}" in
    index-url) uv_args+=(--index-url "$value") ;;
    extra-index-url) for v in $value; do uv_args+=(--extra-index-url "$v"); done ;;
    find-links) for v in $value; do uv_args+=(--find-links "$v"); done ;;
    constraint) for v in $value; do uv_args+=(--constraint "$v"); done ;;
    cert) export SSL_CERT_FILE=$value ;;
  esac
done < <("$bin/pip" config list 2>/dev/null || true)

# a file:// index that does not exist is skipped by pip but fatal to uv
checked=()
for ((i = 0; i < ${#uv_args[@]}; i++)); do
  a=${uv_args[i]}
  if [[ $a == --extra-index-url || $a == --find-links || $a == --index-url ]] && [[ ${uv_args[i + 1]} == file://* ]] &&
    [ ! -e "${uv_args[i + 1]#file://}" ]; then
    i=$((i + 1))
    continue
  fi
  checked+=("$a")
done

if "$bin/pip" install -q --disable-pip-version-check "uv>=0.4" && [ -x "$bin/uv" ]; then
  "$bin/uv" pip install -q "${checked[@]}" -e ".[$extras]"
else
  echo "make-venv: uv could not be installed; installing with pip (slower)" >&2
  "$bin/pip" install -q --upgrade pip
  "$bin/pip" install -q -e ".[$extras]"
fi
