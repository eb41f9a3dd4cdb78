"""Processes that put (and read) the same Mooncake keys at once: the lost-write race.

:func:`write_rounds` runs in a spawned process. For each round of keys it is handed, it
waits on a barrier shared with the other processes, then, by its role:

* ``set``: stores each key's content (derived from the key, in its own random order),
  one ``set`` each, and reads the key back right after a set that answered True;
* ``v1``: stores all the keys' pages with one ``batch_set_v1`` (its own random order),
  then reads back at once every page whose set answered True;
* ``read``: reads the keys' pages with ``batch_get_v1`` while the others write, until
  every page hits (or 200 tries): a page being written must read as a miss, never as a
  store failure or wrong bytes.

It reports, per round: ``stored`` (keys whose set answered True), ``lost`` (of those,
the keys that did not read back byte-exact), ``wrong`` (pages read with wrong bytes) and
``errors`` (the backend's failed items so far), or ``error`` (a repr) if it raised.
:func:`put_raw` puts one key with a bare client; :func:`busy` keeps a core busy.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.conformance.data import content, fill_page, make_pool


def namespace(role: str) -> KVCacheNamespace:
    """The namespace the processes of ``role`` store in."""
    if role == "set":
        return KVCacheNamespace(model_id="race", dtype="uint8", page_size=4)
    return KVCacheNamespace.for_pool(make_pool(num_pages=1), model_id="race")


def write_rounds(opts: dict[str, Any], role: str, nbytes: int, rounds: Any, results: Any,
                 barrier: Any) -> None:  # fmt: skip
    """Take lists of keys from ``rounds`` (None ends); put one dict per round on ``results``."""
    from hicache_storage.backends import MooncakeBackend

    try:
        b = MooncakeBackend(StorageConfig(namespace=namespace(role)), **opts)
        pool = None if role == "set" else make_pool(num_pages=16)
        if pool is not None:
            b.register_mem_pool_host(pool)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        results.put({"error": repr(exc)})
        return
    rng = random.Random()
    try:
        while (keys := rounds.get()) is not None:
            order = list(keys)
            rng.shuffle(order)
            barrier.wait()
            stored: list[str] = []
            lost: list[str] = []
            wrong: list[str] = []
            if pool is None:
                for k in order:
                    value = torch.frombuffer(bytearray(content(k, nbytes)), dtype=torch.uint8)
                    if b.set(k, value):
                        stored.append(k)
                        got = b.get(k)
                        if got is None or got.numpy().tobytes() != content(k, nbytes):
                            lost.append(k)
            else:
                ps = pool.page_size
                pages = pool.page_buffers(range(len(order) * ps))
                if role == "v1":
                    for page, k in zip(pages, order, strict=True):
                        fill_page(page, k)
                    ok = b.batch_set_v1(order, list(range(len(order) * ps)))
                    stored = [k for k, r in zip(order, ok, strict=True) if r]
                    order = stored
                for _ in range(1 if role == "v1" else 200):
                    back = b.batch_get_v1(order, list(range(len(order) * ps)))
                    wrong += [k for k, r, p in zip(order, back, pages, strict=True)
                              if r and p.tobytes() != content(k, p.nbytes)]  # fmt: skip
                    if all(back):
                        break
                if role == "v1":
                    lost = [k for k, r in zip(order, back, strict=True) if not r]
            errors = sum(op.errors for op in b.get_stats().ops.values())
            results.put({"stored": stored, "lost": lost, "wrong": wrong, "errors": errors})
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        results.put({"error": repr(exc)})
    finally:
        b.close()


def put_raw(master: str, key: str, nbytes: int, go: Any, done: Any) -> None:
    """A bare Mooncake client: once ``go`` gives something, put ``nbytes`` under ``key``.

    Puts the put's code on ``done`` (the bytes are not a page of ours: no header).
    """
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 2 * nbytes, "tcp", "", master) != 0:
        done.put("setup failed")
        return
    done.put("ready")
    go.get()
    done.put(store.put(key, b"x" * nbytes))
    go.get()
    store.close()


def busy() -> None:
    """Spin until killed (CPU load for the race tests)."""
    while True:
        pass
