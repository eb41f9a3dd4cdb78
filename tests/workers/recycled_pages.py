"""The pages of the shm recycling tests, shared by the tests and the recycler process."""

from __future__ import annotations

import torch

from hicache_storage.conformance.data import make_pool, pool_namespace
from hicache_storage.storekit.header import HEADER_SIZE

__all__ = ["HEAD", "NS", "SIZE", "value_of"]

HEAD = HEADER_SIZE  # the object header
SIZE = 64 * 1024
# A fixed tenant, not the kit's per-run one: the recycler is another process.
NS = pool_namespace(make_pool(num_pages=1), tenant="shm-tests")


def value_of(i: int, size: int = SIZE) -> torch.Tensor:
    """A value that names its key: the index in the first 8 bytes, then a fill byte."""
    v = torch.full((size,), i % 251, dtype=torch.uint8)
    v[:8] = torch.tensor([i], dtype=torch.int64).view(torch.uint8)
    return v
