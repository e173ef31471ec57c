"""The remote MCP route in the gateway (McpRoute and what it uses). The mediator that decides each message is
egressgate/mcp/; the policy side is egressgate/policy/mcp_*.py; the local (stdio) relay is admin/mcp_api.py.
"""
