"""The server half of the loopback HTTP/2 test upstreams (tests/support/{upstreams,reflect}.py,
tests/gateway_credentials/{rawcodings,trailer_peers}.py): one h2 state machine over an asyncio stream.

Each upstream differs only in what it does with an event; the connection's life is the same everywhere:
send our SETTINGS, feed every read to h2, acknowledge received DATA (so a client uploading a body is never
stalled by flow control), flush what the handler queued after each read, and close the socket on EOF, on a
transport error or when the handler says the connection is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import h2.config
import h2.connection
import h2.events

Handler = Callable[[h2.connection.H2Connection, h2.events.Event], Awaitable[bool | None]]


async def serve_h2_events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_event: Handler,
                          config: h2.config.H2Configuration | None = None,
                          errors: tuple[type[BaseException], ...] = (ConnectionError, OSError),
                          on_close: Callable[[], None] | None = None) -> None:
    """Run one server-side HTTP/2 connection, awaiting `on_event(conn, event)` for every h2 event; a true
    result ends the connection at once (the handler has written what it wanted). `errors` end it quietly.
    `on_close` runs before the socket closes (whatever is recorded there is visible when the peer sees EOF)."""
    conn = h2.connection.H2Connection(config or h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    try:
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if await on_event(conn, event):
                    return
            writer.write(conn.data_to_send())
            await writer.drain()
    except errors:
        pass
    finally:
        if on_close is not None:
            on_close()
        writer.close()
