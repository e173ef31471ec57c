"""A crashing addon refuses the flow instead of letting mitmproxy carry on with it (fail closed)."""

from __future__ import annotations

import asyncio
import json

import pytest
from mitmproxy import exceptions
from mitmproxy.proxy import server_hooks
from mitmproxy.test import tflow

from egressgate.gateway.failclosed import FailClosed


class Broken:
    name = "broken"

    def requestheaders(self, flow):
        raise RuntimeError("bug in a check")

    async def http_connect(self, flow):
        raise KeyError("bug")

    def responseheaders(self, flow):
        raise ValueError("bug in the scrubber")

    def tcp_message(self, flow):
        raise RuntimeError("bug")

    def server_connect(self, data):
        raise RuntimeError("bug")

    def error(self, flow):
        raise RuntimeError("logging bug")

    def load(self, loader):
        raise RuntimeError("startup bug")


class Fine:
    def requestheaders(self, flow):
        flow.metadata["seen"] = True


@pytest.fixture
def guarded():
    aborted: list[str] = []
    return FailClosed(Broken(), aborted.append), aborted


def test_request_hooks_answer_500_deny_and_halt_the_chain(guarded):
    addon, _ = guarded
    flow = tflow.tflow()
    with pytest.raises(exceptions.AddonHalt):
        addon.requestheaders(flow)
    assert flow.response is not None and flow.response.status_code == 500
    assert flow.response.headers["X-Egressgate-Decision"] == "deny"
    assert json.loads(flow.response.content)["reason"] == "internal_error"


def test_request_with_pending_chunked_body_is_answered_not_killed(guarded):
    """A body still to come no longer forces a kill: the 500 goes out before the body is read
    (gateway/layers/early_answer.py; end to end in test_big_body_deny.py), so the client reads why."""
    addon, _ = guarded
    flow = tflow.tflow()
    flow.request.headers["transfer-encoding"] = "chunked"
    with pytest.raises(exceptions.AddonHalt):
        addon.requestheaders(flow)
    assert flow.response is not None and flow.response.status_code == 500 and flow.error is None
    assert json.loads(flow.response.content)["reason"] == "internal_error"
    assert flow.request.stream is False


def test_request_hook_after_a_streamed_body_kills(guarded):
    class BrokenRequest:
        def request(self, flow):
            raise RuntimeError("bug after the body was streamed")

    addon = FailClosed(BrokenRequest(), lambda _id: None)
    flow = tflow.tflow()
    flow.request.stream = True
    with pytest.raises(exceptions.AddonHalt):
        addon.request(flow)
    assert flow.response is None and flow.error is not None


def test_async_hook_refuses_connect(guarded):
    addon, _ = guarded
    flow = tflow.tflow()
    flow.request.method = "CONNECT"
    with pytest.raises(exceptions.AddonHalt):
        asyncio.run(addon.http_connect(flow))
    assert flow.response.status_code == 500


def test_response_phase_failure_kills_the_flow(guarded):
    addon, _ = guarded
    flow = tflow.tflow(resp=True)
    with pytest.raises(exceptions.AddonHalt):
        addon.responseheaders(flow)
    assert flow.error is not None and flow.error.msg == "Connection killed."


def test_tcp_and_server_connect(guarded):
    addon, aborted = guarded
    flow = tflow.ttcpflow()
    with pytest.raises(exceptions.AddonHalt):
        addon.tcp_message(flow)
    assert flow.error is not None
    data = server_hooks.ServerConnectionHookData(server=flow.server_conn, client=flow.client_conn)
    with pytest.raises(exceptions.AddonHalt):
        addon.server_connect(data)
    assert data.server.error and aborted == [flow.client_conn.id]


def test_after_the_fact_hooks_only_log_and_lifecycle_errors_surface(guarded):
    addon, _ = guarded
    flow = tflow.tflow(resp=True)
    with pytest.raises(exceptions.AddonHalt):
        addon.error(flow)
    assert flow.error is None  # nothing to enforce after the fact
    with pytest.raises(RuntimeError, match="startup bug"):
        addon.load(None)


def test_working_addon_is_untouched_and_keeps_its_name():
    fine = FailClosed(Fine(), lambda _id: None)
    flow = tflow.tflow()
    fine.requestheaders(flow)
    assert flow.metadata["seen"] and flow.response is None
    assert fine.name == "fine"
    assert FailClosed(Broken(), lambda _id: None).name == "broken"
