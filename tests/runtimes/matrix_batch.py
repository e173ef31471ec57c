"""Run INSIDE one sandbox by tests/runtimes/test_client_matrix.py: tests/runtimes/matrix_client.py once per
CLIENT:MODE given, two at a time (a client's proxy and transparent runs side by side, as two sandbox runs did),
each in a process of its own that inherits the sandbox's environment unchanged (matrix_client.py removes what
its mode and client say). One sandbox run for the whole matrix instead of one per client and mode: a `sandbox
run` costs its own start-up and set-up, which the clients' cases do not need repeated.

Usage: python3 matrix_batch.py MATRIX_CLIENT.py CONFIG.json CLIENT:MODE...   (Debian's python3, stdlib only)
Prints one line per run: BATCH {"client", "mode", "rc", "stdout", "stderr", "seconds"} (rc None: timed out).
"""

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

CLIENT_PY, CONFIG, PAIRS = sys.argv[1], sys.argv[2], sys.argv[3:]
TIMEOUT = 600


def text(data):
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")


def one(pair):
    client, mode = pair.split(":")
    started = time.monotonic()
    try:
        p = subprocess.run([sys.executable, CLIENT_PY, client, mode, CONFIG], capture_output=True, text=True,
                           timeout=TIMEOUT, check=False)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = None, text(exc.stdout), f"timeout after {TIMEOUT} s: {text(exc.stderr)}"
    return {"client": client, "mode": mode, "rc": rc, "stdout": out, "stderr": err,
            "seconds": round(time.monotonic() - started, 1)}


if __name__ == "__main__":
    with ThreadPoolExecutor(2) as pool:
        for result in pool.map(one, PAIRS):
            print("BATCH " + json.dumps(result), flush=True)
