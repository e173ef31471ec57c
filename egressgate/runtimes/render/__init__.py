"""Deployment files for runtimes egressgate does not start itself: Kubernetes, compose, Firecracker.

Each target is one module building Python data (dumped with yaml/json, never assembled as text, except
the nftables script, whose inputs are validated first); cli.py is `egressgate runtime render`.
"""
