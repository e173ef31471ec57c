"""One HTTP/2 connection carrying many streams, each naming its own :authority (test_h2.py and the
transparent listener's test): what a client that fronts at the stream level sends."""

from __future__ import annotations

import ssl
import time

import h2.config
import h2.connection
import h2.events

GOOD = "api.allowed.test:9443"
STREAMS = {1: GOOD, 3: "forbidden.test", 5: "169.254.169.254", 7: "api.allowed.test:443", 9: GOOD}


def exchange(tls: ssl.SSLSocket, streams: dict[int, str], timeout: float = 5.0) -> dict[int, int | str]:
    """Send one GET per stream, return {stream: status or 'reset'/'closed'}."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    for sid, authority in streams.items():
        conn.send_headers(sid, [(":method", "GET"), (":scheme", "https"), (":authority", authority),
                                (":path", f"/h2-{sid}")], end_stream=True)
    tls.sendall(conn.data_to_send())
    result: dict[int, int | str] = {}
    tls.settimeout(timeout)
    deadline = time.monotonic() + timeout
    while len(result) < len(streams) and time.monotonic() < deadline:
        try:
            data = tls.recv(65536)
        except (TimeoutError, ssl.SSLError, OSError):
            break
        if not data:
            break
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                result[event.stream_id] = int(dict(event.headers)[":status"])
            elif isinstance(event, h2.events.StreamReset):
                result.setdefault(event.stream_id, "reset")
            elif isinstance(event, h2.events.ConnectionTerminated):
                for sid in streams:
                    result.setdefault(sid, "closed")
        out = conn.data_to_send()
        if out:
            tls.sendall(out)
    return result
