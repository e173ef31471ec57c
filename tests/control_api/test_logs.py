"""`egressgate.logs.configure`: the JSON format is one object per line whatever a message or a traceback
contains (a hostile request line with CR/LF cannot forge a second log entry); text stays the default."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from egressgate.logs import configure
from tests.control_api.harness import METRICS_POLICY, api, start_control_gateway
from tests.support.launcher import EGRESSGATE
from tests.support.replay_check import stop_and_replay
from tests.support.waiting import wait_for


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)


def test_json_lines_carry_the_fields_and_exceptions(restore_root):
    out = io.StringIO()
    configure("INFO", "json", stream=out)
    log = logging.getLogger("egressgate.test")
    log.info("request for %s", "evil\r\n{\"level\": \"CRITICAL\", \"message\": \"forged\"}")
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        log.exception("handler failed")
    log.debug("not shown at INFO")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the CR/LF in the argument and the traceback stay inside their records
    first, second = (json.loads(line) for line in lines)
    assert set(first) == {"ts", "level", "logger", "message"}
    assert first["level"] == "INFO" and first["logger"] == "egressgate.test"
    assert first["message"].startswith("request for evil\r\n")
    assert first["ts"].endswith("Z") and first["ts"][10] == "T"
    assert second["level"] == "ERROR" and second["message"] == "handler failed"
    assert "ValueError: boom\nsecond line" in second["exception"] and "Traceback" in second["exception"]


def test_text_is_the_default_and_positive_control_it_spans_lines(restore_root):
    out = io.StringIO()
    configure("INFO", stream=out)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("egressgate.test").exception("handler failed")
    text = out.getvalue()
    assert "ERROR egressgate.test: handler failed" in text and len(text.splitlines()) > 2
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])


def test_unknown_format_is_refused(restore_root):
    with pytest.raises(ValueError, match="text, json"):
        configure("INFO", "yaml")


def test_running_gateway_logs_one_json_object_per_line(world, tmp_path):
    """`egressgate run --log-format json` end to end: a rejected reload (multi-line problem text) and
    normal traffic leave nothing on stderr but JSON lines."""
    wrapper = tmp_path / "egressgate-json"
    wrapper.write_text(f'#!/bin/sh\nexec {EGRESSGATE} "$@" --log-format json\n')
    wrapper.chmod(0o755)
    gw = start_control_gateway(world, tmp_path / "gw", launcher=[str(wrapper)])
    try:
        sbx = gw.admit(METRICS_POLICY)
        with sbx.client() as c:
            assert c.get(sbx.url("api.test", "/echo")).status_code == 200
        broken = gw.policy_dir / "zz-broken.yaml"
        broken.write_text("sandbox: {name: zz-broken}\nnetwork: {https: {allow: [{host: 'exa mple'}]}}\n")
        assert api(gw, "POST", "/v1/policies/reload").status_code == 422
        broken.unlink()
        assert wait_for(lambda: "policy reload rejected" in gw.stderr())
    finally:
        stop_and_replay(gw)
    lines = [line for line in gw.stderr().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line parses
    assert all(set(r) >= {"ts", "level", "logger", "message"} for r in records)
    rejected = [r for r in records if "policy reload rejected" in r["message"]]
    assert rejected and all(r["level"] == "ERROR" for r in rejected)
