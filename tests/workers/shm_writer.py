"""A writer process for the shm capacity tests: stores pages, reports what happened.

Usage: shm_writer.py DIRECTORY MODEL PREFIX COUNT SIZE OPTIONS_JSON [GO_FILE]

Opens an ``shm`` backend on DIRECTORY for namespace MODEL (options from OPTIONS_JSON),
prints ``ready``, waits for GO_FILE to exist (when given, so several writers start
together), then stores COUNT objects of SIZE payload bytes named PREFIX0, PREFIX1...
Prints one JSON line: ``stored`` (sets that returned True), ``enospc`` (writes that met a
full filesystem: ENOSPC from the kernel), ``min_free`` (the lowest free space seen on the
filesystem after each set), ``last_present`` (how many of the last 5 keys exist).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from typing import Any

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.backends import ShmBackend
from hicache_storage.storekit import filewrites

ENOSPC = [0]
_real = filewrites.from_os_error  # type: ignore[attr-defined]  # the name the writes call


def counting_from_os_error(exc: OSError, what: str) -> Any:
    if exc.errno == errno.ENOSPC:
        ENOSPC[0] += 1
    return _real(exc, what)


filewrites.from_os_error = counting_from_os_error  # type: ignore[attr-defined]


def main() -> None:
    directory, model, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
    count, size = int(sys.argv[4]), int(sys.argv[5])
    options = json.loads(sys.argv[6])
    go = sys.argv[7] if len(sys.argv) > 7 else None
    ns = KVCacheNamespace(model_id=model, dtype="bytes", page_size=1)
    b = ShmBackend(StorageConfig(namespace=ns), root=directory, **options)
    print("ready", flush=True)
    while go is not None and not os.path.exists(go):
        time.sleep(0.001)
    value = bytes([len(prefix) % 251]) * size
    stored, min_free = 0, None
    for i in range(count):
        stored += bool(b.set(f"{prefix}{i}", value))
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        min_free = free if min_free is None else min(min_free, free)
    last = sum(b.exists(f"{prefix}{i}") for i in range(max(0, count - 5), count))
    print(
        json.dumps(
            {"stored": stored, "enospc": ENOSPC[0], "min_free": min_free, "last_present": last}
        )
    )
    b.close()


if __name__ == "__main__":
    main()
