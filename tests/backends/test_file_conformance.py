"""The conformance kit on the ``file`` backend (dogfooding: the same checks vendors run)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hicache_storage import HiCacheStorage
from hicache_storage.conformance import BackendConformance, BackendSpec

pytestmark = pytest.mark.file


class TestFileConformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self, tmp_path: Path) -> BackendSpec:
        return BackendSpec("file", {"root": str(tmp_path / "store")})

    @pytest.fixture
    def break_store(
        self, broken_directory: Callable[[HiCacheStorage], Any]
    ) -> Callable[[HiCacheStorage], Any]:
        return broken_directory


class TestFileConformanceFsyncOneThread(TestFileConformance):
    """The same checks with fsync on, a single I/O thread and a capacity limit."""

    @pytest.fixture
    def backend_spec(self, tmp_path: Path) -> BackendSpec:
        opts = {"root": str(tmp_path / "store"), "fsync": True, "io_threads": 1, "max_size": "1GiB"}
        return BackendSpec("file", opts)
