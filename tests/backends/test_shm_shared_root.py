"""``shm``'s shared root: one budget and one free-space floor for every process and
namespace in the directory, kept by real processes on a real tmpfs.

Four concerns, each a section below: no writer starves and the floor holds (capacity);
``max_size`` is one budget across processes (shared cap); only the store's own files
count, and a killed writer leaves nothing outside the budget (root hygiene); a stuck
free-space lock fails writes fast, a contended one is waited for (space lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.backends import ShmBackend
from hicache_storage.conformance.data import tree_files
from hicache_storage.storekit.atomic import temp_path
from hicache_storage.storekit.header import HEADER_SIZE
from hicache_storage.storekit.spacelock import SPACE_LOCK, SPACE_LOCK_TIMEOUT

# --------------------------------------------------------------------------------------
# ``shm`` capacity with many processes: no writer starves, the free-space floor holds.
#
# Issue 8, item 10 (late writers starved under the defaults) and item 11 (the free-space
# floor was a check-then-write race between processes). Real processes on a real, small
# tmpfs (tests/workers/shm_writer.py).

WORKER = Path(__file__).parents[1] / "workers" / "shm_writer.py"
OBJ = 64 * 1024  # header included: whole tmpfs pages
PAYLOAD = OBJ - HEADER_SIZE


def start(
    directory: str, model: str, prefix: str, count: int, go: str, **options: Any
) -> subprocess.Popen[str]:
    """A writer that waits for the file ``go`` (so that nothing it prints after ``ready``
    can sit in this side's read buffer, which communicate() would not see)."""
    args = [sys.executable, str(WORKER), directory, model, prefix, str(count), str(PAYLOAD)]
    args += [json.dumps(options), go]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", (line, p.stderr.read() if p.stderr else "")
    return p


def result(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return report


def run_together(
    directory: str, tmp: Path, writers: list[tuple[str, str, int]], **options: Any
) -> tuple[list[dict[str, Any]], int | None]:
    """Start ``writers`` (model, prefix, count) at the same moment; sample the free space
    while they run; return their reports and the lowest free space seen here."""
    go = str(tmp / f"go-{time.monotonic_ns()}")
    procs = [start(directory, m, p, n, go, **options) for m, p, n in writers]
    Path(go).touch()
    lowest = None
    while any(p.poll() is None for p in procs):
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        lowest = free if lowest is None else min(lowest, free)
    return [result(p) for p in procs], lowest


def floor_of(tmpfs: str) -> int:
    st = os.statvfs(tmpfs)
    return (st.f_blocks * st.f_frsize) // 10  # the default min_free_space


@pytest.mark.timeout(600)
def test_late_writers_of_other_namespaces_are_not_starved(small_tmpfs: str, tmp_path: Path) -> None:
    """Defaults only. Two models fill the store (model B with two instances, as two ranks
    of one namespace), then a third model and a restarted first one write while the store
    is full: every one of their writes must be stored, and what they wrote last is there."""
    kv = os.path.join(small_tmpfs, "kv")
    first, _ = run_together(kv, tmp_path, [("A", "a", 60), ("B", "b1", 60), ("B", "b2", 60)])
    assert all(r["stored"] > 0 for r in first), first  # every early writer made progress
    late, _ = run_together(kv, tmp_path, [("C", "c", 40), ("A", "a2", 40)])
    for r in late:
        assert r["stored"] == 40, late  # a late writer is never starved
        assert r["last_present"] == 5, late
    (alone,), _ = run_together(kv, tmp_path, [("D", "d", 30)])  # a fourth, after them all
    assert alone["stored"] == 30 and alone["last_present"] == 5, alone
    assert all(r["enospc"] == 0 for r in [*first, *late, alone])


@pytest.mark.timeout(600)
def test_the_free_space_floor_holds_under_six_concurrent_writers(
    small_tmpfs: str, tmp_path: Path
) -> None:
    """Six processes (two namespaces) write at once with recycle=false on a 2 MiB tmpfs,
    each capped above the tmpfs so that only the floor bounds them. The free space never
    goes below the floor (sampled here and by every writer after every write), no write
    meets ENOSPC, and every writer stores pages."""
    kv = os.path.join(small_tmpfs, "kv")
    floor = floor_of(small_tmpfs)
    writers = [("A" if i % 2 else "B", f"w{i}-", 120) for i in range(6)]
    reports, lowest = run_together(kv, tmp_path, writers, recycle=False, max_size="64MiB")
    assert [r["enospc"] for r in reports] == [0] * 6, reports
    assert lowest is not None and lowest >= floor, (lowest, floor)
    assert min(r["min_free"] for r in reports) >= floor, (reports, floor)
    assert all(r["stored"] > 0 for r in reports), reports


# --------------------------------------------------------------------------------------
# ``shm``: ``max_size`` is one budget for the directory, across processes.
#
# Second attack D7: each process's tracker knew only what it found at start-up and what it
# wrote, so three processes with a 4 MiB cap filled 12 MiB and stayed there. Now every
# writer re-scans the whole directory on a schedule (cost-bounded, see
# :mod:`hicache_storage.storekit.capacity`) and evicts the oldest pages of any namespace. What holds
# (docs/backends/shm.md): the directory exceeds ``max_size`` by at most what the other
# processes wrote since the writing instance's last re-scan, and the next write of any
# instance whose re-scan is due brings it back under ``max_size``.

CAP_WORKER = Path(__file__).parents[1] / "workers" / "shm_cap_writer.py"
CAP = 4 << 20
CAP_PAYLOAD = 32 * 1024 - HEADER_SIZE


def directory_bytes(d: str) -> int:
    """Bytes of every regular file under ``d`` (pages and temporaries alike)."""
    total = 0
    for dirpath, _dirs, files in os.walk(d):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total


def line_of(p: subprocess.Popen[str]) -> str:
    assert p.stdout is not None and p.stderr is not None
    line = p.stdout.readline()
    assert line, p.stderr.read()  # the worker died
    return line.strip()


def tell(p: subprocess.Popen[str], what: str) -> None:
    assert p.stdin is not None
    p.stdin.write(what + "\n")
    p.stdin.flush()


@pytest.mark.timeout(300)
def test_three_processes_share_one_cap(shm_dir: str) -> None:
    os.makedirs(shm_dir, mode=0o700)
    procs = [
        subprocess.Popen(
            [sys.executable, str(CAP_WORKER), shm_dir, f"m{i}", "600", str(CAP_PAYLOAD), str(CAP)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    try:
        assert [line_of(p) for p in procs] == ["ready"] * 3
        for p in procs:  # the burst: all three at once
            tell(p, "go")
        reports = [json.loads(line_of(p)) for p in procs]
        assert all(r["stored"] == 600 for r in reports), reports
        # Each writer's next write once its re-scan is due brings the whole directory
        # (every namespace) back under the cap, whoever wrote the excess.
        for p in procs:
            tell(p, "settle")
            assert line_of(p) == "settled"
            assert directory_bytes(shm_dir) <= CAP
    finally:
        for p in procs:
            if p.poll() is None:
                tell(p, "quit")
            p.communicate(timeout=60)
    assert [p.returncode for p in procs] == [0, 0, 0]


def test_a_rescan_keeps_the_recency_of_recent_reads(shm_dir: str) -> None:
    """A re-scan orders by mtime, which a read refreshes at most once a second: a page read
    just after it was written must still count as recently used after a re-scan."""
    from hicache_storage import KVCacheNamespace, StorageConfig
    from hicache_storage.backends import ShmBackend

    size = 4096 - HEADER_SIZE
    b = ShmBackend(
        StorageConfig(namespace=KVCacheNamespace(model_id="lru", dtype="bytes", page_size=1)),
        root=shm_dir,
        max_size=4 * 4096,
    )
    for i in range(4):
        assert b.set(f"k{i}", bytes([i]) * size)
    assert b.get("k0") is not None  # k0 is now the most recent; k1 the oldest
    b._tracker.next_cap_refresh = -float("inf")  # the scheduled re-scan is due
    refreshes = b._tracker.refreshes
    assert b.set("k4", b"\x04" * size)
    assert b._tracker.refreshes == refreshes + 1
    assert [b.exists(f"k{i}") for i in range(5)] == [True, False, True, True, True]
    b.close()


# --------------------------------------------------------------------------------------
# ``shm``'s one budget for the whole directory: only the store's own files count, and
# nothing a killed writer left behind escapes it.
#
# Second attack D6: the per-root capacity scan took every regular file two directories
# down as a page, so another program's file in ``directory`` was counted and evicted.
# Second attack D9: a writer killed while recycling another namespace's page left its
# temporary in that namespace's directory, where only that namespace's start-up looked:
# tmpfs memory outside the cap for as long as that namespace was not restarted.

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
    b = ShmBackend(StorageConfig(namespace=ns("m")), root=shm_dir, max_size="1MiB")
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
    b = ShmBackend(StorageConfig(namespace=ns("m")), root=shm_dir, max_size="1MiB")
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
    from hicache_storage.storekit import filetree
    from hicache_storage.backends import ShmBackend

    def die(fd, views):  # in _recycle: the evicted page is already a temporary
        os.kill(os.getpid(), signal.SIGKILL)

    filetree.writev_all = die  # the name move_payloads calls
    ns = KVCacheNamespace(model_id=sys.argv[2], dtype="bytes", page_size=1)
    b = ShmBackend(StorageConfig(namespace=ns), root=sys.argv[1], max_size=int(sys.argv[3]))
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
    a = ShmBackend(StorageConfig(namespace=ns("A")), root=shm_dir, max_size=cap)
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
    c = ShmBackend(StorageConfig(namespace=ns("C")), root=shm_dir, max_size=cap)
    assert temporaries(shm_dir) == [live]
    assert not os.path.exists(trash)
    os.unlink(live)
    pages = [p for p in tree_files(shm_dir) if not os.path.basename(p).startswith(".")]
    assert sum(os.path.getsize(p) for p in pages) <= cap  # nothing outside the budget
    c.close()


# --------------------------------------------------------------------------------------
# ``shm``: a free-space lock held by a stuck process fails writes fast, never hangs them.
#
# Second attack D4: another process (a member of the sharing group, or a stopped process
# of the same user) holds ``.hicache-space.lock``. Every write near the free-space floor
# needs it; a batch must then fail in about one lock timeout, not one timeout per page, and
# writes must work again as soon as the lock is free.

NS = KVCacheNamespace(model_id="lock", dtype="bytes", page_size=1)
PAGES = 32


@pytest.mark.timeout(300)
def test_a_held_free_space_lock_fails_a_batch_fast_and_never_hangs(small_tmpfs: str) -> None:
    b = ShmBackend(StorageConfig(namespace=NS), root=os.path.join(small_tmpfs, "kv"))
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

    b = ShmBackend(StorageConfig(namespace=NS), root=os.path.join(small_tmpfs, "kv"))
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
