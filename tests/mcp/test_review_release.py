"""Adversarial review: the JSON-RPC ids a streamable-HTTP POST reserved are freed when its exchange ends
without answering them (an upstream 503 or 202, a connection error, a JSON answer that answers something
else), each such call recorded `no_response` once with why. Before the fix they stayed reserved for the
whole session: the client's retry of the same id was refused `id_in_use`, and a long session reached
MAX_WAITING (`too_many_pending`), after which every call was refused. Real gateway, real upstream
(tests/mcp/servers.py `_rogue`), real audit sink."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest

from egressgate.mcp import mediator
from tests.mcp.mediator_world import World, answer, body, call, initialize
from tests.mcp.remote_world import ROGUE, RemoteWorld, open_remote_world


@pytest.fixture(scope="module")
def rw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteWorld]:
    with open_remote_world(tmp_path_factory.mktemp("mcp-release")) as world:
        yield world


def _lookup(jsonrpc_id: int) -> dict:
    return {"jsonrpc": "2.0", "id": jsonrpc_id, "method": "tools/call",
            "params": {"name": "lookup", "arguments": {"ticket": "T-1"}}}


ACCEPT = {"Accept": "application/json, text/event-stream"}


@pytest.mark.parametrize("status", [503, 202])
def test_an_unanswered_call_frees_its_id_and_is_recorded_no_response_once(rw: RemoteWorld, status: int) -> None:
    sbx = rw.admit()
    url = f"https://{ROGUE}:{rw.mcp.port}/rogue/mcp/"
    with sbx.raw() as client:
        first = client.post(url + str(status), json=_lookup(61), headers=ACCEPT)
        assert first.status_code == status
        retry = client.post(url + "plain", json=_lookup(61), headers=ACCEPT)  # main: 400 id_in_use
    assert retry.status_code == 200, retry.text
    assert json.loads(retry.content)["result"]["content"][0]["text"] == "fine"
    outcomes = rw.records(sbx, "outcome", at_least=2, **{"egressgate.mcp.jsonrpc_id": "61"})
    lost = [r for r in outcomes if r.get("egressgate.mcp.outcome") == "no_response"]
    assert len(lost) == 1 and lost[0]["egressgate.detail"] == f"http_status={status}"
    assert [r["egressgate.mcp.outcome"] for r in outcomes if r not in lost] == ["result"]
    calls = rw.records(sbx, at_least=2)
    assert {r["egressgate.request.id"] for r in calls} == {r["egressgate.request.id"] for r in outcomes}


def test_a_connection_cut_mid_answer_frees_the_id(rw: RemoteWorld) -> None:
    sbx = rw.admit()
    url = f"https://{ROGUE}:{rw.mcp.port}/rogue/mcp/"
    with sbx.raw() as client, contextlib.suppress(httpx.TransportError):  # cut mid-answer: no (complete) answer
        assert b'"fine"' not in client.post(url + "cut", json=_lookup(63), headers=ACCEPT).content
    with sbx.raw() as client:
        retry = client.post(url + "plain", json=_lookup(63), headers=ACCEPT)  # main: 400 id_in_use
    assert retry.status_code == 200, retry.text
    outcomes = rw.records(sbx, "outcome", at_least=2, **{"egressgate.mcp.jsonrpc_id": "63"})
    assert sorted((r["egressgate.mcp.outcome"], r.get("egressgate.detail")) for r in outcomes) == [
        ("no_response", "connection_error"), ("result", None)]


def test_an_id_pending_on_an_open_answer_stream_is_still_refused(rw: RemoteWorld) -> None:
    """Positive control: an SSE answer still open may yet answer the id, so it stays reserved."""
    sbx = rw.admit()
    url = f"https://{ROGUE}:{rw.mcp.port}/rogue/mcp/"
    with sbx.raw() as streaming, sbx.raw() as other:
        with streaming.stream("POST", url + "slow", json=_lookup(62), headers=ACCEPT) as held:
            assert held.status_code == 200
            reuse = other.post(url + "plain", json=_lookup(62), headers=ACCEPT)
            assert reuse.status_code == 400 and "id_in_use" in reuse.text
            body = held.read()
        assert b'"fine"' in body
        again = other.post(url + "plain", json=_lookup(62), headers=ACCEPT)  # answered: free again
    assert again.status_code == 200, again.text
    outcomes = rw.records(sbx, "outcome", at_least=2, **{"egressgate.mcp.jsonrpc_id": "62"})
    assert [r["egressgate.mcp.outcome"] for r in outcomes] == ["result", "result"]


# ----------------------------------------------------------------- the mediator's rule, on its own
async def test_released_bodies_never_fill_the_bound(mem_world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each body whose exchange ended unanswered gives its ids back: a session of many such calls stays
    usable (main: `too_many_pending` once MAX_WAITING calls were lost), and a released call is recorded once."""
    monkeypatch.setattr(mediator, "MAX_WAITING", 2)  # one call and one ping per body
    s = mem_world.session()
    await initialize(s, "init", "tickets-server", "1", protocol="2025-03-26")  # the protocol with batches
    for jid in range(3):  # (the policy's server budget is 4 calls)
        verdict = await s.from_client(body([call(jid, "note", {}), {"jsonrpc": "2.0", "id": f"p{jid}",
                                                                     "method": "ping"}]))
        assert verdict.forward is not None and verdict.ticket is not None, verdict.replies
        s.release(verdict.ticket, "http_status=503")
        s.release(verdict.ticket, "connection_error")  # the error hook after the response hook: no-op
    lost = await mem_world.wait_records(3, **{"egressgate.operation": "outcome"})
    assert [r["egressgate.detail"] for r in lost] == ["http_status=503"] * 3
    # positive control: the bound itself still holds while calls stay pending
    held = [await s.from_client(body({"jsonrpc": "2.0", "id": f"h{i}", "method": "ping"})) for i in range(3)]
    assert [v.forward is not None for v in held] == [True, True, False]
    assert "too_many_pending" in held[2].replies[0]["error"]["message"]


async def test_a_release_never_frees_an_id_a_later_body_reused(mem_world: World) -> None:
    """Answered, then reused by a later body, then the first body's exchange ends: the reuse stays pending."""
    s = mem_world.session()
    first = await s.from_client(body(call(5, "note", {})))
    await s.from_server_bytes(answer(5, {"content": []}))  # answered (e.g. on the POST's SSE stream)
    second = await s.from_client(body(call(5, "note", {})))
    assert second.forward is not None and first.ticket is not None
    s.release(first.ticket, "no_answer")  # the first POST's stream ends after the reuse
    again = await s.from_client(body(call(5, "note", {})))
    assert again.forward is None and "id_in_use" in again.replies[0]["error"]["message"]
    outcomes = await mem_world.wait_records(1, **{"egressgate.operation": "outcome"})
    assert [r["egressgate.mcp.outcome"] for r in outcomes] == ["result"]  # no no_response for either
