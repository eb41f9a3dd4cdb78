"""A writer process for the shm shared-cap test: a burst of pages, then writes on demand.

Usage: shm_cap_writer.py DIRECTORY MODEL COUNT SIZE MAX_SIZE

Opens an ``shm`` backend on DIRECTORY (namespace MODEL, ``max_size`` MAX_SIZE), prints
``ready``, waits for a line on stdin, stores COUNT objects of SIZE payload bytes and
prints one JSON line (``stored``, ``refreshes``). Then, for each ``settle`` line on stdin,
waits until its scheduled re-scan of the directory is due (the monotonic clock passes
the tracker's ``next_cap_refresh``: no guessed sleep), stores one more object and prints
``settled``; ``quit`` (or end of input) ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.backends import ShmBackend


def main() -> None:
    directory, model = sys.argv[1], sys.argv[2]
    count, size, cap = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    ns = KVCacheNamespace(model_id=model, dtype="bytes", page_size=1)
    b = ShmBackend(StorageConfig(namespace=ns), root=directory, max_size=cap)
    print("ready", flush=True)
    sys.stdin.readline()
    stored = sum(bool(b.set(f"p{i}", os.urandom(size))) for i in range(count))
    tracker = b._tracker
    print(json.dumps({"stored": stored, "refreshes": tracker.refreshes}), flush=True)
    for n, line in enumerate(sys.stdin):
        if line.strip() != "settle":
            break
        due = getattr(tracker, "next_cap_refresh", 0.0)  # (absent before the fix)
        while time.monotonic() < due:
            time.sleep(0.001)
        assert b.set(f"s{n}", os.urandom(size))
        print("settled", flush=True)
    b.close()


if __name__ == "__main__":
    main()
