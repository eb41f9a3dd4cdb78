"""The ``mmap`` backend under resets, damage, oversized batches, bad pools and other users.

Each test is a regression test for an item of the reliability issue: on the code before
the fix it returned wrong bytes as a hit, raised into the engine, or stalled and evicted
every page.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.backends import MmapBackend
from hicache_storage.conformance.data import make_pool, pool_namespace
from hicache_storage.errors import ConfigError

MiB = 2**20
NOBODY = 65534


def value(i: int, n: int = 1000) -> bytes:
    return bytes([i % 256]) * n


def read(b: MmapBackend, key: str) -> bytes | None:
    got = b.get(key)
    return None if got is None else bytes(got.numpy())


def remove_arena_files(path: Path) -> None:
    for suffix in ("", ".index", ".lock"):
        Path(str(path) + suffix).unlink(missing_ok=True)


# ----------------------------------------------------------------- 1: arena identity


def test_a_leftover_index_is_never_applied_to_a_new_arena(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    """Item 1a: the arena is deleted, its index is left; the new arena starts empty."""
    a = arena(max_size="8MiB", slot_size="64KiB")
    assert a.batch_set([f"k{i}" for i in range(10)], [value(i) for i in range(10)]) == [True] * 10
    a.close()
    (tmp_path / "arena").unlink()
    fresh = arena(max_size="8MiB", slot_size="64KiB")
    for i in range(10):
        assert not fresh.exists(f"k{i}")
        assert fresh.get(f"k{i}") is None  # not ten zero-filled pages served as hits
    assert fresh.set("new", value(7))
    other = arena()
    assert read(other, "new") == value(7)
    assert other.batch_exists([f"k{i}" for i in range(10)]) == 0


def test_a_smaller_new_arena_with_an_old_index_opens(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    """Item 1b: records naming slots the new arena lacks never raise IndexError."""
    a = arena(max_size="16MiB", slot_size="64KiB")
    keys = [f"k{i}" for i in range(200)]
    assert a.batch_set(keys, [value(i) for i in range(200)]) == [True] * 200
    a.close()
    (tmp_path / "arena").unlink()
    small = arena(max_size="1MiB", slot_size="64KiB")
    assert small.batch_exists(keys) == 0
    assert small.set("k1", value(1))
    assert read(small, "k1") == value(1)


def test_a_reset_under_a_running_engine_never_serves_the_new_arenas_pages(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    """Item 1c: the cache is reset (arena, index and lock removed) while engine 1 runs,
    and engine 2 fills a new arena: engine 1 must never map engine 2's index onto its
    old arena (that returned key Y's page as the hit for key X)."""
    one = arena(max_size="4MiB", slot_size="64KiB")
    old = [f"old{i}" for i in range(8)]
    assert one.batch_set(old, [value(i) for i in range(8)]) == [True] * 8
    remove_arena_files(tmp_path / "arena")
    two = arena(max_size="4MiB", slot_size="64KiB")
    new = [f"new{i}" for i in range(8)]
    assert two.batch_set(new, [value(100 + i) for i in range(8)]) == [True] * 8
    for i, key in enumerate(new):
        got = read(one, key)
        assert got is None or got == value(100 + i), f"engine 1 served a wrong page for {key}"
    for i, key in enumerate(old):
        got = read(one, key)
        assert got is None or got == value(i)
    # Engine 1 cannot corrupt engine 2's arena either.
    one.set("from-one", value(55))
    assert two.batch_exists(new) == 8
    assert [read(two, k) for k in new] == [value(100 + i) for i in range(8)]
    got = read(two, "from-one")
    assert got is None or got == value(55)
    assert read(arena(), "new3") == value(103)


# ----------------------------------------------------------------- 2: damaged log


def record_offsets(index: Path, key: str) -> list[int]:
    """Offsets in the log of every record of ``key`` (in the default namespace): the
    position of the last byte of its name, a byte its CRC covers.

    Records are found by their structure (magic, then the name length, then the name), not
    by searching for the key's text: a text search also matched random bytes of other
    fields, or missed a name whose CRC happened to start with the byte it checked.
    """
    from hicache_storage.backends._mmap.log_format import REC, REC_MAGIC
    from hicache_storage.keys import DEFAULT_NAMESPACE, object_name

    name = object_name(DEFAULT_NAMESPACE.digest, key, None).path.encode()
    raw = index.read_bytes()
    out, pos = [], raw.find(name)
    while pos >= 0:
        start = pos - REC.size
        if start >= 0 and raw[start : start + 4] == REC_MAGIC:
            fields = REC.unpack_from(raw, start)
            if fields[3] == len(name):  # the record's name length: this whole name
                out.append(pos + len(name) - 1)
        pos = raw.find(name, pos + 1)
    return out


def flip(index: Path, offset: int) -> None:
    raw = bytearray(index.read_bytes())
    raw[offset] ^= 0xFF
    index.write_bytes(bytes(raw))


def test_a_damaged_record_costs_only_itself(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    """Item 2: one flipped byte in the middle of the log loses that record, not the
    intact ones after it, and the next writer does not cut them off."""
    b = arena(max_size="8MiB", slot_size="64KiB")
    for i in range(6):
        assert b.set(f"k{i}", value(i))
    b.close()
    index = tmp_path / "arena.index"
    (off,) = record_offsets(index, "k2")
    flip(index, off)
    again = arena()
    assert [again.exists(f"k{i}") for i in range(6)] == [True, True, False, True, True, True]
    for i in (0, 1, 3, 4, 5):
        assert read(again, f"k{i}") == value(i)
    assert again.set("after", value(9))  # a writer appends: the records after the damage stay
    third = arena()
    assert [third.exists(f"k{i}") for i in range(6)] == [True, True, False, True, True, True]
    assert read(third, "after") == value(9)
    assert third.get_stats().corrupt_objects >= 0
    for i in range(40):  # the slot of the lost record is reclaimed, the rest stay right
        assert third.set(f"n{i}", value(i))
    for i in (0, 1, 3, 4, 5):
        got = read(third, f"k{i}")
        assert got is None or got == value(i)


def test_a_lost_delete_never_revives_a_key_over_a_reused_slot(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    """Item 2 (the wrong-page case): k0's DEL and the PUT of the key that reused its slot
    are both damaged; a fresh process must not "repair" the slot back to k0 and serve
    the other key's bytes as k0's."""
    b = arena(max_size="1MiB", slot_size="64KiB", reuse_delay=0, low_free_slots=0)
    slots = b.slots_for(1000)
    keys = [f"k{i}" for i in range(slots)]
    assert b.batch_set(keys, [value(i + 1) for i in range(slots)]) == [True] * slots
    assert b.delete("k0")
    assert b.set("reuse", value(99))  # the only reusable slot: k0's
    assert read(b, "reuse") == value(99)
    b.close()
    index = tmp_path / "arena.index"
    _put0, del0 = record_offsets(index, "k0")
    (put_reuse,) = record_offsets(index, "reuse")
    flip(index, del0)
    flip(index, put_reuse)
    fresh = arena()
    got = read(fresh, "k0")
    assert got is None or got == value(1), "another key's page served as k0"
    assert read(fresh, "k1") == value(2)
    other = arena()
    got = read(other, "k0")
    assert got is None or got == value(1)


def test_running_processes_never_serve_wrong_bytes_after_damage(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    """Item 2: a process that read the log before the damage and one that reads it after
    may disagree about the damaged key, but neither serves wrong bytes, ever."""
    a = arena(max_size="1MiB", slot_size="64KiB", reuse_delay=0, low_free_slots=0)
    slots = a.slots_for(1000)
    for i in range(slots):
        assert a.set(f"k{i}", value(i))
    index = tmp_path / "arena.index"
    (off,) = record_offsets(index, "k3")
    flip(index, off)
    b = arena()
    assert not b.exists("k3") and b.exists("k4")
    for i in range(3 * slots):  # b reclaims k3's slot as an orphan, and evicts
        assert b.set(f"b{i}", value(200 + i % 50))
    for i in range(slots):
        got = read(a, f"k{i}")
        assert got is None or got == value(i), f"k{i} served wrong bytes"
    for i in range(3 * slots):
        got = read(a, f"b{i}")
        assert got is None or got == value(200 + i % 50)


def test_a_damaged_log_header_loses_the_index_never_the_arena(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    b = arena(max_size="2MiB", slot_size="64KiB")
    for i in range(5):
        assert b.set(f"k{i}", value(i))
    b.close()
    flip(tmp_path / "arena.index", 12)  # inside the header's arena nonce
    again = arena()
    assert again.batch_exists([f"k{i}" for i in range(5)]) == 0
    for i in range(60):  # orphaned slots are reclaimed, the log is replaced
        assert again.set(f"n{i}", value(i))
    assert read(arena(), "n59") == value(59)


# ----------------------------------------------------------------- 3: oversized batches


def test_a_batch_larger_than_the_arena_stores_what_fits_and_evicts_only_that(
    arena: Callable[..., MmapBackend],
) -> None:
    """Item 3: it used to stall, store nothing and evict every page of every namespace."""
    pool = make_pool(num_pages=64, page_size=4)  # 768-byte pages
    other_ns = KVCacheNamespace(model_id="other", dtype="bfloat16", page_size=4)
    other = arena(StorageConfig(namespace=other_ns), max_size="64KiB", slot_size="4KiB")
    slots = other.slots_for(700)
    assert 4 <= slots < 20
    keep = [f"o{i}" for i in range(slots)]
    assert other.batch_set(keep, [value(i, 700) for i in range(slots)]) == [True] * slots
    mine = arena(StorageConfig(namespace=pool_namespace(pool)))
    mine.register_mem_pool_host(pool)
    n = 3 * slots
    keys = [f"p{i}" for i in range(n)]
    got = mine.batch_set_v1(keys, list(range(n * pool.page_size)))
    stored = sum(got)
    assert got == [True] * stored + [False] * (n - stored), "not a leading run"
    assert 1 <= stored <= slots
    survivors = sum(other.exists(k) for k in keep)
    assert survivors + stored == slots, "evicted pages it did not use"
    assert mine.get_stats().op("batch_set_v1").errors == n - stored


def test_a_batch_that_fits_evicts_only_as_many_pages_as_it_needs(
    arena: Callable[..., MmapBackend],
) -> None:
    b = arena(max_size="256KiB", slot_size="4KiB", reuse_delay=0.01, low_free_slots=0)
    slots = b.slots_for(1000)
    assert b.batch_set([f"o{i}" for i in range(slots)], [value(i) for i in range(slots)]) == (
        [True] * slots
    )
    assert b.batch_set([f"n{i}" for i in range(5)], [value(i) for i in range(5)]) == [True] * 5
    assert sum(b.exists(f"o{i}") for i in range(slots)) == slots - 5


# ----------------------------------------------------------------- 4: pools and slots


def test_a_pool_with_pages_larger_than_the_slots_is_refused(
    arena: Callable[..., MmapBackend],
) -> None:
    pool = make_pool(num_pages=4, page_size=64)  # 12 KiB pages
    ns = pool_namespace(pool)
    b = arena(StorageConfig(namespace=ns), max_size="1MiB", slot_size="4KiB")
    with pytest.raises(ConfigError) as info:
        b.register_mem_pool_host(pool)
    msg = str(info.value)
    assert str(pool.page_bytes) in msg and "4096" in msg and "slot_size" in msg
    assert b.mem_pool_host is None
    # An arena that exists already is checked the same way (slot_size not configured).
    again = arena(StorageConfig(namespace=ns))
    with pytest.raises(ConfigError, match="slot_size"):
        again.register_mem_pool_host(pool)
    ok = arena(StorageConfig(namespace=ns), path=str(Path(b.path).parent / "big"))
    ok.register_mem_pool_host(pool)  # a new arena takes the pool's page size
    assert ok.usage()["slot_size"] >= pool.page_bytes


# ----------------------------------------------------------------- 5: lazy open


def test_a_bad_arena_opened_lazily_gives_failure_shapes(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    """Item 5: engine-facing calls never raise ConfigError for a bad arena file."""
    b = arena()  # no slot_size, no file yet: the arena opens on first use
    (tmp_path / "arena").write_bytes(b"not an arena" * 1000)
    assert b.set("k", b"v") is False
    assert b.batch_set(["a", "b"], [b"1", b"2"]) == [False, False]
    assert b.exists("k") is False
    assert b.get("k") is None
    assert b.batch_exists(["a", "b"]) == 0
    assert b.batch_get(["a"]) == [None]
    stats = b.get_stats()
    assert stats.op("set").errors == 1
    assert stats.op("exists").errors == 1


def test_a_directory_or_fifo_at_the_arena_path_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(ConfigError):
        MmapBackend(StorageConfig(), path=str(tmp_path / "dir"), slot_size="4KiB")
    os.mkfifo(tmp_path / "fifo")
    done: list[BaseException | None] = []

    def open_it() -> None:
        try:
            MmapBackend(StorageConfig(), path=str(tmp_path / "fifo"), slot_size="4KiB")
            done.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            done.append(exc)

    t = threading.Thread(target=open_it, daemon=True)
    t.start()
    t.join(20)
    assert done, "opening a FIFO as the arena blocked"
    assert isinstance(done[0], ConfigError)
    with pytest.raises(ConfigError, match="NUL"):
        MmapBackend(StorageConfig(), path=str(tmp_path / "a\0b"))


# ----------------------------------------------------------------- 6: other users


def as_user(code: str, uid: int = NOBODY) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as another user: the interpreter starts as root (the venv lives in
    root's home), imports, then drops to ``uid`` for good before running ``code``."""
    prelude = textwrap.dedent(
        f"""
        import os
        import numpy, torch  # what the backend imports lazily, before the stdlib is out of reach
        from hicache_storage import StorageConfig
        from hicache_storage.backends import MmapBackend
        os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); os.setresuid({uid}, {uid}, {uid})
        """
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
    )


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A sticky world-writable directory right under /tmp, like /tmp itself (pytest's
    own temporary directories are private, so another user could not reach it)."""
    d = Path(f"/tmp/hicache-test-{uuid.uuid4().hex[:8]}")
    d.mkdir()
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("planted", ["arena", "arena.index"])
def test_files_another_user_planted_are_refused(shared_tmp: Path, planted: str) -> None:
    """Item 6: another user pre-creates the arena (to read every page written to it) or
    its index; the backend refuses with a ConfigError naming the path."""
    target = shared_tmp / planted
    r = as_user(
        f"""
        if {planted!r} == "arena":
            b = MmapBackend(StorageConfig(), path={str(shared_tmp / "arena")!r},
                            max_size="1MiB", slot_size="4KiB")
            b.close()
            os.chmod({str(shared_tmp / "arena")!r}, 0o666)
        else:
            fd = os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY, 0o666)
            os.fchmod(fd, 0o666)
            os.close(fd)
        """
    )
    assert r.returncode == 0, r.stderr
    assert target.stat().st_uid == NOBODY
    with pytest.raises(ConfigError) as info:
        b = MmapBackend(StorageConfig(), path=str(shared_tmp / "arena"), slot_size="4KiB")
        b.set("k", b"secret page")  # the index is opened with the arena
        b.close()
    assert str(target) in str(info.value)


def test_the_default_location_is_private_to_the_user() -> None:
    b = MmapBackend(StorageConfig(), max_size="1MiB", slot_size="4KiB")
    try:
        directory = os.path.dirname(b.path)
        assert directory == f"/tmp/hicache-storage-mmap-{os.geteuid()}"
        st = os.lstat(directory)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == 0o700
        for suffix in ("", ".index"):
            fst = os.stat(b.path + suffix)
            assert fst.st_uid == os.geteuid() and not fst.st_mode & 0o077
    finally:
        b.clear()
        b.close()


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(ConfigError, match="writable by other users"):
        MmapBackend(StorageConfig(), path=str(d / "arena"), slot_size="4KiB")


# ----------------------------------------------------------------- 14: rate-limited warnings


def test_corrupt_reads_warn_rate_limited(
    arena: Callable[..., MmapBackend], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 14: 100 reads of corrupt pages give one warning (and a count), not 100. Each
    damaged key is deleted by its first read: it no longer counts in exists, and can be
    stored again."""
    b = arena(max_size="1MiB", slot_size="64KiB", checksum="xxh3", verify_checksum=True)
    keys = [f"k{i}" for i in range(100)]
    assert b.batch_set(keys, [value(i) for i in range(100)]) == [True] * 100
    arena_ = b._arena
    assert arena_ is not None
    with open(tmp_path / "arena", "r+b") as f:
        for k in keys:
            entry = b._log.entry(b.object_path(k))
            assert entry is not None
            f.seek(arena_.data_off + entry.slot * arena_.unit + 10)
            f.write(b"\xff")
    reader = arena(checksum="xxh3", verify_checksum=True)
    with caplog.at_level("WARNING"):
        for k in keys:
            assert reader.get(k) is None
    warnings = [r for r in caplog.records if "checksum mismatch" in r.getMessage()]
    assert len(warnings) == 1
    assert reader.get_stats().corrupt_objects == 100
    assert reader.batch_exists(keys) == 0 and b.batch_exists(keys) == 0
    assert b.set("k3", value(3))
    assert read(reader, "k3") == value(3)


# ----------------------------------------------------------------- the second attack


def test_writers_opened_before_and_after_a_lock_file_removal_share_one_lock(
    arena: Callable[..., MmapBackend], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers lock the arena file itself: removing a file beside it (the lock file of
    earlier releases, removed by a /tmp cleaner) can never give two instances two lock
    domains, in which one took the other's in-flight slot as a dead writer's and the
    late copy landed in its page."""
    import hicache_storage.backends._mmap.backend as mm  # where copy_in is looked up

    a = arena(max_size="1MiB", slot_size="64KiB", reuse_delay=0, low_free_slots=0)
    n = a.usage()["slabs"]  # one 64 KiB page a slab
    assert a.batch_set([f"f{i}" for i in range(n - 1)], [value(i, 65536) for i in range(n - 1)])
    (tmp_path / "arena.lock").unlink(missing_ok=True)  # the lock file of earlier releases
    b = arena(reuse_delay=0, low_free_slots=0)
    paused, go = threading.Event(), threading.Event()
    real = mm.copy_in  # type: ignore[attr-defined]  # patched where the backend calls it

    def copy_in(arena_: object, slot: int, views: list, ptrs: object) -> None:
        if threading.current_thread().name == "a-writer":
            paused.set()
            go.wait(10)
        real(arena_, slot, views, ptrs)  # type: ignore[arg-type]

    monkeypatch.setattr(mm, "copy_in", copy_in)
    t = threading.Thread(target=lambda: a.set("X", value(0x58, 65536)), name="a-writer")
    t.start()
    assert paused.wait(10)
    b.set("Y", value(0x59, 65536))  # may fail (the only free slot is being written)
    go.set()
    t.join(10)
    for reader in (b, arena()):
        got = read(reader, "Y")
        assert got is None or got == value(0x59, 65536), "a page copied over another's"


def test_reused_generations_never_match_a_readers_stale_entry(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    """The slot table is zeroed in place; a new write must not recreate a (slot,
    generation) pair a running reader still holds for another key."""
    w = arena(max_size="1MiB", slot_size="64KiB", reuse_delay=0)
    r = arena(reuse_delay=0)
    assert w.set("A", value(0x41, 4096))
    assert read(r, "A") == value(0x41, 4096)  # r holds A's entry
    assert w.delete("A")  # r has not read the DEL yet
    arena_ = w._arena
    assert arena_ is not None
    with open(tmp_path / "arena", "r+b") as f:
        f.seek(arena_.table_off)
        f.write(bytes(arena_.data_off - arena_.table_off))
    fresh = arena(reuse_delay=0)
    assert fresh.set("B", value(0x42, 4096))
    got = read(r, "A")
    assert got is None or got == value(0x41, 4096), "B's page served as A"


def test_a_slab_table_that_disagrees_with_the_log_drops_the_keys_it_misplaces(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    """The slab table rolled back (a power loss, an old image): a slab the log filled with
    4 KiB slots now says 8 KiB. Its keys are dropped when the arena opens; kept, the odd
    ones (no 8 KiB slot starts there, so no writer renews their generation) would serve
    bytes of the 8 KiB pages written over them."""
    import struct

    w = arena(max_size="1MiB", slot_size="64KiB", reuse_delay=0, low_free_slots=0)
    keys = [f"k{i}" for i in range(16)]  # one slab of 16 slots of 4 KiB
    assert w.batch_set(keys, [value(i, 4000) for i in range(16)]) == [True] * 16
    assert w._arena is not None
    slab = w._log.entry(w.object_path("k1")).slot // w._arena.units  # type: ignore[union-attr]
    where = w._arena.slab_off + 4 * slab
    w.close()
    with open(tmp_path / "arena", "r+b") as f:
        f.seek(where)
        assert struct.unpack("<I", f.read(4)) == (1,)
        f.seek(where)
        f.write(struct.pack("<I", 2))
    b = arena(reuse_delay=0, low_free_slots=0)
    assert b.batch_exists(keys) == 0
    n = b.slots_for(8000)
    assert b.batch_set([f"e{i}" for i in range(n)], [value(200, 8000)] * n) == [True] * n
    for reader in (b, arena()):
        for i, k in enumerate(keys):
            got = read(reader, k)
            assert got is None or got == value(i, 4000), f"{k} served another page's bytes"


def test_slab_table_entries_no_class_has_are_cut_again(
    arena: Callable[..., MmapBackend],
) -> None:
    """Damaged slab-table entries (larger than a slab): their keys are dropped, the slabs
    are cut again for new pages (no huge per-class table is built from the values)."""
    w = arena(max_size="2MiB", slot_size="64KiB", reuse_delay=0, low_free_slots=0)
    assert w.set("a", value(1, 5000))
    assert w._arena is not None
    w._arena.slabs[:] = 0xFFFFFFFF
    w.close()
    b = arena(reuse_delay=0, low_free_slots=0)
    assert b.get("a") is None
    keys = [f"k{i}" for i in range(40)]
    assert b.batch_set(keys, [value(i, 5000) for i in range(40)]) == [True] * 40
    assert [read(b, k) for k in keys] == [value(i, 5000) for i in range(40)]


def test_zeroed_slots_are_never_served_as_hits(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    """Table and data zeroed (a lost write-back without fsync, a restored image): the log
    still names the key, but nothing proves the bytes are its: a miss, not zeros."""
    w = arena(max_size="1MiB", slot_size="64KiB")
    assert w.set("K", value(0x4B, 4096))
    w.close()
    size = (tmp_path / "arena").stat().st_size
    with open(tmp_path / "arena", "r+b") as f:
        f.seek(4096)
        f.write(bytes(size - 4096))
    assert arena().get("K") is None


def test_an_interrupted_batch_waits_for_its_copies_before_giving_slots_back(
    arena: Callable[..., MmapBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """KeyboardInterrupt in the calling thread mid-batch: the slots are released only
    after the I/O threads stop copying into them, so no later page is overwritten."""

    import torch

    import hicache_storage.backends._mmap.backend as mm  # where copy_in is looked up

    # Pages of 192 KiB: a batch of pages that large is copied on the I/O threads.
    pool = make_pool(num_pages=32, page_size=4, head_dim=2048)
    assert pool.page_bytes >= 64 << 10
    a = arena(StorageConfig(namespace=pool_namespace(pool)), max_size="8MiB", slot_size="256KiB",
              max_concurrency=2, reuse_delay=0)  # fmt: skip
    a.register_mem_pool_host(pool)
    b = arena(max_concurrency=1, reuse_delay=0)
    real = mm.copy_in  # type: ignore[attr-defined]  # patched where the backend calls it

    def slow(arena_: object, slot: int, views: list, ptrs: object) -> None:
        if threading.current_thread().name.startswith("hicache-mmap"):
            time.sleep(0.3)
        real(arena_, slot, views, ptrs)  # type: ignore[arg-type]

    from hicache_storage.storekit import iopool

    real_wait = iopool.wait  # type: ignore[attr-defined]
    interrupted: list[bool] = []

    def interrupted_wait(futures: Any, *args: Any, **kwargs: Any) -> Any:
        # A SIGINT in the middle of the wait, made deterministic: a real one (os.kill)
        # reaches whichever thread the kernel picks, and a main thread asleep on a lock
        # may only see it once the copies are over.
        if not interrupted:
            interrupted.append(True)
            time.sleep(0.1)
            raise KeyboardInterrupt
        return real_wait(futures, *args, **kwargs)

    monkeypatch.setattr(mm, "copy_in", slow)
    monkeypatch.setattr(iopool, "wait", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        a.batch_set_v1([f"p{i}" for i in range(12)], torch.arange(12 * 4))
    assert interrupted
    monkeypatch.setattr(iopool, "wait", real_wait)
    monkeypatch.setattr(mm, "copy_in", real)
    assert b.batch_set([f"y{i}" for i in range(12)], [b"\x59" * 768] * 12) == [True] * 12
    time.sleep(1)  # any copy still running would land now
    for i in range(12):
        assert read(b, f"y{i}") == b"\x59" * 768


@pytest.mark.parametrize("planted", ["fifo", "directory", "group-writable"])
def test_a_bad_index_under_a_running_instance_gives_failure_shapes_then_recovers(
    arena: Callable[..., MmapBackend], tmp_path: Path, planted: str
) -> None:
    b = arena(max_size="1MiB", slot_size="64KiB")
    assert b.set("k1", value(1))
    index = tmp_path / "arena.index"
    index.unlink()
    if planted == "fifo":
        os.mkfifo(index, 0o600)
    elif planted == "directory":
        index.mkdir()
    else:
        index.write_bytes(b"")
        os.chmod(index, 0o664)
    assert b.exists("x") is False  # not ConfigError into the engine
    assert b.get("x") is None
    assert b.batch_exists(["x"]) == 0
    assert b.set("k2", value(2)) is False
    if planted == "directory":
        index.rmdir()
    else:
        index.unlink()
    assert b.set("n0", value(3))  # recovers: a new log for this arena
    assert read(b, "n0") == value(3)
    assert read(arena(), "n0") == value(3)


def test_a_dead_writer_holding_every_slot_does_not_stop_all_writes(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    import signal

    child = textwrap.dedent(
        f"""
        import sys, time, torch
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from hicache_storage.conformance.data import make_pool, pool_namespace
        from hicache_storage import StorageConfig
        from hicache_storage.backends import MmapBackend
        import hicache_storage.backends._mmap.backend as M  # where copy_in is looked up
        pool = make_pool(num_pages=64, page_size=4)
        b = MmapBackend(StorageConfig(namespace=pool_namespace(pool)),
                        path={str(tmp_path / "arena")!r}, max_size="256KiB", slot_size="4KiB",
                        reuse_delay=0)
        b.register_mem_pool_host(pool)
        n = b.slots_for(pool.page_bytes)
        def stuck(*args):
            print("copying", flush=True)
            time.sleep(120)
        M.copy_in = stuck
        b.batch_set_v1([f"p{{i}}" for i in range(n)], torch.arange(n * 4))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        # Two I/O threads print at once: their lines may interleave ("copyingcopying").
        assert proc.stdout.readline().startswith("copying")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()  # type: ignore[union-attr]
    b = arena(reuse_delay=0)
    assert b.set("x", value(1)) is True
    assert b.batch_set(["y1", "y2"], [value(2), value(3)]) == [True, True]
    assert read(arena(), "y2") == value(3)


def test_a_clock_stepped_back_does_not_keep_retired_slots_out_of_use(
    arena: Callable[..., MmapBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = arena(max_size="1MiB", slot_size="64KiB", reuse_delay=0.05)
    n = a.slots_for(1000)
    assert a.batch_set([f"k{i}" for i in range(n)], [value(i) for i in range(n)]) == [True] * n
    for i in range(n - 2):
        assert a.delete(f"k{i}")
    a.close()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3600)
    b = arena(max_size="1MiB", slot_size="64KiB", reuse_delay=0.05)
    assert [b.set(f"new{i}", value(i)) for i in range(3)] == [True] * 3


def test_a_log_rewritten_in_place_is_reread_not_cut(
    arena: Callable[..., MmapBackend], tmp_path: Path
) -> None:
    w = arena(max_size="4MiB", slot_size="64KiB")
    assert w.set("k1", value(1)) and w.set("k2", value(2))
    index = tmp_path / "arena.index"
    os.truncate(index, index.stat().st_size - 50)  # in place: the same inode
    f = arena()
    assert f.set("kkk3", value(3))
    assert w.exists("kkk3")  # w notices the rewrite and reads the log again
    assert w.set("k4", value(4))  # and never cuts f's record as a torn tail
    for b in (f, arena()):
        assert read(b, "kkk3") == value(3)
        assert read(b, "k4") == value(4)


def test_failed_constructors_leak_no_descriptors(tmp_path: Path) -> None:
    bad = tmp_path / "arena"
    bad.write_bytes(b"garbage" * 1000)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with pytest.raises(ConfigError):
            MmapBackend(StorageConfig(), path=str(bad))
    good = tmp_path / "good"
    MmapBackend(StorageConfig(), path=str(good), max_size="1MiB", slot_size="4KiB").close()
    index = tmp_path / "good.index"
    os.chmod(index, 0o664)
    for _ in range(50):
        with pytest.raises(ConfigError):
            MmapBackend(StorageConfig(), path=str(good))
    assert len(os.listdir("/proc/self/fd")) <= before + 2


def test_duplicate_keys_in_a_batch_take_one_slot(arena: Callable[..., MmapBackend]) -> None:
    pool = make_pool(num_pages=8, page_size=4)
    b = arena(StorageConfig(namespace=pool_namespace(pool)), max_size="1MiB", slot_size="4KiB")
    b.register_mem_pool_host(pool)
    assert b.batch_set_v1(["d", "d", "d", "d"], list(range(16))) == [True] * 4
    arena_ = b._arena
    assert arena_ is not None
    assert int((arena_.slots["state"] == 2).sum()) == 1  # one COMMITTED row, no leaks
    assert b.usage()["objects"] == 1
