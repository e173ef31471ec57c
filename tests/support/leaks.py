"""An independent leak oracle: does `out` carry `secret` in any encoding a scrubber must catch?

Independent of the scrubber's own pattern list on purpose (a shared list would make a missed encoding
invisible to the tests): it decodes what came out (base64 runs at every alignment, percent-decoding,
JSON unescaping) and looks for the secret.
"""

from __future__ import annotations

import base64
import json
import re
from urllib.parse import unquote, unquote_plus

_B64_RUN = re.compile(rb"[A-Za-z0-9+/_\-]{4,}={0,2}")


def leaks(out: bytes, secret: str) -> list[str]:
    raw = secret.encode()
    found = []
    if raw in out:
        found.append("raw")
    text = out.decode("utf-8", "replace")
    if secret in unquote(text) or secret in unquote_plus(text):
        found.append("url")
    for esc in (json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]):
        if esc.encode() in out or esc.replace("/", "\\/").encode() in out:
            found.append("json")
    for m in _B64_RUN.finditer(out):
        run = m.group(0).rstrip(b"=").replace(b"-", b"+").replace(b"_", b"/")
        for off in range(4):
            part = run[off:]
            if len(part) % 4 == 1:
                part = part[:-1]
            part += b"=" * (-len(part) % 4)
            try:
                if raw in base64.b64decode(part):
                    found.append("base64")
            except ValueError:
                pass
    return found
