"""Packaging metadata of the license: an SPDX expression (PEP 639; the TOML-table form is deprecated and
setuptools stops building it after 2027-02-18) and the Apache-2.0 text shipped as LICENSE."""

from __future__ import annotations

import hashlib
import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"  # apache.org's LICENSE-2.0.txt


def test_license_is_an_spdx_string_with_its_file() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert conf["project"]["license"] == "Apache-2.0"
    assert conf["project"]["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in conf["build-system"]["requires"]  # the first setuptools that reads both
    assert hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_0_SHA256


def test_installed_metadata_carries_the_expression() -> None:
    meta = importlib.metadata.metadata("egressgate")
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
