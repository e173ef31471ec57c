"""The gateway's message type check gives mitmproxy's verdicts (accept / TypeError) for every field."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from mitmproxy import http
from mitmproxy.test import tutils
from mitmproxy.utils import typecheck as mitm_typecheck

from egressgate.gateway.mitm import typecheck

SAMPLES = [b"x", "x", 1, 0, True, 1.5, None, http.Headers(), [], (), object(), bytearray(b"x")]


def _verdict(check, name, value, annotation) -> bool:
    try:
        check(name, value, annotation)
        return True
    except TypeError:
        return False


@pytest.mark.parametrize("cls", [http.RequestData, http.ResponseData])
def test_same_verdict_as_mitmproxy_for_every_field_and_value(cls):
    for f in dataclasses.fields(cls):
        accepted = typecheck.accepted_types(f.type)
        for value in SAMPLES:
            theirs = _verdict(mitm_typecheck.check_option_type, f.name, value, f.type)
            ours = accepted is not None and isinstance(value, accepted)
            assert not ours or theirs, (cls.__name__, f.name, value)  # never accept what mitmproxy refuses


def test_annotations_it_does_not_understand_go_to_mitmproxy():
    assert typecheck.accepted_types(tuple[int, str]) is None
    assert typecheck.accepted_types(typing.Sequence[int]) is None
    assert typecheck.accepted_types("bytes") is None
    assert typecheck.accepted_types(float) == (float, int)
    assert typecheck.accepted_types(bytes | None) == (bytes, type(None))


def _request_data(**override) -> http.RequestData:
    fields = {"http_version": b"HTTP/1.1", "headers": http.Headers(), "content": b"", "trailers": None,
              "timestamp_start": 1, "timestamp_end": None, "host": "example.com", "port": 80,
              "method": b"GET", "scheme": b"http", "authority": b"", "path": b"/"}
    return http.RequestData(**{**fields, **override})


def test_installed_check_still_refuses_a_wrong_type():
    """Positive control first: mitmproxy's own check refuses a str method; then the installed one does."""
    before = http.MessageData.__post_init__
    http.MessageData.__post_init__ = typecheck._original_post_init
    try:
        with pytest.raises(TypeError, match="for method"):
            _request_data(method="GET")
        assert typecheck.install()
        assert http.MessageData.__post_init__ is typecheck._post_init
        with pytest.raises(TypeError, match="Expected <class 'bytes'> for method"):
            _request_data(method="GET")
        with pytest.raises(TypeError, match="for port"):
            _request_data(port="80")
        with pytest.raises(TypeError, match="for timestamp_start"):
            _request_data(timestamp_start="now")
        with pytest.raises(TypeError, match="for content"):
            _request_data(content="text")
        assert _request_data(content=None, timestamp_start=1.5).timestamp_start == 1.5
        with pytest.raises(TypeError, match="for status_code"):
            tutils.tresp(status_code="200")
        assert tutils.tresp(status_code=204).status_code == 204
    finally:
        http.MessageData.__post_init__ = before
