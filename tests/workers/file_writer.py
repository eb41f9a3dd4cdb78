"""A writer process for crash and concurrency tests: writes pages until killed.

Usage: file_writer.py ROOT SEED KEYS MODE [ROUNDS]
Every key's content is derived from the key (tests/workers/kvcontent.py), so any reader can
verify any page. MODE is ``v1`` (batch_set_v1 from a host pool), ``set``, or ``big`` (KEYS MiB objects,
in the default namespace). Prints
``ready`` once the first batch is stored, then keeps writing (ROUNDS batches, or forever).
"""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(__file__))

from kvcontent import KEY_UNIVERSE, fill_page, namespace, page_pool

from hicache_storage import StorageConfig
from hicache_storage.backends import FileBackend


def main() -> None:
    root, seed, nkeys, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else -1
    if mode == "big":
        # One very large object, so that a kill lands inside its write.
        import torch

        b = FileBackend(StorageConfig(), root=root)
        value = torch.full((nkeys * 2**20,), 7, dtype=torch.uint8)
        print("ready", flush=True)
        while True:
            b.set(f"big{random.Random().randrange(10**9)}", value)
    rng = random.Random(seed)
    keys = KEY_UNIVERSE[:nkeys]
    pool = page_pool(8)
    b = FileBackend(StorageConfig(namespace=namespace(pool)), root=root, max_concurrency=4)
    b.register_mem_pool_host(pool)
    done = 0
    while rounds < 0 or done < rounds:
        batch = rng.sample(keys, 8)
        if mode == "v1":
            for page, key in zip(pool.page_buffers(range(8 * pool.page_size)), batch, strict=True):
                fill_page(page, key)
            ok = b.batch_set_v1(batch, list(range(8 * pool.page_size)))
        else:
            ok = [b.set(k, fill_page(None, k, pool.page_bytes)) for k in batch]
        if not all(ok):
            print(f"write failed: {ok}", file=sys.stderr, flush=True)
            sys.exit(3)
        if done == 0:
            print("ready", flush=True)
        done += 1
    b.close()


if __name__ == "__main__":
    main()
