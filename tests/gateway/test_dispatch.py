"""The gateway's hook table dispatches like mitmproxy's AddonManager, but only to implementers.

Every semantic test runs against both managers (mitmproxy's stock one is the positive control: the
behaviour the gateway's fail-closed wrappers were written against must not change)."""

from __future__ import annotations

import logging

import pytest
from mitmproxy import addonmanager, exceptions, hooks, options
from mitmproxy import master as mitm_master
from mitmproxy.proxy.layers.http import HttpRequestHeadersHook, HttpRequestHook
from mitmproxy.test import tflow

from egressgate.gateway.failclosed import FailClosed
from egressgate.gateway.mitm import dispatch


class Recorder:
    def __init__(self, name: str, calls: list, halt: bool = False, fail: bool = False) -> None:
        self.name = name
        self.calls = calls
        self.halt = halt
        self.fail = fail

    async def requestheaders(self, flow):
        self.calls.append((self.name, "requestheaders"))
        if self.fail:
            raise RuntimeError("bug in " + self.name)
        if self.halt:
            raise exceptions.AddonHalt()

    def request(self, flow):
        self.calls.append((self.name, "request"))


class Counting:
    """Counts hook lookups: an addon that implements nothing should never be asked per event."""

    name = "counting"

    def __init__(self) -> None:
        self.lookups = 0

    def __getattr__(self, attr: str):
        if attr in ("requestheaders", "request", "update"):
            self.lookups += 1
        raise AttributeError(attr)


class Updater:
    name = "updater"

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def update(self, flows):
        self.calls.append(("updater", "update", len(flows)))


@pytest.fixture(params=["stock", "table"])
async def master(request):
    m = mitm_master.Master(options.Options(), with_termlog=False)
    if request.param == "table":
        assert isinstance(dispatch.install(m), dispatch.HookTable)
    else:
        assert type(m.addons) is addonmanager.AddonManager
    return m


async def test_order_and_halt_stop_the_chain(master):
    calls: list = []
    master.addons.add(Recorder("a", calls), Recorder("b", calls, halt=True), Recorder("c", calls))
    flow = tflow.tflow()
    await master.addons.handle_lifecycle(HttpRequestHeadersHook(flow))
    assert calls == [("a", "requestheaders"), ("b", "requestheaders")]  # c never ran: a halt is final
    await master.addons.handle_lifecycle(HttpRequestHook(flow))
    assert calls[2:] == [("a", "request"), ("b", "request"), ("c", "request")]


async def test_an_exception_is_logged_and_the_next_addon_runs(master, caplog):
    calls: list = []
    master.addons.add(Recorder("a", calls, fail=True), Recorder("b", calls))
    with caplog.at_level(logging.ERROR):
        await master.addons.handle_lifecycle(HttpRequestHeadersHook(tflow.tflow()))
    assert calls == [("a", "requestheaders"), ("b", "requestheaders")]
    assert any("Addon error: bug in a" in r.getMessage() for r in caplog.records)


async def test_fail_closed_wrapper_refuses_and_halts_later_addons(master):
    """The security property dispatch must keep: a crashing check answers a deny and no later addon
    (e.g. one that would forward or record the flow as allowed) sees the hook."""
    calls: list = []
    master.addons.add(FailClosed(Recorder("check", calls, fail=True), lambda _c: None), Recorder("later", calls))
    flow = tflow.tflow()
    flow.response = None
    await master.addons.handle_lifecycle(HttpRequestHeadersHook(flow))
    assert calls == [("check", "requestheaders")]
    assert flow.response is not None and flow.response.status_code == 500


async def test_update_hook_runs_for_flows_when_an_addon_implements_it(master):
    calls: list = []
    master.addons.add(Recorder("a", calls), Updater(calls))
    await master.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))
    assert calls == [("a", "request"), ("updater", "update", 1)]


async def test_addons_added_later_are_dispatched_to(master):
    calls: list = []
    master.addons.add(Recorder("a", calls))
    await master.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))
    master.addons.add(Recorder("b", calls))
    await master.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))
    assert calls == [("a", "request"), ("a", "request"), ("b", "request")]
    master.addons.remove(master.addons.get("a"))
    await master.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))
    assert calls[-1] == ("b", "request") and len(calls) == 4


async def test_option_changes_still_reach_configure(master):
    """install() moves the options' `changed` signal to the new manager (exactly one configure)."""
    seen: list = []

    class Conf:
        def configure(self, updated):
            seen.append(set(updated))

    master.addons.add(Conf())
    seen.clear()
    master.options.update(listen_port=8181)
    assert seen == [{"listen_port"}]
    master.addons.trigger(hooks.ConfigureHook({"x"}))
    assert seen[-1] == {"x"}


async def test_table_looks_hooks_up_once_not_per_event():
    """mitmproxy's manager asks every addon for every hook on every event (the cost this module removes);
    the table asks once per hook name."""
    stock = mitm_master.Master(options.Options(), with_termlog=False)
    table = mitm_master.Master(options.Options(), with_termlog=False)
    dispatch.install(table)
    for m in (stock, table):
        counting = Counting()
        m.addons.add(counting)
        counting.lookups = 0
        for _ in range(10):
            await m.addons.handle_lifecycle(HttpRequestHeadersHook(tflow.tflow()))
        if m is stock:
            assert counting.lookups >= 20  # requestheaders + update, every time
        else:
            assert counting.lookups == 2  # requestheaders and update, once each


async def test_install_refuses_a_manager_that_already_has_addons():
    m = mitm_master.Master(options.Options(), with_termlog=False)
    m.addons.add(Recorder("a", []))
    with pytest.raises(RuntimeError):
        dispatch.install(m)
