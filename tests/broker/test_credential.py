"""A Credential never shows its value: repr, str, format, logging, pickling, exceptions."""

from __future__ import annotations

import logging
import pickle

import pytest

from egressgate.broker.credential import Credential

VALUE = "sk-super-secret-value-123456"


def test_value_never_rendered(caplog) -> None:
    cred = Credential("openai", VALUE, "kv:secret/x@v1", 1.0, 2.0)
    assert cred.value == VALUE  # reachable by name only
    logged = "%s %r" % (cred, cred)  # noqa: UP031 (logging-style formatting is the point)
    for text in (repr(cred), str(cred), f"{cred}", f"{cred!r}", f"{cred:>200}", logged):
        assert VALUE not in text and "openai" in text and "<redacted>" in text
    assert VALUE not in repr([cred]) and VALUE not in repr({"c": cred})
    caplog.set_level(logging.DEBUG)
    logging.getLogger("egressgate.test").debug("cred %s %r", cred, cred)
    logging.getLogger("egressgate.test").exception("boom", exc_info=ValueError(cred))
    assert caplog.records and VALUE not in caplog.text


def test_cannot_be_pickled() -> None:
    with pytest.raises(TypeError):
        pickle.dumps(Credential("openai", VALUE, "k", 1.0, 2.0))


def test_reuse_window() -> None:
    cred = Credential("c", VALUE, "k", 100.0, 200.0)
    assert cred.reusable(179.9, 0.8) and not cred.reusable(180.0, 0.8)
