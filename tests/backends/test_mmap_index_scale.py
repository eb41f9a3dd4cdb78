"""The ``mmap`` index at scale: compact BULK records written at close, and one-record clears.

What these check: a large log is rewritten in columns when the backend closes and the
next instance loads every entry from it; a damaged BULK record costs only its entries;
``clear()`` is one CLEAR record that other instances apply and that spares the other
namespaces, and its slots are reused even when the writer died before retiring them;
logs of the first format version are still read.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.backends import MmapBackend
from hicache_storage.backends._mmap import index_log as L
from hicache_storage.backends._mmap import log_format as F
from hicache_storage.backends._mmap.arena import CRC
from hicache_storage.backends._mmap.slots import Slots

HEAD = F.LOG_HEAD.size + CRC.size
# An arena with room for the 5,000-object stores of these tests (a log past the point
# where close() compacts it).
BIG = {"max_size": "24MiB", "slot_size": "4KiB", "prefault": False}


def config(tenant: str) -> StorageConfig:
    ns = KVCacheNamespace(model_id="m", dtype="uint8", page_size=4, tenant=tenant)
    return StorageConfig(namespace=ns)


def value(i: int) -> bytes:
    return i.to_bytes(4, "little") * 64  # 256 bytes, different for every i


def fill(b: MmapBackend, keys: list[str], start: int = 0) -> None:
    for lo in range(0, len(keys), 500):
        chunk = keys[lo : lo + 500]
        assert all(b.batch_set(chunk, [value(start + lo + j) for j in range(len(chunk))]))


def records(index: Path) -> list[tuple[int, int, int]]:
    """(kind, offset, total bytes) of every record of a log with no damage."""
    raw = index.read_bytes()
    out, off = [], HEAD
    while off < len(raw):
        _m, kind, _a, name_len, _s, _g, length, _c = F.REC.unpack_from(raw, off)
        size = F.REC.size + (length if kind == F.BULK else name_len) + CRC.size
        out.append((kind, off, size))
        off += size
    return out


def test_close_rewrites_a_large_log_in_columns_and_the_next_open_loads_it(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    b = arena(**BIG)
    keys = [f"k{i}" for i in range(5000)]
    fill(b, keys)
    b.close()
    kinds = [k for k, _, _ in records(tmp_path / "arena.index")]
    assert kinds and set(kinds) == {F.BULK}, kinds[:5]
    again = arena(**BIG)
    assert again.usage()["objects"] == 5000
    assert again.batch_exists(keys) == 5000
    for i in range(0, 5000, 97):
        got = again.get(keys[i])
        assert got is not None
        assert bytes(got.numpy()) == value(i)
    assert again.set("later", b"x")  # appends after the BULK records
    third = arena(**BIG)
    assert third.batch_exists([*keys, "later"]) == 5001


def test_a_small_log_is_left_as_it_is_at_close(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    b = arena(max_size="4MiB", slot_size="4KiB", prefault=False)
    fill(b, [f"k{i}" for i in range(20)])
    before = os.stat(tmp_path / "arena.index")
    b.close()
    after = os.stat(tmp_path / "arena.index")
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert {k for k, _, _ in records(tmp_path / "arena.index")} == {F.PUT}


def test_a_damaged_bulk_record_costs_only_its_own_entries(
    arena: Callable[..., MmapBackend], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(F, "BULK_CHUNK", 1000)
    b = arena(**BIG)
    keys = [f"k{i}" for i in range(5000)]
    fill(b, keys)
    b.close()
    index = tmp_path / "arena.index"
    recs = records(index)
    assert [k for k, _, _ in recs] == [F.BULK] * 5
    _, off, size = recs[2]
    raw = bytearray(index.read_bytes())
    raw[off + size - 100] ^= 0x5A  # inside the names of the third record
    index.write_bytes(bytes(raw))
    again = arena(**BIG)
    # Compaction writes the index in insertion order: the third record held k2000..k2999.
    alive = [i for i in range(5000) if again.exists(keys[i])]
    assert alive == [*range(2000), *range(3000, 5000)]
    assert again.get_stats().corrupt_objects >= 1
    for i in alive[::53]:
        got = again.get(keys[i])
        assert got is not None
        assert bytes(got.numpy()) == value(i)
    # The lost keys' slots are orphans: reclaimed by later writes, never served.
    assert again.batch_exists(keys[2000:3000]) == 0
    assert again.set(keys[2500], b"new")
    assert bytes(again.get(keys[2500]).numpy()) == b"new"


def test_clear_is_one_record_that_spares_other_namespaces(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    opts = {"max_size": "2600KiB", "slot_size": "4KiB", "prefault": False}
    a = arena(config("a"), **opts)
    other = arena(config("b"), **opts)
    keys = [f"k{i}" for i in range(250)]
    fill(a, keys)
    fill(other, keys, start=1000)
    watcher = arena(config("a"), **opts)
    assert watcher.batch_exists(keys) == 250
    index = tmp_path / "arena.index"
    size = index.stat().st_size
    a.clear()
    prefix = config("a").namespace.digest + "/"
    assert index.stat().st_size == size + F.REC.size + len(prefix) + CRC.size
    assert records(index)[-1][0] == F.CLEAR
    assert a.batch_exists(keys) == 0
    assert not watcher.exists(keys[0])  # another instance applies the record
    assert watcher.batch_exists(keys) == 0
    assert other.batch_exists(keys) == 250
    reopened = arena(config("a"), **opts)
    assert reopened.batch_exists(keys) == 0
    # The cleared slots are free again: refilling the namespace evicts nothing of b's.
    slots = a.slots_for(256)
    assert 250 + 250 <= slots < 250 + 250 + 150
    # More than the never-used slots, less than what evicts ahead (5 % free).
    count = slots - 250 - slots // 10
    assert count > slots - 500
    fill(a, [f"n{i}" for i in range(count)], start=5000)
    assert a.get_stats().evictions == 0
    for i in range(0, 250, 7):
        got = other.get(keys[i])
        assert got is not None
        assert bytes(got.numpy()) == value(1000 + i)


def test_slots_of_a_clear_whose_writer_died_before_retiring_them_are_reused(
    arena: Callable[..., MmapBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = {"max_size": "2600KiB", "slot_size": "4KiB", "prefault": False}
    a = arena(config("a"), **opts)
    other = arena(config("b"), **opts)
    keys = [f"k{i}" for i in range(250)]
    fill(a, keys)
    fill(other, keys, start=1000)
    # The CLEAR record is written, then the writer "dies": its slots stay committed.
    monkeypatch.setattr(Slots, "retire", staticmethod(lambda arena, slots: None))
    a.clear()
    monkeypatch.undo()
    a.close()
    fresh = arena(config("a"), **opts)
    assert fresh.batch_exists(keys) == 0
    slots = fresh.slots_for(256)
    count = slots - 250 - slots // 10  # more than the never-used slots: orphans needed
    assert count > slots - 500
    fill(fresh, [f"n{i}" for i in range(count)], start=5000)
    assert fresh.get_stats().evictions == 0  # the orphans were reused, b's pages kept
    assert other.batch_exists(keys) == 250
    for i in range(0, 250, 7):
        got = other.get(keys[i])
        assert got is not None
        assert bytes(got.numpy()) == value(1000 + i)


def test_a_log_of_the_first_format_version_is_still_read(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    b = arena(max_size="4MiB", slot_size="4KiB", prefault=False)
    keys = [f"k{i}" for i in range(20)]
    fill(b, keys)
    b.close()
    index = tmp_path / "arena.index"
    raw = bytearray(index.read_bytes())
    magic, version, flags, nonce = F.LOG_HEAD.unpack_from(raw)
    assert version == 2
    head = F.LOG_HEAD.pack(magic, 1, flags, nonce)
    raw[:HEAD] = head + struct.pack("<I", zlib.crc32(head))
    index.write_bytes(bytes(raw))
    again = arena(max_size="4MiB", slot_size="4KiB", prefault=False)
    assert again.batch_exists(keys) == 20
    assert bytes(again.get(keys[7]).numpy()) == value(7)


def columns(names: list[str], slots: list[int], gens: list[int]) -> F.Columns:
    n = len(names)
    return F.Columns(
        names,
        np.array(slots, np.uint32),
        np.array(gens, np.uint64),
        np.full(n, 10, np.uint64),
        np.zeros(n, np.uint64),
        np.zeros(n, np.uint8),
    )


def bare_log(nslots: int) -> L.IndexLog:
    log = L.IndexLog("/nonexistent", False, lambda: None, lambda n, o: None)
    log.arena = SimpleNamespace(nslots=nslots)  # type: ignore[assignment]
    log._empty_index()
    return log


def test_bulk_entries_that_meet_earlier_ones_follow_the_put_rules() -> None:
    log = bare_log(8)
    log.apply_columns(columns(["a", "b"], [0, 1], [5, 6]))
    # "a" again, in another slot: the later one wins and slot 0 is no longer live.
    log.apply_columns(columns(["a", "c"], [2, 3], [7, 8]))
    assert log.index == {"a": F.pack(2, 7), "b": F.pack(1, 6), "c": F.pack(3, 8)}
    assert log.by_slot == {1: "b", 2: "a", 3: "c"}
    # Slot 1 taken by "d": the name it held ("b") is gone (the one-by-one path).
    log.apply_columns(columns(["d"], [1], [9]))
    assert log.index == {"a": F.pack(2, 7), "c": F.pack(3, 8), "d": F.pack(1, 9)}
    assert log.by_slot == {1: "d", 2: "a", 3: "c"}
    entry = log.entry("d")
    assert entry is not None
    assert (entry.slot, entry.generation, entry.length) == (1, 9, 10)


def test_drop_prefix_removes_exactly_the_names_under_it() -> None:
    log = bare_log(8)
    log.apply_columns(columns(["p/x", "p/y", "q/x", "pq/z"], [0, 1, 2, 3], [1, 2, 3, 4]))
    assert sorted(log.drop_prefix("p/")) == [0, 1]
    assert log.index == {"q/x": F.pack(2, 3), "pq/z": F.pack(3, 4)}
    assert log.by_slot == {2: "q/x", 3: "pq/z"}
    assert log.drop_prefix("zz/") == []
    assert sorted(log.drop_prefix("q")) == [2]
    assert log.by_slot == {3: "pq/z"}


def test_a_batch_that_outruns_the_free_slot_hint_gets_distinct_slots(
    arena: Callable[..., MmapBackend],
) -> None:
    """The hint of free slots is refilled in the middle of a batch's reservation, when
    the batch's own slots are not marked yet: none may be handed out twice."""
    b = arena(max_size="256KiB", slot_size="4KiB", reuse_delay=0, prefault=False)
    n = b.slots_for(256)
    fill(b, [f"a{i}" for i in range(n // 2)])
    arena_ = b._arena
    assert arena_ is not None
    with b._writer_lock():
        b._slots.claim_slabs(arena_, 1, n // 4)  # free slots of the class, all in the hint
    b._slots.free_hint[1] = b._slots.free_hint[1][
        -2:
    ]  # as if other batches had used up all but two
    keys = [f"b{i}" for i in range(n // 3)]
    fill(b, keys, start=100)
    slots = [b._log.index[b.object_path(k)] & 0xFFFFFFFF for k in keys]
    assert len(set(slots)) == len(keys)
    for i, k in enumerate(keys):
        got = b.get(k)
        assert got is not None
        assert bytes(got.numpy()) == value(100 + i)
    assert b.batch_exists([f"a{i}" for i in range(n // 2)]) == n // 2


def test_a_growing_store_is_compacted_as_it_grows_not_only_at_close(
    arena: Callable[..., MmapBackend], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash (no close) leaves at most about a quarter of the entries to decode one by one."""
    monkeypatch.setattr(L, "_LOOSE_MIN", 500)
    b = arena(**BIG)
    keys = [f"k{i}" for i in range(5000)]
    fill(b, keys)
    assert b.compactions >= 3  # 500, then each time the store grew by a third
    loose = sum(1 for k, _, _ in records(tmp_path / "arena.index") if k == F.PUT)
    assert loose <= 5000 // 4 + 500
    again = arena(**BIG)  # b still open
    assert again.batch_exists(keys) == 5000
    assert bytes(again.get(keys[4321]).numpy()) == value(4321)


# --------------------------------------------------------------------------- found in review


def test_a_reload_leaves_the_view_readers_hold_intact(
    arena: Callable[..., MmapBackend],
) -> None:
    """A lock-free reader pairs a name with its slot's length and checksum from one view:
    a reload (after another instance compacted) builds a new one instead of zeroing the
    columns under the reader (which made a hit of zero bytes)."""
    w = arena(max_size="8MiB", slot_size="4KiB", prefault=False, checksum="xxh3")
    r = arena(max_size="8MiB", slot_size="4KiB", prefault=False, checksum="xxh3")
    keys = [f"k{i}" for i in range(100)]
    fill(w, keys)
    assert r.batch_exists(keys) == 100
    held = r._log._view  # what a reader in the middle of a lookup holds
    name = r.object_path(keys[7])
    slot = held.names[name] & 0xFFFFFFFF
    with w._writer_lock():
        w._log.compact()
    assert not r.exists("not-there")  # a miss: r catches up, sees the new log, reloads
    assert r._log._view is not held
    assert int(held.lengths[slot]) == 256  # the held view was not touched
    assert int(held.algorithms[slot]) != 0
    entry = r._log.entry(name)
    assert entry is not None
    assert (entry.slot, entry.length) == (slot, 256)
    assert bytes(r.get(keys[7]).numpy()) == value(7)


def test_a_failed_eviction_ahead_gives_back_the_slots_it_had_taken(
    arena: Callable[..., MmapBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = arena(max_size="1MiB", slot_size="4KiB", prefault=False)
    n = b.slots_for(100)
    fill(b, [f"k{i}" for i in range(n - 12)])

    def full_disk(self: L.IndexLog, records: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(L.IndexLog, "append", full_disk)  # the eviction's DEL records
    assert b.batch_set([f"n{i}" for i in range(10)], [b"b" * 100] * 10) == [False] * 10
    monkeypatch.undo()
    table = b._arena.slots  # type: ignore[union-attr]
    assert int(((table["state"] == 1) & (table["token"] == b._slots.token)).sum()) == 0
    other = arena(max_size="1MiB", slot_size="4KiB", prefault=False)
    assert not any(other._slots.held_elsewhere(other._arena, s) for s in range(n))  # type: ignore[arg-type]
    assert b.set("after", b"x")


def test_close_with_a_bad_file_at_the_index_path_still_closes(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    b = arena(**BIG)
    fill(b, [f"k{i}" for i in range(5000)])  # enough for close() to want to compact
    index = tmp_path / "arena.index"
    index.unlink()
    os.mkfifo(index, 0o600)
    b.close()  # logged, not raised
    assert b._arena is None


def test_close_in_a_forked_child_leaves_the_parents_lock_and_log_alone(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    import fcntl
    import threading

    b = arena(**BIG)
    fill(b, [f"k{i}" for i in range(5000)])  # close() in the parent would compact
    index = tmp_path / "arena.index"
    inode = index.stat().st_ino
    held, go = threading.Event(), threading.Event()

    def hold() -> None:  # a batch committing in the parent at the moment of the fork
        with b._writer_lock():
            held.set()
            go.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: close() must neither hang nor touch what is shared
        code = 1
        try:
            b.close()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("close() in the child hung")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0
    assert index.stat().st_ino == inode  # not compacted by the child
    probe = os.open(tmp_path / "arena", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):  # still the parent's
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(probe)
        go.set()
        t.join()
    assert b.set("after-fork", b"p")
    assert b.batch_exists([f"k{i}" for i in range(5000)]) == 5000


def test_a_failed_batch_gives_its_slots_back_under_the_writer_lock(
    arena: Callable[..., MmapBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between marking a slot free and dropping its slot lock, no other thread of the
    instance may reserve it (its lock, the same open file's, would be dropped too)."""
    import hicache_storage.backends._mmap.backend as impl

    b = arena(max_size="1MiB", slot_size="4KiB", prefault=False)
    real_copy = impl.copy_in  # type: ignore[attr-defined]
    real_lock = Slots.slot_lock
    seen: list[bool] = []

    def failing_copy(a: object, slot: int, views: list[memoryview], ptrs: object) -> None:
        if bytes(views[0][:4]) == b"BOOM":
            raise OSError(5, "injected EIO")
        real_copy(a, slot, views, ptrs)  # type: ignore[arg-type]

    def watching_lock(self: Slots, a: object, slot: int, take: bool) -> bool:
        if not take:
            seen.append(b._wlock.locked())  # every slot lock is dropped under the lock
        return real_lock(self, a, slot, take)  # type: ignore[arg-type]

    monkeypatch.setattr(impl, "copy_in", failing_copy)
    monkeypatch.setattr(Slots, "slot_lock", watching_lock)
    assert b.batch_set(["x", "y"], [b"BOOM" * 16, b"ok" * 32]) == [False, False]
    assert b.set("z", b"Z" * 64)
    assert seen
    assert all(seen)
    monkeypatch.undo()
    table = b._arena.slots  # type: ignore[union-attr]
    assert int(((table["state"] == 1) & (table["token"] == b._slots.token)).sum()) == 0
    assert bytes(b.get("z").numpy()) == b"Z" * 64
