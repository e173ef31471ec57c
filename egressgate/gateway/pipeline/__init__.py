"""The HTTP pipeline's stages: one mitmproxy addon per module, in master.py's order (docs/architecture.md). A
stage never imports another (tests/architecture/test_stage_imports.py); what stages share lives in
gateway/shared/.
"""
