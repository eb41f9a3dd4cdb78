"""The servers the engine tests start, and each backend's options on them.

The engine test suites (tests/integrations/sglang/ and tests/integrations/lmcache/) start
one redis-server, one moto S3 server and one Mooncake store per session in their
conftest and record their addresses here; :func:`backend_options` gives every built-in
backend's options against them, in a test's own directory or key prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The URL of the redis-server the integration tests run (set by their conftest).
REDIS_URL: list[str] = []


#: The address of the Mooncake master the integration tests run (set by their conftest).
MOONCAKE_MASTER: list[str] = []

#: The s3 backend's options for the moto server the integration tests run (set by their
#: conftest: endpoint_url, bucket, key, secret, region).
S3_OPTIONS: dict[str, Any] = {}


def backend_options(name: str, tmp_path: Path) -> dict[str, Any]:
    """Options of each backend, in ``tmp_path``, for an engine adapter's config."""
    if name == "redis":
        if not REDIS_URL:
            raise RuntimeError("no redis-server: the engine tests' conftest starts one")
        return {"url": REDIS_URL[0], "prefix": f"sglang-{tmp_path.name}:"}
    if name == "mooncake":
        if not MOONCAKE_MASTER:
            raise RuntimeError("no Mooncake store: the engine tests' conftest starts one")
        return {"master_server_address": MOONCAKE_MASTER[0], "global_segment_size": 0,
                "local_buffer_size": "32MiB", "prefix": f"sglang-{tmp_path.name}/"}  # fmt: skip
    if name == "s3":
        if not S3_OPTIONS:
            raise RuntimeError("no S3 server: the engine tests' conftest starts one")
        return {**S3_OPTIONS, "prefix": f"sglang-{tmp_path.name}"}
    options: dict[str, dict[str, Any]] = {
        "file": {"root": str(tmp_path / "file")},
        "nixl": {"root": str(tmp_path / "nixl")},
        "shm": {"root": str(tmp_path / "shm")},
        "mmap": {"path": str(tmp_path / "arena"), "max_size": "64MiB", "prefault": False},
        "memory": {"store": f"sglang-{tmp_path.name}"},
    }
    return options[name]
