"""The ``mmap`` backend: a persistent slab arena with a crash-safe, shared index."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import PageBuffer, Segment, StorageConfig
from hicache_storage.backends import MmapBackend
from hicache_storage.buffers import memoryview_at
from hicache_storage.conformance import BackendConformance, BackendSpec
from hicache_storage.errors import ConfigError, NotSupportedError

WORKER = Path(__file__).parents[1] / "workers" / "mmap_writer.py"
MiB = 2**20


class TestMmapConformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self, tmp_path: Path) -> BackendSpec:
        return BackendSpec(
            "mmap",
            # 159 slots (the engine's 128-page batches fit), 1 MiB objects; fallocated, not
            # prefaulted, to keep a full run's disk writes small.
            {"path": str(tmp_path / "arena"), "max_size": "160MiB", "slot_size": "1MiB",
             "prefault": False},
        )  # fmt: skip


@pytest.fixture(scope="class")
def shared_arena(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One arena path for all the checks of a class, as one CLI run uses."""
    return tmp_path_factory.mktemp("mmap-shared") / "arena"


class TestMmapConformanceDefaults(BackendConformance):
    """The documented options only (path and capacity), as ``hicache-storage conformance``
    runs them: one arena for the whole run, so the checks meet each other's page sizes
    (a 4 MiB first page fixed every slot at 4 MiB, and 128-page batches of other sizes
    found 0 pages present)."""

    @pytest.fixture
    def backend_spec(self, shared_arena: Path) -> BackendSpec:
        return BackendSpec("mmap", {"path": str(shared_arena), "max_size": "512MiB"})


class TestMmapConformanceDurable(BackendConformance):
    """fsync on, checksums written and verified."""

    @pytest.fixture
    def backend_spec(self, tmp_path: Path) -> BackendSpec:
        opts = {"path": str(tmp_path / "arena"), "max_size": "160MiB", "slot_size": "1MiB", "fsync": True,
                "checksum": "xxh3", "verify_checksum": True, "prefault": False}  # fmt: skip
        return BackendSpec("mmap", opts)


def test_an_instance_learns_its_object_limit_when_the_arena_opens(tmp_path: Path) -> None:
    from hicache_storage.conformance.data import make_pool, pool_namespace

    pool = make_pool()
    b = MmapBackend(
        StorageConfig(namespace=pool_namespace(pool)),
        path=str(tmp_path / "lazy"),
        max_size="16MiB",
        prefault=False,
    )
    try:
        assert b.capabilities.max_object_bytes is None  # no arena yet: no slot size
        b.register_mem_pool_host(pool)  # creates the arena with the pool's page size
        refined = b.capabilities  # read again: the instance refined them
        assert refined.max_object_bytes == b.usage()["slot_size"] > 0
        assert MmapBackend.capabilities.max_object_bytes is None  # the class is untouched
        assert b.capabilities.zero_copy and b.capabilities.persistent
    finally:
        b.close()


def value(i: int, n: int = 1000) -> bytes:
    return bytes([i % 256]) * n


def test_geometry_is_fixed_at_creation(arena: Callable[..., MmapBackend], tmp_path: Path) -> None:
    a = arena(max_size="64MiB", slot_size="1MiB")
    u = a.usage()
    assert u["slot_size"] == MiB
    assert 55 <= u["slabs"] <= 63
    assert os.path.getsize(tmp_path / "arena") <= 64 * MiB
    a.set("k", b"v")
    a.close()
    again = arena(max_size="1GiB", slot_size="8MiB")  # ignored: the arena exists
    assert again.usage() == {
        **u,
        "objects": 1,
        "used_bytes": 1,
        "namespace_objects": 1,
        "namespace_used_bytes": 1,
    }
    assert again.capabilities.max_object_bytes == MiB
    assert again.set("big", b"x" * (MiB + 1)) is False


def test_slot_size_follows_the_registered_pool(arena: Callable[..., MmapBackend]) -> None:
    from hicache_storage.conformance.data import make_pool

    pool = make_pool()
    b = arena(max_size="8MiB")
    b.register_mem_pool_host(pool)
    assert b.usage()["slot_size"] == 4096  # the pool's 768-byte pages, rounded to 4 KiB


def test_persistence_and_sharing_between_instances(arena: Callable[..., MmapBackend]) -> None:
    a = arena(max_size="32MiB", slot_size="64KiB")
    other = arena()  # a second instance on the same arena (think: another rank)
    assert a.batch_set([f"k{i}" for i in range(20)], [value(i) for i in range(20)]) == [True] * 20
    assert other.batch_exists([f"k{i}" for i in range(20)]) == 20
    assert bytes(other.get("k7").numpy()) == value(7)
    a.close()
    reopened = arena()
    assert [bytes(t.numpy()) for t in reopened.batch_get([f"k{i}" for i in range(20)])] == [
        value(i) for i in range(20)
    ]


def test_another_process_sees_new_keys(arena: Callable[..., MmapBackend], tmp_path: Path) -> None:
    a = arena(max_size="16MiB", slot_size="64KiB")
    assert not a.exists("from-child")
    r = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "arena"), "put", "from-child", "5000"],
                       capture_output=True, text=True, check=True)  # fmt: skip
    assert r.stdout.strip() == "True"
    got = a.get("from-child")
    assert got is not None
    assert bytes(got.numpy()) == b"\x09" * 5000


def test_full_store_evicts_least_recently_used(arena: Callable[..., MmapBackend]) -> None:
    b = arena(max_size="1MiB", slot_size="64KiB", reuse_delay=0, low_free_slots=0)
    slots = b.slots_for(1000)  # 16 slots of 4 KiB in each slab of 64 KiB
    assert slots == 16 * b.usage()["slabs"]
    keys = [f"k{i}" for i in range(slots)]
    assert b.batch_set(keys, [value(i) for i in range(slots)]) == [True] * slots
    time.sleep(0.01)
    assert b.get("k0") is not None  # k0 is now the most recently used
    assert b.set("new", b"n")
    assert b.exists("new")
    assert b.exists("k0")
    assert not b.exists("k1")
    assert b.get_stats().evictions == 1
    for i in range(3 * slots):  # keeps working when full, never fails
        assert b.set(f"more{i}", value(i))
    assert b.usage()["objects"] <= slots


def test_a_torn_index_record_is_ignored(arena: Callable[..., MmapBackend], tmp_path: Path) -> None:
    b = arena(max_size="8MiB", slot_size="64KiB")
    for i in range(10):
        b.set(f"k{i}", value(i))
    b.close()
    index = tmp_path / "arena.index"
    size = index.stat().st_size
    os.truncate(index, size - 7)  # a crash in the middle of appending the last record
    again = arena()
    assert again.batch_exists([f"k{i}" for i in range(10)]) == 9
    assert not again.exists("k9")
    assert again.set("after", b"a")  # the torn tail is cut before appending
    third = arena()
    assert third.batch_exists([f"k{i}" for i in range(9)]) == 9
    assert bytes(third.get("after").numpy()) == b"a"
    assert not third.exists("k9")


def test_compaction_is_atomic_and_seen_by_other_instances(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    b = arena(max_size="1MiB", slot_size="4KiB", reuse_delay=0)
    watcher = arena()
    index = tmp_path / "arena.index"
    for i in range(1000):  # 1000 puts and ~750 evictions: past the compaction threshold
        assert b.set(f"k{i}", value(i, 100))
    assert b.compactions >= 1
    record = 36 + len(b.object_name("k0").path) + 4
    # ~1750 records were appended; compaction keeps the log under its threshold of 1024.
    assert index.stat().st_size <= 1024 * record
    assert not list(tmp_path.glob("arena.index.tmp*"))
    assert watcher.exists("k999")  # reloads the new log
    assert bytes(watcher.get("k999").numpy()) == value(999, 100)
    live = b.usage()["objects"]
    assert watcher.usage()["objects"] == live


def test_readers_never_get_bytes_of_a_reused_slot(arena: Callable[..., MmapBackend]) -> None:
    """Eviction and immediate reuse racing a reader: the reader misses or reads right."""
    size = 2 * MiB
    b = arena(max_size="12MiB", slot_size="2MiB", reuse_delay=0, low_free_slots=0)
    reader = arena()
    stop = threading.Event()
    wrong: list[int] = []
    hits = [0]

    def read_loop() -> None:
        target = bytearray(size)
        while not stop.is_set():
            for i in range(40):
                if reader.get(f"k{i}", target) is not None:
                    hits[0] += 1
                    if target[0] != i or target[-1] != i:
                        wrong.append(i)

    t = threading.Thread(target=read_loop)
    t.start()
    try:
        for i in range(40):
            assert b.set(f"k{i}", bytes([i]) * size)
    finally:
        stop.set()
        t.join()
    assert wrong == []
    assert hits[0] > 0


def test_a_writer_killed_mid_copy_leaves_nothing_visible(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    slot = 64 * MiB
    b = arena(max_size="200MiB", slot_size="64MiB")
    path = str(tmp_path / "arena")
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), path, "big", str(slot)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    keys = []
    for line in proc.stdout:
        keys.append(line.split()[1])
        if len(keys) == 3:  # two objects done, the third being copied
            break
    time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    keys += [line.split()[1] for line in proc.stdout.read().splitlines()]
    proc.stdout.close()
    target = bytearray(slot)
    for k in keys:
        got = b.get(k, target)
        if got is not None:
            assert target == b"\x05" * slot, k
        else:
            assert not b.exists(k)
    # The dead writer's slot is reclaimed: the arena still takes as many objects as it has slots.
    # (Small objects: every slab is cut into their class, the dead writer's one too.)
    for i in range(b.slots_for(1000) + 1):
        assert b.set(f"after{i}", b"x" * 1000)


def test_bad_arenas_and_options(tmp_path: Path) -> None:
    bad = tmp_path / "not-an-arena"
    bad.write_bytes(b"garbage" * 1000)
    with pytest.raises(ConfigError, match="not a hicache-storage mmap arena"):
        MmapBackend(StorageConfig(), path=str(bad))
    with pytest.raises(ConfigError):
        MmapBackend(StorageConfig(), path=str(tmp_path / "a"), max_size="1KiB", slot_size="1MiB")
    with pytest.raises(ConfigError, match="verify_checksum"):
        MmapBackend(
            StorageConfig(), path=str(tmp_path / "b"), checksum="none", verify_checksum=True
        )


def test_zero_copy_from_a_tensor(arena: Callable[..., MmapBackend]) -> None:
    b = arena(max_size="8MiB", slot_size="1MiB")
    src = torch.arange(1000, dtype=torch.int64)
    assert b.set("t", src)
    dst = torch.zeros(1000, dtype=torch.int64)
    assert b.get("t", dst) is dst
    assert torch.equal(dst, src)


# ---------------------------------------------------------------- regressions found in review


def page_buffers(*datas: bytes) -> list[PageBuffer]:
    """One single-segment PageBuffer per value (one batch call writes them together)."""
    out = []
    for data in datas:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out.append(
            PageBuffer(
                [Segment(t.data_ptr(), t.numel(), memoryview_at(t.data_ptr(), t.numel(), t))]
            )
        )
    return out


def test_a_failed_copy_never_frees_a_slot_still_being_written(
    arena: Callable[..., MmapBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One copy of a batch fails while another is still copying: no later key may read
    the straggler's bytes. (The I/O error is injected: the thing under test is the
    backend's clean-up.)"""
    import hicache_storage.backends._mmap.backend as impl  # where copy_in is looked up

    real = impl.copy_in  # type: ignore[attr-defined]  # patched where the backend calls it

    def flaky(a: object, slot: int, views: list[memoryview], ptrs: object) -> None:
        first = bytes(views[0][:1])[0]
        if first == 0x01:
            raise OSError(5, "injected EIO")
        if first == 0xBB:
            time.sleep(0.4)  # a slow straggler
        real(a, slot, views, ptrs)  # type: ignore[arg-type]

    monkeypatch.setattr(impl, "copy_in", flaky)
    b = arena(max_size="4MiB", slot_size="1MiB", max_concurrency=2, reuse_delay=0)
    pages = page_buffers(b"\x01" * MiB, b"\xbb" * MiB)
    assert b.batch_set_pages(["fail", "straggler"], pages) == [False, False]
    for i in range(3):
        assert b.set(f"victim{i}", b"\xaa" * MiB)
    time.sleep(0.5)
    for i in range(3):
        got = b.get(f"victim{i}")
        assert got is not None
        assert bytes(got.numpy()[:1]) == b"\xaa"


SLOW_WRITER = """
import sys, time
import hicache_storage.backends._mmap.backend as impl  # where copy_in is looked up
from hicache_storage import PageBuffer, Segment, StorageConfig
from hicache_storage.buffers import memoryview_at
real = impl.copy_in
def slow(arena, slot, views, ptrs):
    print("reserved", flush=True)
    time.sleep(1.5)
    real(arena, slot, views, ptrs)
impl.copy_in = slow
b = impl.MmapBackend(StorageConfig(), path=sys.argv[1])
print(b.set("A", b"\\xa1" * (1 << 20)), flush=True)
b.close()
"""


def test_a_live_writer_in_another_pid_namespace_keeps_its_slot(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    b = arena(max_size="5MiB", slot_size="1MiB", reuse_delay=0)
    for i in range(3):
        b.set(f"k{i}", bytes([i]) * MiB)
    proc = subprocess.Popen(
        ["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", SLOW_WRITER, str(tmp_path / "arena")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "reserved"
    assert b.set("B", b"\xb2" * MiB)  # must not take the slot the other writer is filling
    out, _ = proc.communicate(timeout=60)
    assert out.strip() == "True"
    for key, byte in (("B", 0xB2), ("A", 0xA1)):
        got = b.get(key)
        if got is not None:  # one of them may have been evicted; what is there is right
            assert set(bytes(got.numpy())) == {byte}


def test_use_after_fork_is_refused_and_the_parent_is_unaffected(
    arena: Callable[..., MmapBackend],
) -> None:
    b = arena(max_size="4MiB", slot_size="64KiB")
    b.set("before", b"x")
    pid = os.fork()
    if pid == 0:  # the child must not share the parent's locks and log position
        try:
            b.set("child", b"c")
        except NotSupportedError:  # passes through the guard
            os._exit(0)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert b.set("after", b"y")
    assert b.exists("before")
    assert b.exists("after")


def test_a_creator_killed_mid_creation_leaves_a_usable_path(tmp_path: Path) -> None:
    path = tmp_path / "arena"
    code = (
        "from hicache_storage import StorageConfig; from hicache_storage.backends import MmapBackend; "
        f"MmapBackend(StorageConfig(), path={str(path)!r}, max_size='2GiB', slot_size='4MiB')"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while (
        not any(p.name.startswith(".tmp.") for p in tmp_path.iterdir())
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    time.sleep(0.2)  # inside the prefault pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not path.exists()  # only a temporary, never a half-made arena
    b = MmapBackend(StorageConfig(), path=str(path), max_size="8MiB", slot_size="64KiB")
    assert b.set("k", b"v")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp.")]  # swept
    b.close()


@pytest.mark.parametrize("algorithm", ["xxh3", "none"])
def test_a_lost_slot_table_row_is_repaired_only_when_the_bytes_verify(
    arena: Callable[..., MmapBackend], tmp_path: Path, algorithm: str
) -> None:
    """A slot-table row that disagrees with the log (lost in a power failure, rolled back)
    is rebuilt when the slot's bytes match the record's checksum; without a checksum
    nothing proves the bytes are the key's, so the key is dropped: a miss, never a guess."""
    b = arena(max_size="1MiB", slot_size="4KiB", fsync=True, checksum=algorithm)
    assert b._arena is not None
    table = b._arena.table_off
    before = bytes(b._arena.map[table : table + 64])  # row 0 as created
    assert b.set("K", b"\x77" * 4096)
    b.close()
    with open(tmp_path / "arena", "r+b") as f:  # the table page never reached the disk
        f.seek(table)
        f.write(before)
    again = arena(checksum=algorithm)
    got = again.get("K")
    if algorithm == "xxh3":
        assert got is not None
        assert bytes(got.numpy()) == b"\x77" * 4096
    else:
        assert got is None
    assert again.set("K2", b"\x01" * 100)  # the slot is usable again either way


FLOCK_HOLDER = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_readers_do_not_wait_for_another_processs_writer_lock(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    b = arena(max_size="1MiB", slot_size="4KiB")
    b.set("present", b"x")
    holder = subprocess.Popen([sys.executable, "-c", FLOCK_HOLDER, str(tmp_path / "arena")],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        writer = threading.Thread(target=lambda: b.set("w", b"y"), daemon=True)
        writer.start()  # blocks on the flock
        time.sleep(0.2)
        answers: list[bool] = []
        reader = threading.Thread(
            target=lambda: answers.extend([b.exists("absent"), b.exists("present")]),
            daemon=True,
        )
        reader.start()
        reader.join(30)  # a reader waiting for the lock would wait 60 s, then fail
        assert answers == [False, True]
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()  # type: ignore[union-attr]
    writer.join(10)
    assert b.exists("w")


def test_an_error_while_reserving_leaks_no_slot(
    arena: Callable[..., MmapBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache_storage.backends._mmap.arena import SlotState
    from hicache_storage.backends._mmap.index_log import IndexLog
    from hicache_storage.backends._mmap.log_format import RecordKind

    b = arena(max_size="64KiB", slot_size="4KiB", reuse_delay=0, max_concurrency=1)
    n = b.slots_for(1)
    for i in range(n - 1):
        b.set(f"old{i}", b"o")
    real = IndexLog.append
    evictions = []

    def full_disk(self: IndexLog, records: list) -> None:
        if records and records[0][0] == RecordKind.DEL:
            evictions.append(len(records))
            raise OSError(28, "No space left on device")
        real(self, records)

    monkeypatch.setattr(IndexLog, "append", full_disk)
    assert b.batch_set_pages(["k0", "k1"], page_buffers(b"a" * 100, b"b" * 100)) == [False, False]
    monkeypatch.setattr(IndexLog, "append", real)
    assert evictions, "the injected failure never ran"
    assert b._arena is not None
    assert int((b._arena.slots["state"] == SlotState.WRITING).sum()) == 0
    assert b.set("x", b"z")


def test_the_on_disk_layout_is_the_one_the_docstrings_table() -> None:
    """Superblock, slab-table entry, slot-table row, log header and record: sizes, offsets
    and enum values as tabled in arena.py and log_format.py (a change here is a new format
    version), and the size classes."""
    import numpy as np

    from hicache_storage.backends._mmap import arena as A
    from hicache_storage.backends._mmap import log_format as F

    assert A._SUPER.size + A.CRC.size == 76 and A._VERSION == 3
    assert np.dtype(A._SLAB_DTYPE).itemsize == 4
    assert [A.size_class(n) for n in range(1, 22)] == [
        1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14, 14, 16, 16, 20, 20, 20, 20, 24]  # fmt: skip
    assert A.slab_geometry(64 * 4096) == (4096, 64 * 4096)  # at most 64 units a slab
    assert A.slab_geometry(64 * 4096 + 1) == (8192, 33 * 8192)  # 33 units of 8 KiB
    row = np.dtype(A._SLOT_DTYPE)
    assert row.itemsize == 64
    assert row.fields is not None
    offsets = {name: row.fields[name][1] for name in row.names or ()}
    assert offsets == {"generation": 0, "state": 8, "pid": 12, "length": 16, "checksum": 24,
                       "last_access": 32, "since": 40, "token": 48, "pad": 56}  # fmt: skip
    assert {s.name: int(s) for s in A.SlotState} == {
        "FREE": 0, "WRITING": 1, "COMMITTED": 2, "RETIRED": 3}  # fmt: skip
    assert F.LOG_HEAD.size + A.CRC.size == 28
    assert F.REC.size == 36
    assert {k.name: int(k) for k in F.RecordKind} == {"PUT": 1, "DEL": 2, "BULK": 3, "CLEAR": 4}
    assert F.LOG_VERSION == 2 and F.READABLE == (1, 2)
    assert F.BULK_ROW == 29  # slot u32, generation/length/checksum u64 each, algorithm u8


# ---------------------------------------------------------------- size classes (issue 27, 19)


def test_objects_of_many_sizes_share_one_arena(arena: Callable[..., MmapBackend]) -> None:
    """Slabs of 4 MiB (the default largest slot) cut into the classes the objects need:
    small pages no longer take a 4 MiB slot each."""
    b = arena(max_size="64MiB", prefault=False)
    sizes = [0, 1, 100, 4096, 70_000, 300_000, MiB, 3 * MiB, 4 * MiB]
    keys = [f"s{n}" for n in sizes]
    values = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    assert b.batch_set(keys, values) == [True] * len(sizes)
    small = [f"p{i}" for i in range(500)]
    assert b.batch_set(small, [value(i, 5000) for i in range(500)]) == [True] * 500
    assert b.get_stats().evictions == 0
    assert b.usage()["slabs"] == 15  # room for 15 objects of 4 MiB, and all of these
    other = arena()
    for reader in (b, other):
        assert reader.batch_exists(keys) == len(keys)
        assert reader.batch_exists(small) == 500
        for k, v in zip(keys, values, strict=True):
            got = reader.get(k)
            assert got is not None and bytes(got.numpy()) == v, k
        for i in range(0, 500, 37):
            got = reader.get(f"p{i}")
            assert got is not None and bytes(got.numpy()) == value(i, 5000)
    assert b.set("too-big", b"x" * (4 * MiB + 1)) is False
    assert b.capabilities.max_object_bytes == 4 * MiB


def test_eviction_across_classes_is_least_recently_used(
    arena: Callable[..., MmapBackend],
) -> None:
    """A full arena makes room for a class by evicting what was used least recently: the
    class's own objects one by one, or a whole slab of another class whose newest object
    is older."""
    big = 256 * 1024  # one per slab
    b = arena(max_size="8MiB", slot_size="256KiB", reuse_delay=0, low_free_slots=0, prefault=False)
    n = 31  # slabs of 256 KiB in 8 MiB (checked below)
    bigs = [f"b{i}" for i in range(n)]
    assert b.batch_set(bigs, [value(i, big) for i in range(n)]) == [True] * n
    time.sleep(0.01)
    assert all(b.get(f"b{i}") is not None for i in range(5))  # b0..b4: recently used
    time.sleep(0.01)
    # 100 small pages (64 a slab): two slabs of the least recently used big ones go.
    small = [f"s{i}" for i in range(100)]
    assert b.batch_set(small, [value(i, 4000) for i in range(100)]) == [True] * 100
    assert b.get_stats().evictions == 2  # (get_stats starts the counts again)
    assert [b.exists(k) for k in bigs[:8]] == [True] * 5 + [False, False, True]
    time.sleep(0.01)
    # Three more big ones: the oldest big objects are older than any small page.
    assert b.batch_set(["x0", "x1", "x2"], [value(200 + i, big) for i in range(3)]) == [True] * 3
    assert [b.exists(k) for k in bigs[5:11]] == [False] * 5 + [True]
    assert b.get_stats().evictions == 3
    assert b.batch_exists(small) == 100
    time.sleep(0.01)
    # Every big object used again: now a slab of small pages is the least recently used.
    assert all(b.get(k) is not None for k in [*bigs[:5], *bigs[10:], "x0", "x1", "x2"])
    time.sleep(0.01)
    assert b.batch_set(["y0"], [value(99, big)]) == [True]
    assert b.get_stats().evictions == 64  # the small pages of one slab
    assert sum(b.exists(k) for k in small) == 100 - 64
    assert b.batch_exists([*bigs[:5], *bigs[10:], "x0", "x1", "x2", "y0"]) == 5 + 21 + 4
    for k in small:
        got = b.get(k)
        assert got is None or bytes(got.numpy()) == value(int(k[1:]), 4000)
    assert b.usage()["slabs"] == b.slots_for(big) == n


def test_reopen_after_mixed_size_writes(arena: Callable[..., MmapBackend], tmp_path: Path) -> None:
    """The slab table and the index survive the process: a new instance, and another
    process, read every size back and write beside them without overwriting any."""
    a = arena(max_size="16MiB", slot_size="1MiB", prefault=False)
    sizes = [10 + 997 * i for i in range(40)] + [100_000, 500_000, MiB]
    keys = [f"m{i}" for i in range(len(sizes))]
    values = [value(i, n) for i, n in enumerate(sizes)]
    assert a.batch_set(keys, values) == [True] * len(keys)
    assert a._arena is not None
    slabs = a._arena.slabs.copy()
    a.close()
    b = arena()
    assert b._arena is not None
    assert (b._arena.slabs == slabs).all()
    assert b.batch_exists(keys) == len(keys)
    r = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "arena"), "put", "child", "5000"],
                       capture_output=True, text=True, check=True)  # fmt: skip
    assert r.stdout.strip() == "True"
    more = [f"n{i}" for i in range(len(sizes))]
    assert b.batch_set(more, [value(100 + i, n) for i, n in enumerate(sizes)]) == [True] * len(more)
    assert b.get_stats().evictions == 0
    c = arena()
    for reader in (b, c):
        for i, k in enumerate(keys):
            got = reader.get(k)
            assert got is not None and bytes(got.numpy()) == values[i], k
            got = reader.get(more[i])
            assert got is not None and bytes(got.numpy()) == value(100 + i, sizes[i])
        got = reader.get("child")
        assert got is not None and bytes(got.numpy()) == b"\x09" * 5000


NEW_CLASS_WRITER = """
import sys, time
import hicache_storage.backends._mmap.backend as impl  # where copy_in is looked up
from hicache_storage import StorageConfig
real = impl.copy_in
calls = []
def copy_in(arena, slot, views, ptrs):
    calls.append(slot)
    if len(calls) == 2:  # the first page is copied, the second never ends
        print("copying", flush=True)
        time.sleep(600)
    real(arena, slot, views, ptrs)
impl.copy_in = copy_in
b = impl.MmapBackend(StorageConfig(), path=sys.argv[1], max_concurrency=1)
b.batch_set([f"new{i}" for i in range(3)], [bytes([0xEE]) * 200_000] * 3)
"""


def test_a_writer_killed_mid_write_of_a_new_size_class(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    """A writer that cut slabs into a class the arena had not seen dies in the middle of
    its copies: none of its pages is visible, and its slabs are reclaimed (its reserved
    slots, whose locks died with it, count as free; no slab stays pinned)."""
    small = 4000
    b = arena(max_size="4MiB", slot_size="256KiB", reuse_delay=0, low_free_slots=0, prefault=False)
    old = [f"o{i}" for i in range(64)]
    assert b.batch_set(old, [value(i, small) for i in range(64)]) == [True] * 64
    assert b.usage()["slabs"] == 15 and b.slots_for(small) == 15 * 64
    proc = subprocess.Popen([sys.executable, "-c", NEW_CLASS_WRITER, str(tmp_path / "arena")],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "copying"
        assert b._arena is not None
        cls = b._arena.units_for(200_000)
        assert int((b._arena.slabs == cls).sum()) == 3  # cut by the writer, being written
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    for reader in (b, arena()):
        assert not any(reader.exists(f"new{i}") for i in range(3))
        assert all(reader.get(f"new{i}") is None for i in range(3))
    # Fill the whole arena with small pages: the dead writer's slabs are cut again.
    fill = [f"f{i}" for i in range(b.slots_for(small) - 64)]
    assert b.batch_set(fill, [value(i, small) for i in range(len(fill))]) == [True] * len(fill)
    assert b.get_stats().evictions == 0
    assert b._arena is not None and (b._arena.slabs == b._arena.units_for(small)).all()
    again = arena()
    assert again.batch_exists(old + fill) == len(old + fill)
    for i in range(0, len(fill), 41):
        got = again.get(fill[i])
        assert got is not None and bytes(got.numpy()) == value(i, small)


def test_an_arena_of_the_earlier_format_is_refused_with_the_fix(tmp_path: Path) -> None:
    """Version 2 arenas (one slot size) are not read: a ConfigError that says what to delete."""
    import struct
    import zlib

    path = tmp_path / "arena"
    head = struct.pack("<8sIIQQQQQ", b"HCSMMAP1", 2, 0, 1 << 20, 3, 4096, 8192, 77)
    path.write_bytes(head + struct.pack("<I", zlib.crc32(head)) + bytes(8192 + 3 * (1 << 20)))
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="format version 2") as info:
        MmapBackend(StorageConfig(), path=str(path))
    assert "delete" in str(info.value) and str(path) in str(info.value)
    b = MmapBackend(StorageConfig(), path=str(tmp_path / "lazy"))  # opened on first use
    (tmp_path / "lazy").write_bytes(path.read_bytes())
    os.chmod(tmp_path / "lazy", 0o600)
    try:
        assert b.set("k", b"v") is False  # a failure shape, never garbage
        assert b.get("k") is None
    finally:
        b.close()


# ---------------------------------------------------------------- verified by default (27, 3)


def test_bytes_flipped_in_a_slot_read_as_a_miss_with_the_default_options(
    arena: Callable[..., MmapBackend],
) -> None:
    b = arena(max_size="1MiB", slot_size="64KiB")
    assert b.set("k", value(7, 5000))
    entry = b._log.entry(b.object_path("k"))
    assert entry is not None and b._arena is not None
    b._arena.slot_view(entry.slot, entry.length)[1234] ^= 0x10  # bit rot in the slot's bytes
    reader = arena()
    assert reader.get("k") is None
    assert reader.get_stats().corrupt_objects == 1
    assert not reader.exists("k") and not b.exists("k")  # deleted: not a hit that never loads
    assert b.set("k", value(8, 5000))  # and stored again
    assert bytes(reader.get("k").numpy()) == value(8, 5000)


def test_checksum_options_are_coherent(
    arena: Callable[..., MmapBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    default = arena(max_size="1MiB", slot_size="64KiB")
    assert default.options.checksum == "xxh3"
    assert default.options.verify is True
    off = arena(checksum="none")  # the explicit opt-out: nothing written, nothing checked
    assert off.options.verify is False
    unchecked = arena(verify_checksum=False)  # checksums kept for repairs, reads unchecked
    assert (unchecked.options.checksum, unchecked.options.verify) == ("xxh3", False)
    with pytest.raises(ConfigError, match="verify_checksum"):
        arena(checksum="none", verify_checksum=True)
    monkeypatch.setenv("HICACHE_STORAGE_MMAP_VERIFY_CHECKSUM", "true")
    with pytest.raises(ConfigError, match="verify_checksum"):
        arena(checksum="none")
    assert off.set("k", value(1, 5000))
    entry = off._log.entry(off.object_path("k"))
    assert entry is not None and entry.algorithm == 0 and off._arena is not None
    off._arena.slot_view(entry.slot, entry.length)[0] ^= 0x10
    got = unchecked.get("k")  # no checksum to check: served, as documented
    assert got is not None and bytes(got.numpy()) != value(1, 5000)


def test_usage_counts_each_namespace_of_the_arena_apart(
    arena: Callable[..., MmapBackend],
) -> None:
    """Two namespaces in one arena: the arena's figures are shared, each namespace's own
    objects and bytes are its own, and a clear of one leaves the other's count."""
    from hicache_storage import KVCacheNamespace

    a = arena(
        StorageConfig(
            namespace=KVCacheNamespace(model_id="m", dtype="bf16", page_size=4, tenant="a")
        )
    )
    b = arena(
        StorageConfig(
            namespace=KVCacheNamespace(model_id="m", dtype="bf16", page_size=4, tenant="b")
        )
    )
    assert a.batch_set(["k1", "k2"], [value(1), value(2, 300)]) == [True, True]
    assert b.set("k1", value(3, 50))
    ua, ub = a.usage(), b.usage()
    assert ua["objects"] == ub["objects"] == 3 and ua["used_bytes"] == 1350
    assert (ua["namespace_objects"], ua["namespace_used_bytes"]) == (2, 1300)
    assert (ub["namespace_objects"], ub["namespace_used_bytes"]) == (1, 50)
    assert ua["namespace_limit_bytes"] == 0
    a.clear()
    assert (b.usage()["namespace_objects"], a.usage()["namespace_objects"]) == (1, 0)


def test_a_namespace_quota_holds_a_tenant_to_its_share_of_the_arena(
    arena: Callable[..., MmapBackend],
) -> None:
    """Two tenants in one arena: ``a`` with ``namespace_max_size`` of 4 objects' bytes
    writes 12, one at a time; it never holds more than 4, keeps its newest byte-exact,
    and ``b``'s older objects all survive. A batch larger than the quota stores its
    leading objects only. Another instance of ``a`` counts the same from the shared
    index."""
    from hicache_storage import KVCacheNamespace

    def ns(t: str) -> KVCacheNamespace:
        return KVCacheNamespace(model_id="m", dtype="bf16", page_size=4, tenant=t)

    opts = {"max_size": "4MiB", "slot_size": "64KiB", "reuse_delay": 0}
    b = arena(StorageConfig(namespace=ns("b")), **opts)
    assert b.batch_set([f"k{i}" for i in range(6)], [value(i) for i in range(6)]) == [True] * 6
    a = arena(StorageConfig(namespace=ns("a")), namespace_max_size=4000, **opts)
    for i in range(12):
        assert a.set(f"k{i}", value(100 + i))
        assert a.usage()["namespace_used_bytes"] <= 4000
    kept = [i for i in range(12) if a.exists(f"k{i}")]
    assert 3 <= len(kept) <= 4 and kept == list(range(12 - len(kept), 12))
    assert all(bytes(a.get(f"k{i}").numpy()) == value(100 + i) for i in kept)
    assert all(bytes(b.get(f"k{i}").numpy()) == value(i) for i in range(6))
    u = a.usage()
    assert (u["namespace_objects"], u["namespace_limit_bytes"]) == (len(kept), 4000)
    assert u["objects"] == len(kept) + 6
    assert a.get_stats().evictions == 12 - len(kept)
    again = arena(StorageConfig(namespace=ns("a")), **opts)
    assert again.usage()["namespace_used_bytes"] == u["namespace_used_bytes"]
    # Six objects at once: the four the quota holds are stored, the last two fail.
    got = a.batch_set([f"big{i}" for i in range(6)], [value(i) for i in range(6)])
    assert got == [True] * 4 + [False] * 2
    assert a.usage()["namespace_used_bytes"] == 4000
    assert all(bytes(b.get(f"k{i}").numpy()) == value(i) for i in range(6))


def test_a_quota_counts_this_processs_writes_in_flight(
    arena: Callable[..., MmapBackend],
) -> None:
    """Two batches of one namespace in flight at once (the second checked while the
    first copies): the first holds the quota's room, so the second's objects fail
    rather than take the namespace past it."""
    import threading

    from hicache_storage import KVCacheNamespace

    ns = KVCacheNamespace(model_id="m", dtype="bf16", page_size=4, tenant="a")
    a = arena(StorageConfig(namespace=ns), max_size="4MiB", slot_size="64KiB", reuse_delay=0,
              prefault=False, namespace_max_size=4000)  # fmt: skip
    assert a.set("warm", b"x") and a.delete("warm")  # (the arena exists)
    real = a._slots.reserve_batch
    checked = threading.Barrier(2)

    def slow(*args: Any, **kwargs: Any) -> Any:
        got = real(*args, **kwargs)
        checked.wait(10)  # both batches past the quota check before either commits
        return got

    a._slots.reserve_batch = slow  # type: ignore[method-assign]
    out: dict[str, list[bool]] = {}

    def write(tag: str) -> None:
        out[tag] = a.batch_set([f"{tag}{i}" for i in range(4)], [value(i) for i in range(4)])

    threads = [threading.Thread(target=write, args=(t,)) for t in "xy"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(map(sum, out.values())) == [0, 4]
    assert a.usage()["namespace_used_bytes"] == 4000 and a._slots.quota_in_flight == 0
