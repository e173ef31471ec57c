"""A 407 to a request without credentials is a challenge, not a denial (issue 21 item 5).

git, pip and curl with --proxy-anyauth first send their CONNECT without Proxy-Authorization and answer the
407 with credentials. That first exchange is recorded with decision `challenge` (reason identity_unknown),
so `egressgate_decisions_total{decision="deny"}` counts only real refusals. Positive control: wrong
credentials are a denial, counted as one.
"""

from __future__ import annotations

import base64
import socket

from tests.control_api.harness import delta, scrape

DECISIONS = "egressgate_decisions_total"


def connect(gw, extra: str = "") -> bytes:
    with socket.create_connection(gw.proxy, timeout=10) as sock:
        sock.sendall(f"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n{extra}\r\n".encode())
        sock.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def moved(before, after) -> dict[str, float]:
    """decision -> count of new identity_unknown records of operation connect."""
    out: dict[str, float] = {}
    for (name, labels), n in delta(before, after).items():
        label = dict(labels)
        if name == DECISIONS and label.get("reason") == "identity_unknown" and label.get("operation") == "connect":
            out[label["decision"]] = out.get(label["decision"], 0) + n
    return out


def test_a_challenge_is_not_counted_as_a_denial(cgw):
    before = scrape(cgw)
    head = connect(cgw)
    assert head.startswith(b"HTTP/1.1 407") and b"identity_unknown" in head, head[:300]
    assert moved(before, scrape(cgw)) == {"challenge": 1}
    # positive control: wrong credentials are a denial
    before = scrape(cgw)
    bad = base64.b64encode(b"sbx-0000000000000000:wrong").decode()
    head = connect(cgw, f"Proxy-Authorization: Basic {bad}\r\n")
    assert head.startswith(b"HTTP/1.1 407"), head[:300]
    assert moved(before, scrape(cgw)) == {"deny": 1}
