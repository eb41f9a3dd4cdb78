"""Fixtures every layer's tests may use. Helpers that are not fixtures live in
:mod:`hicache_storage.conformance.data`; backend fixtures in ``tests/backends/conftest.py``."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# tests/integrations/sglang/, tests/integrations/vllm/ and tests/integrations/lmcache/ run
# in their own venvs (.venv-sglang, .venv-vllm, .venv-lmcache, with the real engines), so a run over tests/ leaves them out;
# each is collected only when named on the command line, and its conftest then fails the
# run if its engine cannot be imported. scripts/test.sh does both. (The rest of
# tests/integrations/ tests the adapters' engine-free parts, in .venv.)
# tests/backends/test_mooncake.py runs inside a private network namespace (the Mooncake
# client binds wildcard addresses): scripts/test.sh runs it there, alone; named on the
# command line elsewhere, it fails at import and says how to run it.
collect_ignore = [
    "integrations/sglang",
    "integrations/vllm",
    "integrations/lmcache",
    "backends/test_mooncake.py",
]

#: Markers by path (relative to tests/): every test of a matching file or folder gets the
#: marker, so ``-m redis`` or ``-m vllm`` selects what it says (see pyproject's list).
PATH_MARKERS = (
    ("backends/test_file", "file"),
    ("backends/test_redis", "redis"),
    ("backends/test_s3", "s3"),
    ("backends/test_mooncake", "mooncake"),
    ("backends/test_nixl", "nixl"),
    ("integrations/sglang/", "sglang"),
    ("integrations/vllm/", "vllm"),
    ("integrations/lmcache/", "lmcache"),
)
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by its path (:data:`PATH_MARKERS`)."""
    for item in items:
        try:
            rel = item.path.relative_to(TESTS).as_posix()
        except ValueError:
            continue
        for prefix, marker in PATH_MARKERS:
            if rel.startswith(prefix):
                item.add_marker(getattr(pytest.mark, marker))


@pytest.fixture
def root(tmp_path: Path) -> str:
    """A fresh directory for a file-based store."""
    d = tmp_path / "store"
    d.mkdir()
    return str(d)


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory in the real /dev/shm (not created yet), removed afterwards."""
    d = f"/dev/shm/hicache-test-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)
