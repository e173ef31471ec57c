"""Three things mitmproxy 12.3.1 does for every flow, with the same effects at less cost.

Why: mitmproxy runs each hook in a task of its own (`asyncio_utils.create_task`), whose debug helper
`set_task_debug_info` reads `os.environ["PYTEST_CURRENT_TEST"]` every time (an encode + a dict lookup
through `os._Environ`), and wraps it in `TimeoutWatchdog.disarm()`, a `@contextmanager` generator. Four
hooks or more per request: in the issue 11 profiles the environment lookup was ~1.6 % and the generator
context manager ~2.4 % of the gateway's samples. Neither does anything the gateway needs to pay for:

* `set_task_debug_info`: the same name, creation time and client on every task; the test name it adds
  exists only under pytest, so it is read once, at install, instead of per task.
* `TimeoutWatchdog.disarm`: the same bookkeeping (clear `can_timeout`, count blockers, on the last exit
  register activity and set `can_timeout`, also when the body raises) as a plain class.

And one per request: a connection handler writes every `SendData` its layers yield with its own
`writer.write`, i.e. one `send` syscall each (and on loopback the receiver's TCP processing in it). A
response whose head and body leave in the same pass (the usual case: the body was buffered for the
`response` hook) cost two sends, plus two TLS records' worth of work in the kernel; at c=1 the sends were
the largest single item of the profile (issue 11: `_SelectorSocketTransport.write` 24-34 % self).
`coalesce_sends` merges *consecutive* `SendData` to the same TCP connection of one pass into one write:
nothing is held across passes or past any other command (a close, a hook, a wake-up), so every byte
leaves in the same order and in the same `server_event` call as before, only in fewer syscalls. UDP
connections are never merged (datagram boundaries), nor writes over `COALESCE_MAX` bytes (copying a
large body to save one syscall would cost more than it saves). The head-with-body variant issue 11
tried (holding the head until the body was read) is not this: that one changed what a client saw when a
response was refused mid-stream.

And per hook: a hook whose addons finish without waiting completes in the pass that started it, not an
event-loop iteration later (`_server_event`): ~2.5 loop iterations, ~6 lock acquisitions and ~3 futures
fewer per request (loadtests/RESULTS.md).

Re-check all of them against mitmproxy's source on any upgrade (tests/gateway/test_mitm_hotpaths.py compares
the behaviour with mitmproxy's originals).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator

from mitmproxy.proxy import commands, events, server
from mitmproxy.utils import asyncio_utils

_ORIGINAL_DEBUG_INFO = asyncio_utils.set_task_debug_info
_ORIGINAL_DISARM = server.TimeoutWatchdog.disarm
_ORIGINAL_SERVER_EVENT = server.ConnectionHandler.server_event
COALESCE_MAX = 64 * 1024  # bytes: above this a merge's copy costs more than the syscall it saves


def _make_debug_info(test: str | None):
    suffix = f" [created in {test}]" if __debug__ and test else ""

    def set_task_debug_info(task: asyncio.Task, *, name: str, client: tuple | None = None) -> None:
        """mitmproxy's set_task_debug_info, with the test name read once (see the module docstring)."""
        task.created = time.time()  # type: ignore[attr-defined]
        task.set_name(name + suffix if suffix else name)
        if client:
            task.client = client  # type: ignore[attr-defined]

    return set_task_debug_info


class _Disarmed:
    """`with watchdog.disarm():` as mitmproxy's generator does it, without the generator."""

    __slots__ = ("_w",)

    def __init__(self, watchdog: server.TimeoutWatchdog) -> None:
        self._w = watchdog

    def __enter__(self) -> None:
        w = self._w
        w.can_timeout.clear()
        w.blocker += 1

    def __exit__(self, *exc: object) -> bool:
        w = self._w
        w.blocker -= 1
        if w.blocker == 0:
            w.register_activity()
            w.can_timeout.set()
        return False


def _disarm(self: server.TimeoutWatchdog) -> _Disarmed:
    return _Disarmed(self)


def coalesce_sends(layer_commands: Iterator[commands.Command]) -> Iterator[commands.Command]:
    """The same commands, with runs of `SendData` to one TCP connection merged (see the module docstring).

    A merge needs one command of look-ahead, so a pending write waits while the layer computes its next
    command; if the layer raises instead, the pending write is yielded first (the handler writes it, as it
    would have before the layer raised) and the exception follows."""
    send_data = commands.SendData
    pending: commands.SendData | None = None
    it = iter(layer_commands)
    while True:
        try:
            command = next(it)
        except StopIteration:
            break
        except BaseException:
            if pending is not None:
                yield pending
            raise
        if type(command) is send_data:
            conn = command.connection
            if (
                pending is not None
                and pending.connection is conn
                and len(pending.data) + len(command.data) <= COALESCE_MAX
            ):
                pending = send_data(conn, pending.data + command.data)
                continue
            if pending is not None:
                yield pending
                pending = None
            if conn.transport_protocol == "tcp" and len(command.data) < COALESCE_MAX:
                pending = command
            else:
                yield command
            continue
        if pending is not None:
            yield pending
            pending = None
        yield command
    if pending is not None:
        yield pending


async def _server_event(self: server.ConnectionHandler, event: events.Event) -> None:
    """mitmproxy 12.3.1's ConnectionHandler.server_event (one pass: `_one_pass`), with one change in how
    events that arrive *during* a pass wait for it to end.

    A pass starts hooks as eager tasks (mitmproxy's task factory); a hook whose addons finish without
    suspending calls `server_event(HookCompleted)` from inside the pass. mitmproxy makes that call wait
    on the handler's lock, so it runs one event-loop iteration later (a lock future, a task wake-up, an
    epoll round: per request, for each of the 3-4 hooks that do not wait for I/O). Here an event that
    arrives while a pass of this handler runs is queued and processed right after the pass, under the
    same lock hold, in arrival order (nothing else can run in between, a pass has no `await`). Events
    other tasks had already queued on the lock (a chunk a reader task read meanwhile) now run after
    these completions rather than between them: the order mitmproxy gives as well whenever those
    events arrive a moment later, so no layer may rely on either (the passthrough take-over does not:
    it waits until mitmproxy holds nothing of the tunnel, tunnels/splice.py `_parked`). A hook that
    does suspend (the decision waiting for its audit record) calls in after the pass has ended and
    takes the lock as before."""
    deferred = self.__dict__.get("_eg_deferred")
    if deferred is not None:  # called from inside this handler's running pass (see above)
        deferred.append(event)
        return
    async with self._server_event_lock:
        queue = [event]
        while queue:
            self._eg_deferred = []
            try:
                _one_pass(self, queue.pop(0))
            finally:
                queue.extend(self._eg_deferred)
                self._eg_deferred = None


def _one_pass(self: server.ConnectionHandler, event: events.Event) -> None:
    """One pass of mitmproxy 12.3.1's ConnectionHandler.server_event: the body of its `async with`,
    verbatim except the marked line (comments shortened; tests/gateway/test_mitm_hotpaths.py compares the
    two). Patched rather than wrapping the top layer: mitmproxy replaces both the handler's top layer
    (mode_servers) and the NextLayer's `handle_event` (once the next layer is known) after start-up."""
    # No `await` beyond this point (mitmproxy: the eager task factory's reentrancy, mitmproxy#7027).
    self.timeout_watchdog.register_activity()
    try:
        layer_commands = coalesce_sends(self.layer.handle_event(event))  # changed: coalesce_sends
        for command in layer_commands:
            if isinstance(command, commands.OpenConnection):
                assert command.connection not in self.transports
                handler = asyncio_utils.create_task(
                    self.open_connection(command),
                    name=f"server connection handler {command.connection.address}",
                    keep_ref=False,
                    client=self.client.peername,
                )
                self.transports[command.connection] = server.ConnectionIO(handler=handler)
            elif isinstance(command, commands.RequestWakeup):
                task = asyncio_utils.create_task(
                    self.wakeup(command),
                    name=f"wakeup timer ({command.delay:.1f}s)",
                    keep_ref=False,
                    client=self.client.peername,
                )
                assert task is not None
                self.wakeup_timer.add(task)
            elif isinstance(command, commands.ConnectionCommand) and command.connection not in self.transports:
                pass  # The connection has already been closed.
            elif isinstance(command, commands.SendData):
                writer = self.transports[command.connection].writer
                assert writer
                if not writer.is_closing():
                    writer.write(command.data)
            elif isinstance(command, commands.CloseTcpConnection):
                self.close_connection(command.connection, command.half_close)
            elif isinstance(command, commands.CloseConnection):
                self.close_connection(command.connection, False)
            elif isinstance(command, commands.StartHook):
                asyncio_utils.create_task(
                    self.hook_task(command),
                    name=f"handle_hook({command.name})",
                    keep_ref=True,
                    client=self.client.peername,
                )
            elif isinstance(command, commands.Log):
                self.log(command.message, command.level)
            else:
                raise RuntimeError(f"Unexpected command: {command}")
    except Exception:
        self.log("mitmproxy has crashed!", logging.ERROR, exc_info=True)


def install() -> None:
    """Swap all three in for this process (idempotent)."""
    asyncio_utils.set_task_debug_info = _make_debug_info(os.environ.get("PYTEST_CURRENT_TEST"))
    server.TimeoutWatchdog.disarm = _disarm  # type: ignore[method-assign]
    server.ConnectionHandler.server_event = _server_event  # type: ignore[method-assign]


def uninstall() -> None:
    asyncio_utils.set_task_debug_info = _ORIGINAL_DEBUG_INFO
    server.TimeoutWatchdog.disarm = _ORIGINAL_DISARM  # type: ignore[method-assign]
    server.ConnectionHandler.server_event = _ORIGINAL_SERVER_EVENT  # type: ignore[method-assign]
