#!/usr/bin/env bash
# Print the path of a Python >= 3.12 (mitmproxy 12 needs it; on 3.11 pip silently installs mitmproxy 11).
set -u
candidates=("${PYTHON:-}" python3.13 python3.12 python3 "$HOME"/.pyenv/versions/3.13*/bin/python "$HOME"/.pyenv/versions/3.12*/bin/python /usr/bin/python3)
for c in "${candidates[@]}"; do
  [ -n "$c" ] || continue
  p=$(command -v "$c" 2>/dev/null) || continue
  if "$p" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
    echo "$p"; exit 0
  fi
done
echo "egressgate needs Python >= 3.12 (with venv); none found. Install one or set PYTHON=/path/to/python3.12" >&2
exit 1
