"""MCP mediation, transport-independent: strict JSON-RPC (jsonrpc.py), SSE (sse.py), tool and server
pins (schema.py), the per-session mediator (mediator.py) and its audit records (records.py). The
gateway (remote servers) and `egressgate mcp run` (local stdio servers) are thin transports over it.
"""
