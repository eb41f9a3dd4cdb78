"""A Mooncake storage node for the tests: a client that only lends memory to the store.

Run as ``python mooncake_holder.py MASTER SEGMENT_BYTES``: it sets up a
``MooncakeDistributedStore`` with a segment of that size, prints ``ready``, and holds
it until its stdin closes (or it is killed). The backends under test are pure clients
(``global_segment_size`` 0), so their objects live here and outlive the processes that
wrote them, as on a deployment's storage nodes.
"""

from __future__ import annotations

import sys


def main() -> int:
    from mooncake.store import MooncakeDistributedStore

    master, size = sys.argv[1], int(sys.argv[2])
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", size, 16 << 20, "tcp", "", master)
    if rc != 0:
        print(f"setup failed: {rc}", flush=True)
        return 1
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes it
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
