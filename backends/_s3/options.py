"""Options of the ``s3`` backend (see ``docs/backends/s3.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache_storage.config import Size, redacting_repr
from hicache_storage.config import secret as _secret
from hicache_storage.errors import (
    ConfigError,
)
from hicache_storage.storekit.blobstore import (
    BlobOptions,
)

SIXTEEN_MIB = Size(16 * 2**20)

__all__ = ["S3Options"]


@redacting_repr
@dataclass(frozen=True)
class S3Options(BlobOptions):
    """Options of the ``s3`` backend (environment: ``HICACHE_STORAGE_S3_<NAME>``).

    Attributes:
        url: where the objects go: ``s3://bucket[/prefix]``, or any fsspec URL
            (``memory://root``, ``file:///path``, ``gcs://bucket/prefix``...). Instead
            of it, ``bucket`` (and ``prefix``) name an S3 location.
        bucket: the S3 bucket (when ``url`` is not given).
        prefix: what every object key starts with, before the object name (joined
            with a ``/``).
        endpoint_url: an S3-compatible server (MinIO, Ceph, SeaweedFS, moto...);
            default: AWS.
        region: the region of the bucket (default: the client's configuration).
        key, secret, token: credentials; default: the usual chain (environment,
            ``~/.aws``, instance role). Never logged or shown.
        path_style: address the bucket in the path (``host/bucket/key``), as most
            servers other than AWS want; default: the client's choice.
        max_concurrency: requests in flight at once, over all calls of this backend.
        exists_lookahead: ``batch_exists`` asks about this many keys ahead of the first
            unanswered one (twice as many each time that many in a row were present, up
            to ``max_concurrency``), and asks nothing more once it meets a miss.
        negative_cache_ttl: seconds a key found absent is answered absent without a
            request (0: off). Another writer's page can be missed for that long.
        multipart_threshold: objects of this size or more are written by multipart
            upload, in parts of half this size (S3 wants parts of at least 5 MiB).
        retries: times a request that met throttling (``503 SlowDown``) or a transient
            fault is sent again, with exponential backoff and jitter, within the deadline.
        deadline: seconds an engine-facing call may take, retries included.
        connect_timeout: seconds to connect to the server.
        read_timeout: seconds to wait for an answer on a connection.
        storage_options: more keyword arguments for the fsspec filesystem (a JSON
            object in the environment). Never shown: it may hold credentials.
    """

    url: str | None = None
    bucket: str | None = None
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    key: str | None = _secret()
    secret: str | None = _secret()
    token: str | None = _secret()
    path_style: bool = False
    max_concurrency: int = 32
    exists_lookahead: int = 16
    negative_cache_ttl: float = 0.0
    multipart_threshold: Size = SIXTEEN_MIB
    retries: int = 4
    deadline: float = 30.0
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    storage_options: dict[str, Any] | str | None = _secret()  # noqa: RUF009 - a field

    def fs_options(self) -> dict[str, Any]:
        """``storage_options`` as a dict (a copy; empty when not given)."""
        return dict(self.storage_options) if isinstance(self.storage_options, dict) else {}

    def __post_init__(self) -> None:
        if (self.url is None) == (self.bucket is None):
            raise ConfigError("give either url (s3://bucket/prefix, or any fsspec URL) or bucket")
        if self.max_concurrency < 1 or self.exists_lookahead < 1:
            raise ConfigError("max_concurrency and exists_lookahead must be >= 1")
        if self.retries < 0:
            raise ConfigError("retries must be >= 0")
        for name in ("deadline", "connect_timeout", "read_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds")
        if self.negative_cache_ttl < 0:
            raise ConfigError("negative_cache_ttl must be >= 0")
        if self.multipart_threshold < 2:
            raise ConfigError("multipart_threshold must be at least 2 bytes")
        if isinstance(self.storage_options, str):
            import json

            try:
                parsed = json.loads(self.storage_options)
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise ConfigError("storage_options must be a JSON object")
            object.__setattr__(self, "storage_options", parsed)
        elif self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ConfigError("storage_options must be a mapping")


def check_bucket(bucket: str) -> None:
    if not 3 <= len(bucket) <= 63 or bucket != bucket.lower() or "/" in bucket:
        raise ConfigError(
            f"bad bucket name {bucket!r}: 3 to 63 lower-case letters, digits, '.' and '-'"
        )
