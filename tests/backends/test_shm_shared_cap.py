"""``shm``: ``max_size`` is one budget for the directory, across processes.

Second attack D7: each process's tracker knew only what it found at start-up and what it
wrote, so three processes with a 4 MiB cap filled 12 MiB and stayed there. Now every
writer re-scans the whole directory on a schedule (cost-bounded, see
:mod:`hicache_storage.storekit.capacity`) and evicts the oldest pages of any namespace. What holds
(docs/backends/shm.md): the directory exceeds ``max_size`` by at most what the other
processes wrote since the writing instance's last re-scan, and the next write of any
instance whose re-scan is due brings it back under ``max_size``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_storage.storekit.header import HEADER_SIZE

WORKER = Path(__file__).parents[1] / "workers" / "shm_cap_writer.py"
CAP = 4 << 20
PAYLOAD = 32 * 1024 - HEADER_SIZE


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
            [sys.executable, str(WORKER), shm_dir, f"m{i}", "600", str(PAYLOAD), str(CAP)],
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
        directory=shm_dir,
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
