"""The fail-closed guard behind tls_limits: a client TLS handshake that did not run on
BoundedClientTLSLayer (its ClientHello was buffered without the gateway's bound, e.g. a layer built by
code other than `client_tls_layer()` after a mitmproxy upgrade) is cut at `tls_clienthello`.

Driven through mitmproxy's own layer objects (sans-io, as test_ws_layer.py does): the end-to-end bound is
tests/gateway/test_client_hello_limit.py; this shows the guard tells the two layers apart."""

from __future__ import annotations

from types import SimpleNamespace

from mitmproxy import options
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import modes, tls
from mitmproxy.test import tflow
from mitmproxy.tls import ClientHelloData

from egressgate.gateway.layers.next_layer import NextLayer
from egressgate.gateway.layers.tls_limits import BoundedClientTLSLayer


def _hello_on(layer_factory) -> list[str]:
    context = Context(tflow.tclient_conn(), options.Options())
    modes.HttpProxy(context)  # the explicit proxy's root layer, as in the gateway
    layer_factory(context)  # a layer registers itself in context.layers
    aborted: list[str] = []
    addon = NextLayer(SimpleNamespace(abort_connection=aborted.append))
    addon.tls_clienthello(ClientHelloData(context=context, client_hello=None))  # type: ignore[arg-type]
    return aborted


def test_handshake_on_mitmproxys_stock_layer_is_aborted():
    client_id = []
    aborted = _hello_on(lambda ctx: client_id.append(ctx.client.id) or tls.ClientTLSLayer(ctx))
    assert aborted == client_id


def test_handshake_on_the_bounded_layer_passes():
    # positive control: the layer every gateway code path builds is accepted
    assert _hello_on(lambda ctx: BoundedClientTLSLayer(ctx, 64 * 1024, None, None)) == []
