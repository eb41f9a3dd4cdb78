"""``shm``: a free-space lock held by a stuck process fails writes fast, never hangs them.

Second attack D4: another process (a member of the sharing group, or a stopped process
of the same user) holds ``.hicache-space.lock``. Every write near the free-space floor
needs it; a batch must then fail in about one lock timeout, not one timeout per page, and
writes must work again as soon as the lock is free.
"""

from __future__ import annotations

import fcntl
import os
import threading

import pytest

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.backends import ShmBackend
from hicache_storage.storekit.spacelock import SPACE_LOCK, SPACE_LOCK_TIMEOUT

NS = KVCacheNamespace(model_id="lock", dtype="bytes", page_size=1)
PAGES = 32


@pytest.mark.timeout(300)
def test_a_held_free_space_lock_fails_a_batch_fast_and_never_hangs(small_tmpfs: str) -> None:
    b = ShmBackend(StorageConfig(namespace=NS), directory=os.path.join(small_tmpfs, "kv"))
    value = b"\x07" * 8192
    assert b._serialize and b._near_floor(len(value))  # every write takes the lock
    assert b.set("warm", value)
    # A separate open file description: flock conflicts as with another process.
    held = os.open(os.path.join(b.root, SPACE_LOCK), os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    results: dict[str, list[bool]] = {}

    def engine_batches() -> None:
        keys = [f"p{i}" for i in range(PAGES)]
        results["first"] = b.batch_set(keys, [value] * PAGES)
        results["second"] = b.batch_set([f"q{i}" for i in range(PAGES)], [value] * PAGES)

    t = threading.Thread(target=engine_batches, daemon=True)
    try:
        t.start()
        # One timeout per page would take PAGES * SPACE_LOCK_TIMEOUT for the first batch
        # alone; a hang detector with a generous margin over a few timeouts.
        t.join(10 * SPACE_LOCK_TIMEOUT + 30)
        assert not t.is_alive(), "writes waited for the held free-space lock page by page"
    finally:
        os.close(held)  # the stuck holder goes away (and frees a writer hung today)
        t.join(PAGES * SPACE_LOCK_TIMEOUT + 30)
    assert results["first"] == [False] * PAGES and results["second"] == [False] * PAGES
    # The lock is free again: writes succeed at once, cool-down or not.
    assert b.batch_set(["r0", "r1"], [value, value]) == [True, True]
    assert bytes(b.get("r1").numpy()) == value
    b.close()


HANDOFF_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
end = time.monotonic() + float(sys.argv[2])
print("ready", flush=True)
while time.monotonic() < end:
    fcntl.flock(fd, fcntl.LOCK_EX)  # blocking: takes over the moment the other lets go
    time.sleep(0.5)
    fcntl.flock(fd, fcntl.LOCK_UN)
    time.sleep(0.001)  # the other holder, blocked in flock, takes it now
"""


@pytest.mark.timeout(300)
def test_a_contended_free_space_lock_is_waited_for_not_taken_for_stuck(
    small_tmpfs: str,
) -> None:
    """Third review: the lock held without a gap by two processes that hand it to each
    other for 3 timeouts is contended, not stuck (its holder changes): a write waits for
    it and succeeds, instead of failing after one timeout (and failing fast for the
    cool-down after that, which starved a writer among six in CI)."""
    import subprocess
    import sys

    b = ShmBackend(StorageConfig(namespace=NS), directory=os.path.join(small_tmpfs, "kv"))
    value = b"\x07" * 8192
    assert b._serialize and b._near_floor(len(value))
    assert b.set("warm", value)
    lock = os.path.join(b.root, SPACE_LOCK)
    span = str(3 * SPACE_LOCK_TIMEOUT)
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", HANDOFF_HOLDER, lock, span], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        for h in holders:
            assert h.stdout is not None and h.stdout.readline().strip() == "ready"
        assert b.set("contended", value) is True
        assert bytes(b.get("contended").numpy()) == value
    finally:
        for h in holders:
            h.wait(60)
            if h.stdout is not None:
                h.stdout.close()
        b.close()
