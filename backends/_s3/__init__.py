"""The ``s3`` backend: pages as objects of an S3 bucket, or of any fsspec filesystem.

Built on :class:`~hicache_storage.storekit.blobstore.BlobStore` (every object is the
core header then the page, so a short, truncated, foreign or renamed object is a miss)
and on ``fsspec``: s3fs's async client for ``s3://`` (AWS, MinIO, Ceph, SeaweedFS,
moto...), and the same code over any other fsspec filesystem (``memory://``,
``file://``, ``gcs://``...). Every batch runs concurrently, at most ``max_concurrency``
requests at a time, on one event loop owned by the backend
(:class:`~hicache_storage.storekit.aioloop.LoopThread`); each call has a deadline.

On S3 a page is written with ``If-None-Match: *`` (first writer wins, atomically, in
the store), as one ``PutObject`` or, from ``multipart_threshold`` up, a multipart
upload whose completion carries the same condition. Options, guarantees and costs per
request: ``docs/backends/s3.md``.
"""

from __future__ import annotations

from hicache_storage.backends._s3.backend import S3Backend
from hicache_storage.backends._s3.options import S3Options

__all__ = ["S3Backend", "S3Options"]
