"""Tunnels whose bytes the gateway does not read: `tls: passthrough` (SNI check, then splice)."""
