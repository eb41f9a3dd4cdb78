"""Zero-code entry: ``pytest --pyargs hicache_storage.conformance --hicache-storage-backend NAME``."""

from __future__ import annotations

from hicache_storage.conformance.suite import BackendConformance


class TestConformance(BackendConformance):
    """The kit on the backend named by ``--hicache-storage-backend`` (or its env var)."""
