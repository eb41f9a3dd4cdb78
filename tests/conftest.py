"""Fixtures every layer's tests may use. Helpers that are not fixtures live in
:mod:`hicache_storage.conformance.data`; backend fixtures in ``tests/backends/conftest.py``."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def root(tmp_path: Path) -> str:
    """A fresh directory for a file-based store."""
    d = tmp_path / "store"
    d.mkdir()
    return str(d)
