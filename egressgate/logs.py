"""The gateway's own log (stderr): human text by default, or one JSON object per line (`--log-format json`).

Why JSON: a log shipper (Loki, Fluent Bit, a Kubernetes node agent) must not guess where one message ends;
a traceback in text form spans many lines and is split into unrelated entries. In JSON every record is
exactly one line whatever the message or exception contains (newlines are escaped by json.dumps), with
fixed keys: `ts` (RFC 3339, UTC, milliseconds), `level`, `logger`, `message`, and `exception` (the
formatted traceback) when there is one.

This log is for operators; it is not the audit trail (audit/, hash-chained OTLP records). Nothing here
decides or records a request.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Literal

LogFormat = Literal["text", "json"]
FORMATS: tuple[str, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# libraries whose INFO/DEBUG chatter drowns the gateway's own lines
NOISY = ("mitmproxy", "hpack", "aiohttp.access")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, always on one line."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = int(record.created)
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # default=str: an unexpected object in a message argument is logged, never crashes the logger;
        # ensure_ascii keeps control characters and odd bytes from a hostile request escaped
        return json.dumps(out, ensure_ascii=True, default=str)


def configure(level: str | int = "INFO", fmt: LogFormat | str = "text", stream: IO[str] | None = None) -> None:
    """Set up the root logger once for the process (replacing any handler a previous call installed).

    `fmt` is "text" or "json"; anything else is a ValueError (the CLI offers only these two)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
