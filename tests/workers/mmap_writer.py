"""Writer process for mmap tests: usage mmap_writer.py PATH MODE ...

MODE ``big SLOT``: write ever new SLOT-byte objects (keys big0, big1...) until killed,
printing ``key <k>`` before each. MODE ``put KEY NBYTES``: store one object and exit.
"""

from __future__ import annotations

import sys

import torch

from hicache_storage import StorageConfig
from hicache_storage.backends import MmapBackend


def main() -> int:
    path, mode = sys.argv[1], sys.argv[2]
    b = MmapBackend(StorageConfig(), path=path)
    if mode == "put":
        key, n = sys.argv[3], int(sys.argv[4])
        print(b.set(key, torch.full((n,), 9, dtype=torch.uint8)), flush=True)
        b.close()
        return 0
    size = int(sys.argv[3])
    value = torch.full((size,), 5, dtype=torch.uint8)
    i = 0
    while True:
        print(f"key big{i}", flush=True)
        if not b.set(f"big{i}", value):
            return 3
        i += 1


if __name__ == "__main__":
    sys.exit(main())
