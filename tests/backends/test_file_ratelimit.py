"""One rate limiter for every warning on a hot path (issue 8, item 14).

A store that fails the same way on every call must not write a log line per call: 1000
refused sets or 300 corrupt reads give a handful of warnings, not 1000 or 300.
"""

from __future__ import annotations

import logging
import os

import pytest

from hicache_storage import StorageConfig
from hicache_storage.backends import FileBackend, ShmBackend
from hicache_storage.conformance.data import tree_files
from hicache_storage.storekit.capacity import CapacityTracker


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("hicache_storage")
    ]


def test_a_thousand_refused_sets_give_a_handful_of_warnings(
    root: str, caplog: pytest.LogCaptureFixture
) -> None:
    b = FileBackend(StorageConfig(), root=root, max_size=1000)
    caplog.set_level(logging.WARNING)
    assert not any(b.set(f"k{i}", b"x" * 2000) for i in range(1000))
    assert b.get_stats().op("set").errors == 1000  # every refusal is still counted
    assert len(warnings_of(caplog)) <= 4, [r.getMessage() for r in warnings_of(caplog)]
    b.close()


def test_three_hundred_corrupt_reads_give_a_handful_of_warnings(
    root: str, caplog: pytest.LogCaptureFixture
) -> None:
    b = FileBackend(StorageConfig(), root=root)
    for i in range(300):
        assert b.set(f"k{i}", bytes([i % 256]) * 100)
    for path in tree_files(b.directory):  # flip one payload byte of every page
        with open(path, "r+b") as f:
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 0xFF]))
    caplog.set_level(logging.WARNING)
    assert all(b.get(f"k{i}") is None for i in range(300))
    assert b.get_stats().corrupt_objects == 300  # every one counted
    assert len(warnings_of(caplog)) <= 3, [r.getMessage() for r in warnings_of(caplog)]
    # The store's warnings keep their logger's name (operators' settings name it).
    assert {r.name for r in warnings_of(caplog)} == {"hicache_storage.storekit.filestore"}
    b.close()


def test_floor_refusals_and_planted_files_are_rate_limited(
    small_tmpfs: str, caplog: pytest.LogCaptureFixture
) -> None:
    kv = os.path.join(small_tmpfs, "kv")
    b = ShmBackend(StorageConfig(), root=kv, min_free_space="1MiB", recycle=False)
    with open(os.path.join(small_tmpfs, "another-program"), "wb") as f:
        f.write(b"\0" * (1200 * 1024))  # the tmpfs is below the floor: nothing to evict
    caplog.set_level(logging.WARNING)
    assert not any(b.set(f"k{i}", b"x" * 100_000) for i in range(300))
    for i in range(200):  # not files at all, planted under page names: counted misses
        path = b._path(b.object_name(f"dir{i}"))
        os.makedirs(path)
    assert all(b.get(f"dir{i}") is None for i in range(200))
    assert len(warnings_of(caplog)) <= 6, [r.getMessage() for r in warnings_of(caplog)]
    b.close()


def test_the_tracker_counts_what_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    tracker = CapacityTracker(100, lambda name: True)
    caplog.set_level(logging.WARNING)
    for i in range(50):
        assert tracker.reserve(f"big{i}", 1000) is None
    records = warnings_of(caplog)
    assert len(records) == 1 and "larger than max_size" in records[0].getMessage()


def test_rate_limited_log_says_how_many_it_suppressed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from hicache_storage import ratelimit

    now = [1000.0]
    monkeypatch.setattr(ratelimit.time, "monotonic", lambda: now[0])  # type: ignore[attr-defined]
    log = ratelimit.RateLimitedLog(logging.getLogger("hicache_storage.test"), interval=5.0)
    caplog.set_level(logging.WARNING)
    assert log("a", "event %d", 1)
    assert not log("a", "event %d", 2)
    assert not log("a", "event %d", 3)
    assert log("b", "other")  # another key is not held back
    assert log.suppressed("a") == 2
    now[0] += 5.0
    assert log("a", "event %d", 4)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["event 1", "other", "event 4 (2 similar messages suppressed)"]


def test_temporaries_that_cannot_be_removed_and_failed_directory_fsyncs_are_rate_limited(
    root: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Second attack, minor: two log lines of the publish path that repeat on every write
    of a directory that refuses unlinks, or of a filesystem whose directory fsync fails."""
    from hicache_storage.storekit import atomic

    b = FileBackend(StorageConfig(), root=root, fsync=True)
    assert b.set("warm", b"w")  # directories exist: only the per-write lines are left
    real_unlink = os.unlink

    def unlink(path: str, *args: object, **kwargs: object) -> None:
        if os.path.basename(path).startswith(".tmp."):
            raise PermissionError(1, "Operation not permitted", path)
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    def fsync_dir(directory: str) -> None:
        raise OSError(5, "Input/output error", directory)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(atomic, "fsync_dir", fsync_dir)
    caplog.set_level(logging.WARNING)
    assert all(b.set(f"k{i}", b"x" * 100) for i in range(300))  # published all the same
    lines = warnings_of(caplog)
    assert len(lines) <= 4, [r.getMessage() for r in lines]
    assert {"temporary", "fsync"} <= {
        "temporary" if "temporary" in r.getMessage() else "fsync" for r in lines
    }
    monkeypatch.undo()
    b.close()
