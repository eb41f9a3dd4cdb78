"""Cycle 64 keys through a 4-object shm store for a while (every set recycles a file).

Usage: shm_recycler.py DIRECTORY SECONDS. Prints the number of sets and evictions.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from recycled_pages import HEAD, NS, SIZE, value_of

from hicache_storage import StorageConfig
from hicache_storage.backends import ShmBackend

b = ShmBackend(StorageConfig(namespace=NS), root=sys.argv[1], max_size=4 * (HEAD + SIZE))
i, end = 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    b.set(f"k{i % 64}", value_of(i % 64))
    i += 1
print(i, b.get_stats().evictions)
