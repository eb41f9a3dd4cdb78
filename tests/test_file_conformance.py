"""The conformance kit on the ``file`` backend (dogfooding: the same checks vendors run)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_storage import HiCacheStorage
from hicache_storage.conformance import BackendConformance, BackendSpec

pytestmark = pytest.mark.file


@contextlib.contextmanager
def broken_directory(backend: HiCacheStorage) -> Iterator[None]:
    """A real fault: the namespace directory is replaced by a regular file, so every open,
    stat and write below it fails with ENOTDIR; then it is put back."""
    directory = backend.directory  # type: ignore[attr-defined]
    aside = directory + ".aside"
    os.rename(directory, aside)
    Path(directory).write_bytes(b"not a directory")
    try:
        yield
    finally:
        os.unlink(directory)
        os.rename(aside, directory)


class TestFileConformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self, tmp_path: Path) -> BackendSpec:
        return BackendSpec("file", {"root": str(tmp_path / "store")})

    @pytest.fixture
    def break_store(self) -> Callable[[HiCacheStorage], Any]:
        return broken_directory


class TestFileConformanceFsyncOneThread(TestFileConformance):
    """The same checks with fsync on, a single I/O thread and a capacity limit."""

    @pytest.fixture
    def backend_spec(self, tmp_path: Path) -> BackendSpec:
        opts = {"root": str(tmp_path / "store"), "fsync": True, "io_threads": 1, "max_size": "1GiB"}
        return BackendSpec("file", opts)
