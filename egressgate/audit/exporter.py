"""OTLP/HTTP export of audit records through the OpenTelemetry SDK's log exporter.

Why the SDK exporter is called directly instead of through a BatchLogRecordProcessor: the processor
drops records silently on failure and gives the caller no result, but the audit sink must know whether a
record reached the collector when the exporter is its only destination (then a failed export is a failed
write and the request is denied). `export()` is synchronous (requests); the sink runs it in a thread.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from egressgate.audit.record import SCOPE_NAME, SCOPE_VERSION, SERVICE_NAME, Record

log = logging.getLogger(__name__)


class OtlpHttpExporter:
    """Sends `Record`s to `endpoint` (full URL, e.g. http://collector:4318/v1/logs) as OTLP/protobuf."""

    def __init__(self, endpoint: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> None:
        self.endpoint = endpoint
        self._exporter = OTLPLogExporter(endpoint=endpoint, timeout=timeout, headers=headers)
        self._resource = Resource.create({"service.name": SERVICE_NAME})
        self._scope = InstrumentationScope(SCOPE_NAME, SCOPE_VERSION)

    def _readable(self, record: Record) -> ReadableLogRecord:
        sdk_record = LogRecord(
            timestamp=record.time_ns,
            observed_timestamp=record.time_ns,
            severity_number=SeverityNumber(record.severity_number),
            severity_text=record.severity_text,
            body=record.body,
            attributes=dict(record.attributes),
            event_name=record.event_name,
        )
        return ReadableLogRecord(
            log_record=sdk_record, resource=self._resource, instrumentation_scope=self._scope
        )

    def export(self, records: Sequence[Record]) -> bool:
        """True when the collector accepted the batch (blocking; run it off the event loop)."""
        if not records:
            return True
        try:
            result = self._exporter.export([self._readable(r) for r in records])
        except Exception:  # the SDK should not raise, but a raising exporter must not kill the sink
            log.exception("OTLP export to %s raised", self.endpoint)
            return False
        return result is LogRecordExportResult.SUCCESS

    def shutdown(self) -> None:
        self._exporter.shutdown()
