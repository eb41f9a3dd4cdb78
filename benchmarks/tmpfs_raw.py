"""The kernel's ceiling for ``shm``: raw ``writev``/``preadv`` of 2 MiB pages in tmpfs files.

No backend, no Python bookkeeping beyond the loop: the same pool layout as
``memory_stores.py`` (K and V segments of 1 MiB per page), 2 threads, 256 pages, into
(1) new files, (2) the same files again (pages already allocated: what ``shm``'s
recycling does), then reads of freshly allocated and of re-written files. Explains where
the ``shm`` figures stop; the backend comparison itself is ``memory_stores.py``.

    .venv/bin/python benchmarks/tmpfs_raw.py
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from hicache_storage.benchkit import BenchShape

PAGES, THREADS = 256, 2


def main() -> None:
    shape = BenchShape(pages=PAGES, batch=PAGES)
    pool = shape.pool(2 * PAGES)
    pool.kv_buffer.fill_(1)
    ps = shape.page_size
    src = pool.page_buffers(torch.arange(0, PAGES * ps))
    dst = pool.page_buffers(torch.arange(PAGES * ps, 2 * PAGES * ps))
    d = f"/dev/shm/hicache-raw-{uuid.uuid4().hex[:8]}"
    os.makedirs(d)
    head = bytearray(32)
    ex = ThreadPoolExecutor(THREADS)
    nbytes = PAGES * pool.page_bytes

    def timed(f: Callable[[int], None]) -> float:
        t0 = time.perf_counter()
        list(ex.map(lambda t: [f(i) for i in range(t, PAGES, THREADS)], range(THREADS)))
        return nbytes / (time.perf_counter() - t0) / 1e9

    def write(i: int) -> None:
        fd = os.open(f"{d}/{i}", os.O_WRONLY | os.O_CREAT, 0o600)
        os.writev(fd, [head, *src[i].views])
        os.close(fd)

    def read(i: int) -> None:
        fd = os.open(f"{d}/{i}", os.O_RDONLY)
        os.preadv(fd, [head, *dst[i].views], 0)
        os.close(fd)

    try:
        for r in range(3):
            for f in os.listdir(d):
                os.unlink(os.path.join(d, f))
            new = timed(write)
            first_read = timed(read)
            again = timed(write)
            reread = timed(read)
            print(
                f"round {r}: writev new files {new:.2f} GB/s, preadv of them {first_read:.2f};"
                f" writev into the same files {again:.2f}, preadv then {reread:.2f}"
            )
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
