"""The test suite is one package: every test and helper imports as `tests.<folder>.<module>` (one import root).

Shared harness code lives in tests/support/ (see its README.md); conftest.py files only define fixtures.
"""
