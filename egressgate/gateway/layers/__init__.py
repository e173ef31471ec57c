"""Protocol layers over mitmproxy's internals: the layer choice (NextLayer), the bounded TLS, HTTP/1, HTTP/2 and
websocket layers with their framing limits, early answers, the transparent listener's and a refused tunnel's
layers.
"""
