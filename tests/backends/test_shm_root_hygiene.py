"""``shm``'s one budget for the whole directory: only the store's own files count, and
nothing a killed writer left behind escapes it.

Second attack D6: the per-root capacity scan took every regular file two directories
down as a page, so another program's file in ``directory`` was counted and evicted.
Second attack D9: a writer killed while recycling another namespace's page left its
temporary in that namespace's directory, where only that namespace's start-up looked:
tmpfs memory outside the cap for as long as that namespace was not restarted.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.backends import ShmBackend
from hicache_storage.conformance.data import tree_files
from hicache_storage.storekit.atomic import temp_path
from hicache_storage.storekit.header import HEADER_SIZE

SIZE = 64 * 1024 - HEADER_SIZE


def ns(model: str) -> KVCacheNamespace:
    return KVCacheNamespace(model_id=model, dtype="bytes", page_size=1)


def old_file(path: str, size: int) -> str:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"P" * size)
    day_ago = time.time() - 86400
    os.utime(path, (day_ago, day_ago))  # the oldest thing around: first in any LRU
    return path


def test_files_that_are_not_the_stores_are_never_counted_or_evicted(shm_dir: str) -> None:
    os.makedirs(shm_dir, mode=0o700)
    b = ShmBackend(StorageConfig(namespace=ns("m")), directory=shm_dir, max_size="1MiB")
    assert b.set("k", b"v")
    fan = os.path.basename(os.path.dirname(b._path(b.object_name("k"))))
    wrong_fan = next(
        f"{i:02x}"
        for i in range(256)
        if f"{i:02x}" != hashlib.blake2b(b"notes.txt", digest_size=1).hexdigest()
    )
    b.close()
    foreign = [
        old_file(f"{shm_dir}/otherapp/db/precious.sqlite", 100_000),  # the attack's layout
        old_file(f"{shm_dir}/{b.namespace.digest}/{wrong_fan}/notes.txt", 100_000),
        old_file(f"{shm_dir}/{b.namespace.digest}/{fan}/has space", 100_000),
        old_file(f"{shm_dir}/{b.namespace.digest}/backup/{fan}", 100_000),
        old_file(f"{shm_dir}/ns1-0123abcd/zz/data", 100_000),
    ]
    b = ShmBackend(StorageConfig(namespace=ns("m")), directory=shm_dir, max_size="1MiB")
    assert b.usage()["objects"] == 1  # only the store's own page
    for i in range(40):  # four times the cap: evicts, recycles
        assert b.set(f"k{i}", os.urandom(32768))
    assert all(os.path.exists(p) for p in foreign), [p for p in foreign if not os.path.exists(p)]
    assert all(os.path.getsize(p) == 100_000 for p in foreign)  # never recycled either
    assert b.get_stats().evictions > 0
    b.close()


KILLED_RECYCLER = textwrap.dedent("""
    import os, signal, sys
    from hicache_storage import KVCacheNamespace, StorageConfig
    from hicache_storage.storekit import filestore
    from hicache_storage.backends import ShmBackend

    def die(fd, views):  # in _recycle: the evicted page is already a temporary
        os.kill(os.getpid(), signal.SIGKILL)

    filestore.writev_all = die
    ns = KVCacheNamespace(model_id=sys.argv[2], dtype="bytes", page_size=1)
    b = ShmBackend(StorageConfig(namespace=ns), directory=sys.argv[1], max_size=int(sys.argv[3]))
    b.set("intruder", b"\\x09" * int(sys.argv[4]))
    print("not killed")
""")


def temporaries(d: str) -> list[str]:
    return [
        os.path.join(dp, f) for dp, _, files in os.walk(d) for f in files if f.startswith(".tmp.")
    ]


def kill_a_recycler(shm_dir: str, model: str, cap: int) -> None:
    r = subprocess.run(
        [sys.executable, "-c", KILLED_RECYCLER, shm_dir, model, str(cap), str(SIZE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr)


@pytest.mark.timeout(300)
def test_a_recycler_killed_in_another_namespace_leaves_nothing_behind(shm_dir: str) -> None:
    cap = 4 * (HEADER_SIZE + SIZE)
    a = ShmBackend(StorageConfig(namespace=ns("A")), directory=shm_dir, max_size=cap)
    for i in range(4):
        assert a.set(f"a{i}", bytes([i]) * SIZE)
    live = temp_path(os.path.dirname(a._path(a.object_name("a0"))))  # a live writer's
    open(live, "wb").close()
    # 1. B recycles A's oldest page and is killed with it renamed to a temporary in A's
    #    directory. A's own next write, once its scheduled re-scan is due, removes it.
    kill_a_recycler(shm_dir, "B", cap)
    left = [t for t in temporaries(a.directory) if t != live]
    assert len(left) == 1, left
    while time.monotonic() < getattr(a._tracker, "next_cap_refresh", 0.0):
        time.sleep(0.001)
    assert a.set("a-next", b"\x0a" * SIZE)
    assert temporaries(shm_dir) == [live]  # the dead writer's went; the live one stays
    # 2. Again, and then a third namespace starts: its start-up scan removes it.
    kill_a_recycler(shm_dir, "B", cap)
    assert len(temporaries(shm_dir)) == 2
    a.close()
    trash = os.path.join(shm_dir, f".trash.{ns('A').digest}.0123456789ab")  # a killed clear()
    old_file(os.path.join(trash, "00", "a0"), SIZE)
    c = ShmBackend(StorageConfig(namespace=ns("C")), directory=shm_dir, max_size=cap)
    assert temporaries(shm_dir) == [live]
    assert not os.path.exists(trash)
    os.unlink(live)
    pages = [p for p in tree_files(shm_dir) if not os.path.basename(p).startswith(".")]
    assert sum(os.path.getsize(p) for p in pages) <= cap  # nothing outside the budget
    c.close()
