"""The generated chains the index tests and the benchmark use are what the gateway's encoder writes: the
same bytes as ChainWriter + record_from_event, and `audit verify`'s chain check accepts them."""

from __future__ import annotations

import pytest

from egressgate.audit.chain import ChainWriter
from egressgate.audit.record import record_from_event
from egressgate.audit.verify import verify_file
from tests.audit_index.chaingen import HOSTS, T0, event, lines, minimal_record, write_chain


@pytest.mark.parametrize("realistic", [True, False])
def test_chaingen_matches_the_encoder(realistic, tmp_path):
    generated = list(lines(25, realistic=realistic))
    writer = ChainWriter()
    expected = [writer.append(ChainWriter.start_record(T0, "test-key", None))]
    expected += [writer.append(record_from_event(event(i, i % 10 == 0, HOSTS[i % len(HOSTS)], realistic)))
                 for i in range(1, 25)]
    assert generated == [line + b"\n" for line in expected]
    # a continuation links to the last line
    more = list(lines(5, start=25, prev=writer.state.prev, realistic=realistic))
    for i, line in enumerate(more, start=25):
        assert line == writer.append(record_from_event(event(i, i % 10 == 0, HOSTS[i % len(HOSTS)], realistic))) + b"\n"
    path = write_chain(tmp_path / "audit.jsonl", 1000, realistic=realistic)
    report = verify_file(path, {}, require_seal=False)  # no checkpoints: the chain itself must verify
    assert report.ok and report.records == 1000, report.error


def test_minimal_chain_matches_the_encoder(tmp_path):
    """The cheapest records (the 1,000,000-record test): still ChainWriter's bytes, still a valid chain."""
    generated = list(lines(30, realistic=None))
    writer = ChainWriter()
    expected = [writer.append(ChainWriter.start_record(T0, "test-key", None))]
    expected += [writer.append(minimal_record(i)) for i in range(1, 30)]
    assert generated == [line + b"\n" for line in expected]
    assert list(lines(3, start=30, prev=writer.state.prev, realistic=None)) == [
        writer.append(minimal_record(i)) + b"\n" for i in range(30, 33)]
    path = write_chain(tmp_path / "audit.jsonl", 1000, realistic=None)
    report = verify_file(path, {}, require_seal=False)
    assert report.ok and report.records == 1000, report.error
