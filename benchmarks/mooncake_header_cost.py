"""What a 48-byte header costs the raw Mooncake client: the same 128 pages of two 32 KiB
segments put with ``batch_put_from_multi_buffers`` as two buffers, as three (a header
buffer first, from its own registered arena), and as two with 48 bytes fewer.

    unshare -n bash -c 'ip link set lo up && .venv/bin/python benchmarks/mooncake_header_cost.py'
"""

from __future__ import annotations

import secrets
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "workers"))

from mooncake_master import require_private_network, running_store

N, SEGMENT, HEADER = 128, 32768, 48


def main() -> int:
    from mooncake.store import MooncakeDistributedStore

    require_private_network()
    with running_store(1 << 30) as (master, _holder):
        store = MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master.address):
            raise RuntimeError("setup failed")
        pages = torch.randint(0, 255, (N * 2 * SEGMENT,), dtype=torch.uint8)
        headers = torch.zeros(N * HEADER, dtype=torch.uint8)
        for t in (pages, headers):
            store.register_buffer(int(t.data_ptr()), t.numel())
        base, hbase = int(pages.data_ptr()), int(headers.data_ptr())
        shapes = {
            "K, V": lambda i: ([base + 2 * i * SEGMENT, base + (2 * i + 1) * SEGMENT],
                               [SEGMENT, SEGMENT]),
            "header, K, V": lambda i: ([hbase + i * HEADER, base + 2 * i * SEGMENT,
                                        base + (2 * i + 1) * SEGMENT], [HEADER, SEGMENT, SEGMENT]),
            "K, V - 48 bytes": lambda i: ([base + 2 * i * SEGMENT, base + (2 * i + 1) * SEGMENT],
                                          [SEGMENT, SEGMENT - HEADER]),
        }  # fmt: skip
        for _ in range(2):
            for name, shape in shapes.items():
                times = []
                for _ in range(8):
                    keys = [secrets.token_hex(8) for _ in range(N)]
                    ptrs, sizes = zip(*(shape(i) for i in range(N)), strict=True)
                    t0 = time.perf_counter()
                    rcs = store.batch_put_from_multi_buffers(keys, list(ptrs), list(sizes))
                    times.append(time.perf_counter() - t0)
                    if any(rc != 0 for rc in rcs):
                        raise RuntimeError(f"put failed: {set(rcs)}")
                    store.batch_remove(keys, True)
                print(f"{name:16s} {statistics.median(times) * 1e3:6.2f} ms per {N} pages")
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
