"""The gateway's cheap Context fork gives exactly what mitmproxy's Context.fork gives."""

from __future__ import annotations

from mitmproxy import connection, options
from mitmproxy.proxy.context import Context

from egressgate.gateway.layers.http_layer import fork


def test_fork_has_the_same_attributes_as_mitmproxys():
    client = connection.Client(peername=("127.0.0.1", 1234), sockname=("127.0.0.1", 8080), timestamp_start=1.0)
    parent = Context(client, options.Options())
    parent.server = connection.Server(address=("198.18.0.1", 80))
    parent.layers = ["outer", "inner"]  # any objects: fork copies the list, not the layers
    theirs, ours = parent.fork(), fork(parent)
    assert vars(ours).keys() == vars(theirs).keys()
    for name in vars(theirs):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.server is parent.server and ours.client is parent.client and ours.options is parent.options
    assert ours.layers is not parent.layers  # a child's layer stack grows without touching the parent's
    ours.layers.append("child")
    assert parent.layers == ["outer", "inner"]
