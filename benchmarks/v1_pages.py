"""What the store benchmarks (redis, s3, mooncake against their raw clients) share: a
host pool of random pages, the source and destination pages, and our side of a round
(``batch_set_v1`` then ``batch_get_v1`` of every page, in batches, timed, then checked
byte for byte outside the timings).
"""

from __future__ import annotations

from typing import Any

import torch
from hot_paths import timed  # one timer for the benchmarks: gc off while it runs

from hicache_storage import page_hashes
from hicache_storage.benchkit import BenchShape, fill_random, verify_pages


class V1Pages:
    """``shape.pages`` source pages of random bytes and as many destination pages, in one
    host pool of ``shape``'s geometry."""

    def __init__(self, shape: BenchShape, seed: int = 3) -> None:
        self.shape = shape
        self.pool = shape.pool(2 * shape.pages)
        fill_random(self.pool, seed=seed)
        ps = shape.page_size
        self.src = torch.arange(0, shape.pages * ps)
        self.dst = torch.arange(shape.pages * ps, 2 * shape.pages * ps)
        self.src_pages = self.pool.page_buffers(self.src)
        self.dst_pages = self.pool.page_buffers(self.dst)
        #: each destination page's segments as uint8 tensors (for the raw side's copies)
        self.dst_segments = [
            [torch.frombuffer(seg.memoryview, dtype=torch.uint8) for seg in p.segments]
            for p in self.dst_pages
        ]

    @property
    def nbytes(self) -> int:
        """Bytes of all source pages."""
        return self.shape.pages * int(self.pool.page_bytes)

    def clear_destination(self) -> None:
        for segs in self.dst_segments:
            for t in segs:
                t.zero_()

    def ours(self, backend: Any, out: dict[str, list[float]]) -> int:
        """One round through ``backend``'s v1 path (registered with this pool): appends
        the set and get times to ``out["ours set"]`` and ``out["ours get"]``, clears the
        backend, and returns the number of pages that did not read back right."""
        shape, ps = self.shape, self.shape.page_size
        keys = page_hashes(torch.randint(0, 2**31 - 1, (shape.pages * ps,)).tolist(), ps)
        rows_s, rows_d = self.src.view(-1, ps), self.dst.view(-1, ps)

        def go(call: Any, rows: torch.Tensor) -> None:
            for i in range(0, shape.pages, shape.batch):
                if not all(call(keys[i : i + shape.batch], rows[i : i + shape.batch].reshape(-1))):
                    raise RuntimeError("a page failed")

        out["ours set"].append(timed(lambda: go(backend.batch_set_v1, rows_s)))
        self.clear_destination()
        out["ours get"].append(timed(lambda: go(backend.batch_get_v1, rows_d)))
        bad = int(verify_pages(self.pool, self.src, self.dst))
        backend.clear()
        return bad

    def copy_into_destination(self, index: int, value: bytes | bytearray | memoryview) -> None:
        """The raw side's copy of one value into destination page ``index``'s segments."""
        data, off = torch.frombuffer(bytearray(value), dtype=torch.uint8), 0
        for t in self.dst_segments[index]:
            t.copy_(data[off : off + t.numel()])
            off += t.numel()
