"""OTLP/HTTP export through the OpenTelemetry SDK exporter, received by a real local aiohttp collector."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from aiohttp import web
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)

from egressgate.audit.event import AuditUnavailable
from egressgate.audit.exporter import OtlpHttpExporter
from egressgate.audit.filesink import FileSink
from egressgate.audit.find import iter_records
from tests.support.audit_events import http_event


class Receiver:
    def __init__(self) -> None:
        self.records: list = []
        self.status = 200

    async def handle(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        msg = ExportLogsServiceRequest()
        msg.ParseFromString(await request.read())
        if self.status != 200:
            return web.Response(status=self.status)
        for rl in msg.resource_logs:
            for sl in rl.scope_logs:
                self.records.extend(sl.log_records)
        return web.Response(body=ExportLogsServiceResponse().SerializeToString(), content_type="application/x-protobuf")

    def attrs(self, i: int) -> dict:
        out = {}
        for kv in self.records[i].attributes:
            v = kv.value
            out[kv.key] = (
                v.string_value if v.HasField("string_value") else (v.int_value if v.HasField("int_value") else v)
            )
        return out


@pytest.fixture
async def receiver():
    rec = Receiver()
    app = web.Application()
    app.router.add_post("/v1/logs", rec.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    rec.endpoint = f"http://127.0.0.1:{port}/v1/logs"
    yield rec
    await runner.cleanup()


def closed_port_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1/logs"  # nothing listens there now


async def test_file_and_exporter_send_the_same_records(receiver, tmp_path, signer):
    sink = await FileSink(
        tmp_path / "a" / "audit.jsonl", signer, exporter=OtlpHttpExporter(receiver.endpoint, timeout=2)
    ).start()
    events = [http_event(i) for i in range(5)]
    await asyncio.gather(*(sink.write(e) for e in events))
    await sink.close()
    local = [f.record.attributes for f in iter_records([sink.path])]
    assert len(receiver.records) == len(local) == 7  # chain_start + 5 + final checkpoint
    by_seq = {receiver.attrs(i)["egressgate.chain.seq"]: receiver.attrs(i) for i in range(len(receiver.records))}
    for a in local:
        remote = by_seq[a["egressgate.chain.seq"]]
        assert remote["egressgate.chain.hash"] == a["egressgate.chain.hash"]
        assert remote["egressgate.operation"] == a["egressgate.operation"]
    first = next(i for i in range(7) if receiver.attrs(i)["egressgate.operation"] == "http_request")
    r = receiver.attrs(first)
    assert r["http.request.method"] == "POST" and r["server.port"] == 443
    assert receiver.records[first].severity_number == 9
    assert receiver.records[first].event_name == "egressgate.http_request"


async def test_exporter_only_is_durable_when_write_returns(receiver, signer):
    sink = await FileSink(None, signer, exporter=OtlpHttpExporter(receiver.endpoint, timeout=2)).start()
    ev = http_event(1)
    await sink.write(ev)
    ids = [receiver.attrs(i).get("egressgate.request.id") for i in range(len(receiver.records))]
    assert ev.request_id in ids
    await sink.close()


@pytest.mark.parametrize("mode", ["refused", "http_503"])
async def test_exporter_only_and_down_denies(receiver, signer, mode):
    endpoint = closed_port_endpoint() if mode == "refused" else receiver.endpoint
    receiver.status = 503
    sink = await FileSink(None, signer, exporter=OtlpHttpExporter(endpoint, timeout=1)).start()
    started = time.monotonic()
    with pytest.raises(AuditUnavailable):
        await sink.write(http_event(1))
    assert not sink.healthy()
    assert time.monotonic() - started < 10
    await asyncio.wait_for(sink.close(), 10)  # the final checkpoint fails too; close still ends


async def test_exporter_down_with_file_still_writes(tmp_path, signer):
    sink = await FileSink(
        tmp_path / "a" / "audit.jsonl", signer, exporter=OtlpHttpExporter(closed_port_endpoint(), timeout=1)
    ).start()
    ev = http_event(1)
    await sink.write(ev)  # durable in the file: the request is not denied
    assert sink.healthy()
    await sink.close()
    assert sink.export_failures >= 1
    assert ev.request_id in sink.path.read_text()
