"""Objects as the ``s3`` backend reads and writes them outside S3's own requests.

:class:`Read` (bytes with the ETag they came from) and the local filesystem's
first-writer-wins publication.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from typing import Self

from hicache_storage.storekit.blobstore import (
    PRESENT,
    Present,
)


class Read(bytes):
    """An object's bytes as read from S3, with the ETag of the object they came from."""

    def __new__(cls, data: bytes, etag: str | None = None) -> Self:
        read = super().__new__(cls, data)
        read.etag = etag
        return read

    etag: str | None


MEMORY_PUTS = threading.Lock()


#: The smallest part of a multipart upload S3 accepts (but the last).
MIN_PART = 5 * 2**20


def publish_local(path: str, data: bytes) -> bool | Present:
    """Write ``data`` to a temporary file beside ``path``, then link it there.

    ``link`` fails when ``path`` exists: the first writer wins, and no reader ever sees
    part of a value (a rename would replace one).
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    temp = f"{path}.tmp-{uuid.uuid4().hex}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.link(temp, path)
        except FileExistsError:
            return PRESENT
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
