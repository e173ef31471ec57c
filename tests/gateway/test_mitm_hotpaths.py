"""The gateway's versions of mitmproxy's per-hook helpers behave like mitmproxy's originals."""

from __future__ import annotations

import asyncio

import pytest
from mitmproxy.proxy import server
from mitmproxy.utils import asyncio_utils

from egressgate.gateway.mitm import hotpaths as mitm_hotpaths


async def _noop() -> None:
    return None


@pytest.fixture
def restore():
    yield
    mitm_hotpaths.uninstall()


@pytest.mark.parametrize("test_name", [None, "tests/x.py::t (call)"])
@pytest.mark.parametrize("client", [None, ("127.0.0.1", 5)])
async def test_task_debug_info_matches_mitmproxy(monkeypatch, restore, test_name, client):
    if test_name is None:
        monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    else:
        monkeypatch.setenv("PYTEST_CURRENT_TEST", test_name)
    results = []
    for impl in (mitm_hotpaths._ORIGINAL_DEBUG_INFO, None):
        if impl is None:
            mitm_hotpaths.install()
            impl = asyncio_utils.set_task_debug_info
            assert impl is not mitm_hotpaths._ORIGINAL_DEBUG_INFO
        task = asyncio.get_running_loop().create_task(_noop())
        impl(task, name="handle_hook(request)", client=client)
        await task
        results.append((task.get_name(), getattr(task, "client", None), isinstance(task.created, float)))
    assert results[0] == results[1]


async def test_create_task_still_names_tasks(restore):
    mitm_hotpaths.install()
    task = asyncio_utils.create_task(_noop(), name="hook", keep_ref=True, client=("127.0.0.1", 1))
    await task
    assert task.get_name().startswith("hook") and task.client == ("127.0.0.1", 1)


def _watchdog() -> server.TimeoutWatchdog:
    async def callback() -> None:
        return None

    return server.TimeoutWatchdog(30, callback)


def _trace(disarm) -> list:
    """The watchdog's state through nested disarms, one of them ending in an exception."""
    w = _watchdog()
    w.last_activity = 0.0
    seen = []
    with disarm(w):
        seen.append((w.blocker, w.can_timeout.is_set(), w.last_activity))
        with pytest.raises(KeyError), disarm(w):
            seen.append((w.blocker, w.can_timeout.is_set(), w.last_activity))
            raise KeyError("body failed")
        seen.append((w.blocker, w.can_timeout.is_set(), w.last_activity))
    seen.append((w.blocker, w.can_timeout.is_set(), w.last_activity > 0))
    return seen


async def test_disarm_matches_mitmproxy(restore):
    theirs = _trace(mitm_hotpaths._ORIGINAL_DISARM)
    mitm_hotpaths.install()
    assert server.TimeoutWatchdog.disarm is not mitm_hotpaths._ORIGINAL_DISARM
    ours = _trace(server.TimeoutWatchdog.disarm)
    assert ours == theirs == [(1, False, 0.0), (2, False, 0.0), (1, False, 0.0), (0, True, True)]


# --- coalesce_sends and the server_event that applies it ---------------------------------------------------


def _conn(protocol: str = "tcp"):
    from mitmproxy import connection

    return connection.Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2), transport_protocol=protocol)


def _summary(cmds) -> list:
    from mitmproxy.proxy import commands

    return [
        (type(c).__name__, id(c.connection), c.data)
        if isinstance(c, commands.SendData)
        else (type(c).__name__, id(getattr(c, "connection", None)))
        for c in cmds
    ]


def test_coalesce_sends_merges_only_adjacent_writes_to_one_tcp_connection() -> None:
    from mitmproxy.proxy import commands

    a, b, udp = _conn(), _conn(), _conn("udp")
    cmds = [
        commands.SendData(a, b"head"),
        commands.SendData(a, b"body"),
        commands.SendData(b, b"other"),
        commands.SendData(a, b"x"),
        commands.CloseConnection(a),
        commands.SendData(a, b"y"),
        commands.SendData(udp, b"d1"),
        commands.SendData(udp, b"d2"),
        commands.SendData(a, b"z"),
    ]
    out = list(mitm_hotpaths.coalesce_sends(iter(cmds)))
    assert _summary(out) == [
        ("SendData", id(a), b"headbody"),
        ("SendData", id(b), b"other"),
        ("SendData", id(a), b"x"),
        ("CloseConnection", id(a)),
        ("SendData", id(a), b"y"),
        ("SendData", id(udp), b"d1"),
        ("SendData", id(udp), b"d2"),  # datagrams: never merged
        ("SendData", id(a), b"z"),
    ]
    # positive control: the same stream without the merge keeps every write apart, bytes in the same order
    assert b"".join(c.data for c in out if isinstance(c, commands.SendData)) == b"".join(
        c.data for c in cmds if isinstance(c, commands.SendData)
    )


def test_coalesce_sends_never_merges_large_writes() -> None:
    from mitmproxy.proxy import commands

    a = _conn()
    big = b"x" * mitm_hotpaths.COALESCE_MAX
    small = b"y" * 10
    out = list(
        mitm_hotpaths.coalesce_sends(
            iter(
                [
                    commands.SendData(a, small),
                    commands.SendData(a, big),
                    commands.SendData(a, small),
                    commands.SendData(a, small),
                ]
            )
        )
    )
    assert [len(c.data) for c in out] == [10, len(big), 20]


def test_coalesce_sends_writes_what_it_holds_before_a_layer_error() -> None:
    from mitmproxy.proxy import commands

    a = _conn()

    def layer():
        yield commands.SendData(a, b"head")
        raise RuntimeError("layer crashed")

    seen = []
    with pytest.raises(RuntimeError, match="layer crashed"):
        for c in mitm_hotpaths.coalesce_sends(layer()):
            seen.append(c)
    assert _summary(seen) == [("SendData", id(a), b"head")]


def _normalized_body(fn) -> str:
    """The statements of one server_event pass as an AST dump (mitmproxy's: the body of its `async with`;
    ours: `_one_pass` without its docstring), with what the copy may spell differently made equal:
    `server.X` vs `X`, f-strings without placeholders, and the one marked change (coalesce_sends(x) -> x)."""
    import ast
    import inspect
    import textwrap

    class Norm(ast.NodeTransformer):
        def visit_Attribute(self, node):
            self.generic_visit(node)
            if isinstance(node.value, ast.Name) and node.value.id == "server":
                return ast.copy_location(ast.Name(id=node.attr, ctx=node.ctx), node)
            return node

        def visit_JoinedStr(self, node):
            if all(isinstance(v, ast.Constant) for v in node.values):
                return ast.copy_location(ast.Constant("".join(v.value for v in node.values)), node)
            return self.generic_visit(node)

        def visit_Call(self, node):
            self.generic_visit(node)
            if isinstance(node.func, ast.Name) and node.func.id == "coalesce_sends":
                return node.args[0]
            return node

    body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if len(body) == 1 and isinstance(body[0], ast.AsyncWith):
        body = body[0].body  # mitmproxy's: everything happens under the handler's lock
    return ast.dump(Norm().visit(ast.Module(body=body, type_ignores=[])))


def test_one_pass_is_mitmproxys_server_event_but_for_coalesce_sends() -> None:
    """Re-checked on every mitmproxy upgrade: the copy differs from the original in the one marked line."""
    import inspect

    ours = _normalized_body(mitm_hotpaths._one_pass)
    assert "register_activity" in ours and "StartHook" in ours
    assert ours == _normalized_body(mitm_hotpaths._ORIGINAL_SERVER_EVENT)
    assert "coalesce_sends" in inspect.getsource(mitm_hotpaths._one_pass)


class _Handler:
    """The parts of a ConnectionHandler a pass touches, with a scripted layer: each event yields the
    commands `script[event]` lists; a `StartHook` runs mitmproxy's hook_task as an eager task, and the
    hook itself either finishes at once or waits for `release` (as a hook waiting for I/O does)."""

    def __init__(self, script: dict, slow_hooks: set[str]) -> None:
        self.script, self.slow_hooks = script, slow_hooks
        self.seen: list[str] = []
        self.release = asyncio.Event()
        self.transports: dict = {}
        self.client = _conn()
        self.timeout_watchdog = _watchdog()
        self._server_event_lock = asyncio.Lock()
        handler = self

        class Layer:
            def handle_event(self, event):
                name = getattr(event, "command", None)
                label = f"completed:{name.name}" if name is not None else type(event).__name__
                handler.seen.append(label)
                yield from handler.script.get(label, [])

        self.layer = Layer()

    server_event = mitm_hotpaths._server_event
    hook_task = server.ConnectionHandler.hook_task

    async def handle_hook(self, hook) -> None:
        if hook.name in self.slow_hooks:
            await self.release.wait()

    def log(self, message, level=None, exc_info=None) -> None:
        raise AssertionError(message)


async def test_hooks_that_finish_at_once_complete_in_the_same_pass_in_order() -> None:
    """Two hooks started in one pass, the first finishing at once, the second waiting: the first's
    HookCompleted is processed before server_event returns (no loop iteration in between), and the
    events keep mitmproxy's order; the waiting one completes after it is released, through the lock."""
    from mitmproxy.proxy import events
    from mitmproxy.proxy.layers import http as http_layers

    # real hook commands (no flow needed: the scripted handler never reads their arguments)
    fast, slow, third = (
        http_layers.HttpRequestHook(None),
        http_layers.HttpResponseHook(None),
        http_layers.HttpResponseHeadersHook(None),
    )
    asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)
    try:
        h = _Handler({"Start": [fast, slow], "completed:request": [third]}, {"response"})
        await h.server_event(events.Start())
        # positive control for "same pass": with mitmproxy's server_event the completions come later
        assert h.seen == ["Start", "completed:request", "completed:responseheaders"]
        h.release.set()
        for _ in range(100):
            if "completed:response" in h.seen:
                break
            await asyncio.sleep(0.01)
        assert h.seen == ["Start", "completed:request", "completed:responseheaders", "completed:response"]
        assert h.__dict__.get("_eg_deferred") is None
    finally:
        asyncio.get_running_loop().set_task_factory(None)


async def test_mitmproxys_own_server_event_completes_them_an_iteration_later() -> None:
    """The positive control of the test above: the same script through mitmproxy's original server_event
    has not processed the first hook's completion when server_event returns."""
    from mitmproxy.proxy import events
    from mitmproxy.proxy.layers import http as http_layers

    asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)
    try:
        h = _Handler({"Start": [http_layers.HttpRequestHook(None)]}, set())
        h.server_event = lambda ev: mitm_hotpaths._ORIGINAL_SERVER_EVENT(h, ev)
        await h.server_event(events.Start())
        assert h.seen == ["Start"]
        for _ in range(100):
            if len(h.seen) == 2:
                break
            await asyncio.sleep(0.01)
        assert h.seen == ["Start", "completed:request"]
    finally:
        asyncio.get_running_loop().set_task_factory(None)


def test_install_swaps_server_event_and_uninstall_restores_it(restore) -> None:
    mitm_hotpaths.install()
    assert server.ConnectionHandler.server_event is mitm_hotpaths._server_event
    mitm_hotpaths.uninstall()
    assert server.ConnectionHandler.server_event is mitm_hotpaths._ORIGINAL_SERVER_EVENT
