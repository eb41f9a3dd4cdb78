"""The hot paths' fast loops keep every rule of the slow ones.

``file``/``shm`` ``batch_exists`` checks a private store's trust rule inline, ``mmap``
``batch_exists`` checks the leading run against the slot table in one read, and the
native ``batch_set`` forms write a batch at once: each is checked here against what the
per-key path does, on the inputs where a shortcut would go wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import KVCacheNamespace, StorageConfig, page_hashes
from hicache_storage.backends import FileBackend, MmapBackend

NS = KVCacheNamespace(model_id="hot-paths-test", dtype="uint8", page_size=4)


def values(n: int, size: int = 64) -> list[torch.Tensor]:
    return [torch.full((size,), (i + 1) % 256, dtype=torch.uint8) for i in range(n)]


def keys_of(n: int, seed: int = 0) -> list[str]:
    return page_hashes(list(range(seed, seed + 4 * n)), 4)


@pytest.fixture
def file_backend(tmp_path: Path) -> Iterator[FileBackend]:
    b = FileBackend(StorageConfig(namespace=NS), root=str(tmp_path / "kv"))
    yield b
    b.close()


def path_of(b: FileBackend, key: str) -> str:
    return b._path(b.object_name(key))


@pytest.mark.parametrize("plant", ["symlink", "world-writable", "directory", "other-owner"])
def test_file_batch_exists_stops_at_an_untrusted_object_mid_batch(
    file_backend: FileBackend, plant: str
) -> None:
    """The inline check (a regular file of ours, writable by nobody else) must send
    anything else to the full check: counted, a miss, the run stops there."""
    b = file_backend
    keys = keys_of(6)
    assert b.batch_set(keys, values(6)) == [True] * 6
    assert b.batch_exists(keys) == 6
    victim = path_of(b, keys[3])
    if plant == "symlink":  # pointing at another key's perfectly good page
        os.unlink(victim)
        os.symlink(path_of(b, keys[0]), victim)
    elif plant == "world-writable":
        os.chmod(victim, 0o666)
    elif plant == "directory":
        os.unlink(victim)
        os.mkdir(victim)
    else:
        if os.geteuid() != 0:
            pytest.fail("this check needs root (to give a file away); CI runs as root")
        os.chown(victim, 54321, 54321)
    assert b.batch_exists(keys) == 3
    assert b.exists(keys[3]) is False
    assert b.get_stats().corrupt_objects >= 1


def test_file_batch_exists_fast_loop_matches_exists_key_by_key(
    file_backend: FileBackend,
) -> None:
    b = file_backend
    keys = keys_of(40)
    stored = set(range(0, 40, 3)) | set(range(10))
    for i in sorted(stored):
        assert b.set(keys[i], values(1)[0]) is True
    leading = next(i for i in range(40) if i not in stored)
    assert b.batch_exists(keys) == leading == 10
    assert [b.exists(k) for k in keys] == [i in stored for i in range(40)]


def test_file_batch_set_writes_a_repeated_key_once_with_its_first_value(
    file_backend: FileBackend,
) -> None:
    """The batch runs on the I/O threads; a key twice must still keep its first value,
    as the serial per-key loop does (first writer wins), every time."""
    b = file_backend
    for round_ in range(8):
        key = keys_of(1, seed=100 + round_)[0]
        first, second = values(2, size=128 << 10)  # large: the batch runs on the I/O threads
        assert b.batch_set([key, key], [first, second]) == [True, True]
        got = b.get(key)
        assert got is not None and torch.equal(got, first), round_


def test_file_batch_set_refuses_a_bad_value_before_writing_anything(
    file_backend: FileBackend,
) -> None:
    from hicache_storage.errors import InvalidTypeError

    b = file_backend
    keys = keys_of(3, seed=7)
    with pytest.raises(InvalidTypeError):
        b.batch_set(keys, [values(1)[0], 5, values(1)[0]])
    assert b.batch_exists(keys) == 0


@pytest.fixture
def mmap_backend(tmp_path: Path) -> Iterator[MmapBackend]:
    b = MmapBackend(StorageConfig(namespace=NS), path=str(tmp_path / "arena"),
                    max_size="8MiB", slot_size="4KiB", prefault=False)  # fmt: skip
    yield b
    b.close()


def test_mmap_batch_set_keeps_the_first_value_that_fits(mmap_backend: MmapBackend) -> None:
    """``[k, k]`` with an oversized first value: the first fails, the second is stored,
    as the per-key loop does."""
    b = mmap_backend
    key = keys_of(1, seed=3)[0]
    big = torch.ones(5000, dtype=torch.uint8)
    small = torch.full((10,), 7, dtype=torch.uint8)
    assert b.batch_set([key, key], [big, small]) == [False, True]
    got = b.get(key)
    assert got is not None and torch.equal(got, small)
    other = keys_of(1, seed=9)[0]
    assert b.batch_set([other, other], [small, big]) == [True, False]


def test_mmap_batch_exists_sees_another_instances_writes(tmp_path: Path) -> None:
    """The vectorized check vouches only for what this instance's index holds; a page
    another instance (another process, in production) stored since is found through the
    log catch-up, as before."""
    path = str(tmp_path / "arena")
    a = MmapBackend(StorageConfig(namespace=NS), path=path, max_size="8MiB",
                    slot_size="4KiB", prefault=False)  # fmt: skip
    b = MmapBackend(StorageConfig(namespace=NS), path=path, max_size="8MiB",
                    slot_size="4KiB", prefault=False)  # fmt: skip
    try:
        keys = keys_of(6, seed=20)
        assert a.batch_set(keys[:3], values(3)) == [True] * 3
        assert b.batch_exists(keys) == 3
        assert a.batch_set(keys[3:], values(3)) == [True] * 3
        assert b.batch_exists(keys) == 6  # b's index catches up from the log
        assert a.delete(keys[1]) is True
        assert b.batch_exists(keys) == 1  # the slot table says the entry is gone
    finally:
        a.close()
        b.close()
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_file_clear_hides_the_namespace_at_once_and_deletes_its_files_later(
    file_backend: FileBackend,
) -> None:
    """clear() renames the namespace away (every reader misses at once) and deletes the
    files on a background thread; the directory is gone in the end, the store usable."""
    b = file_backend
    keys = keys_of(300, seed=50)
    assert all(b.batch_set(keys, values(300, size=16)))
    b.clear()
    assert b.batch_exists(keys) == 0
    assert all(b.get(k) is None for k in keys[:5])
    assert b.set(keys[0], values(1)[0]) is True  # usable at once
    root = b.root
    deadline = time.monotonic() + 60
    while any(n.startswith(".trash.") for n in os.listdir(root)):
        assert time.monotonic() < deadline, "the cleared files were never deleted"
        time.sleep(0.05)
    assert b.batch_exists(keys[:1]) == 1


# --------------------------------------------------------------------------- start-up scan


def capped(root: Path) -> FileBackend:
    b = FileBackend(StorageConfig(namespace=NS), root=str(root), max_size="1GiB")
    b.snapshot_min_objects = 0  # the tests' stores are small
    return b


def age_directories(root: Path, seconds: float = 30) -> None:
    """Make every directory look quiet (changed long ago), as in a store at rest."""
    past = time.time() - seconds
    for dirpath, _, _ in os.walk(root):
        os.utime(dirpath, (past, past))


def test_reopening_from_the_snapshot_accounts_exactly_what_is_there(tmp_path: Path) -> None:
    """The second instance takes quiet directories from the first one's snapshot and
    scans the rest: whatever changed after the snapshot (another writer, a deletion, a
    crash with no snapshot written) is accounted as a full scan would."""
    root = tmp_path / "kv"
    a = capped(root)
    keys = keys_of(200, seed=300)
    assert all(a.batch_set(keys, values(200, size=100)))
    a.close()  # no directory was quiet at the last scan: a snapshot of nothing
    age_directories(root)
    b = capped(root)  # scans everything; directories are quiet now
    full = b.usage()
    assert full["objects"] == 200
    b.close()  # leaves the snapshot
    snapshots = [n for n in os.listdir(root) if n.startswith(".hicache-scan.")]
    assert len(snapshots) == 1
    real_scandir, scanned = os.scandir, []

    def counting(path: Any = ".") -> Any:
        scanned.append(str(path))
        return real_scandir(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "scandir", counting)
        c = capped(root)
    fan_dirs = [p for p in scanned if os.path.relpath(p, root).count("/") == 1]
    assert fan_dirs == []  # every quiet directory came from the snapshot
    assert c.usage() == full
    c.close()
    # Changes behind the snapshot's back: one page deleted, two stored by another instance
    # of another process's kind (no snapshot update), then a reopen.
    os.unlink(path_of(c, keys[5]))
    other = capped(root)
    extra = keys_of(2, seed=900)
    assert all(other.batch_set(extra, values(2, size=300)))
    del other  # "killed": no close, so no snapshot of its own
    d = capped(root)
    fresh = d.usage()
    d._scanner.quiet.clear()
    d._scanner.cache = {}
    d._tracker.clear()
    d._tracker.load(d._scanner.scan())
    assert fresh == d.usage()
    assert fresh["objects"] == 201
    d.close()


@pytest.mark.parametrize(
    "damage",
    ["garbage", "escaping name", "hidden name", "bad size", "bad directory index",
     "count mismatch", "listed twice", "another shard's", "another scope", "deeply nested",
     "world-writable"],
)  # fmt: skip
def test_a_damaged_or_untrusted_snapshot_is_ignored(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "kv"
    a = capped(root)
    keys = keys_of(20, seed=400)
    assert all(a.batch_set(keys, values(20)))
    a.close()
    age_directories(root)
    b = capped(root)
    full = b.usage()
    b.close()
    (snap,) = [root / n for n in os.listdir(root) if n.startswith(".hicache-scan.")]
    text = snap.read_text()
    data = json.loads(text)
    leaves = data["leaves"].split("\n")
    assert len(leaves) == len(data["sizes"]) == len(data["dir_of"]) == 20
    if damage == "garbage":
        snap.write_text(text[: len(text) // 2])
    elif damage in ("escaping name", "hidden name"):
        # never unlinked outside its directory, nor a temporary or another hidden file
        leaves[0] = "../../../x" if damage == "escaping name" else ".hicache-tmp-1"
        data["leaves"] = "\n".join(leaves)
        snap.write_text(json.dumps(data))
    elif damage == "bad size":
        data["sizes"][0] = "112"
        snap.write_text(json.dumps(data))
    elif damage == "bad directory index":
        data["dir_of"][0] = len(data["dirs"])
        snap.write_text(json.dumps(data))
    elif damage == "count mismatch":
        data["sizes"].append(1)
        snap.write_text(json.dumps(data))
    elif damage == "listed twice":
        data["leaves"] += "\n" + leaves[0]
        data["dir_of"].append(data["dir_of"][0])
        data["sizes"].append(10_000)
        snap.write_text(json.dumps(data))
    elif damage == "another shard's":
        data["leaves"] = "\n".join(leaf + "~7" for leaf in leaves)
        snap.write_text(json.dumps(data))
    elif damage == "another scope":
        data["scope"] = "root"
        snap.write_text(json.dumps(data))
    elif damage == "deeply nested":
        snap.write_text("[" * 200_000 + "]" * 200_000)
    else:
        os.chmod(snap, 0o666)
    assert snap.read_text() != text or damage == "world-writable"
    c = capped(root)
    assert c.usage()["objects"] == 20  # as a full scan finds
    tracked = {n for n, _ in c._tracker.items_oldest_first()}
    assert tracked == {os.path.relpath(path_of(c, k), root) for k in keys}
    assert c.usage() == full
    assert c.batch_exists(keys) == 20
    c.close()


def test_shm_ignores_a_snapshot_that_lists_an_object_twice(tmp_path: Path) -> None:
    """shm (one cap for the root) loads through its re-scan, not the file store's
    ordered load: a name listed twice must still make the snapshot ignored, never
    count a made-up size."""
    from hicache_storage.backends import ShmBackend

    root = Path(tempfile.mkdtemp(prefix="hot-shm-", dir="/dev/shm")) / "kv"

    def shm() -> ShmBackend:
        b = ShmBackend(StorageConfig(namespace=NS), root=str(root), max_size="64MiB")
        b.snapshot_min_objects = 0
        return b

    try:
        a = shm()
        keys = keys_of(20, seed=700)
        assert all(a.batch_set(keys, values(20)))
        a.close()
        age_directories(root)
        b = shm()
        full = b.usage()
        b.close()
        (snap,) = [root / n for n in os.listdir(root) if n.startswith(".hicache-scan.")]
        data = json.loads(snap.read_text())
        leaves = data["leaves"].split("\n")
        data["leaves"] += "\n" + leaves[0]
        data["dir_of"].append(data["dir_of"][0])
        data["sizes"].append(10_000)
        snap.write_text(json.dumps(data))
        c = shm()
        assert c.usage() == full
        assert c.batch_exists(keys) == 20
        c.close()
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


def test_a_write_right_after_clear_waits_for_the_space_clear_frees(
    small_tmpfs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """clear() returns before its files are deleted; a write that needs their space must
    not be refused meanwhile (the floor would see a full disk): it waits for them."""
    import hicache_storage.storekit.filestore as fs

    real_rmtree = shutil.rmtree

    def slow_rmtree(path: str, ignore_errors: bool = False) -> None:
        time.sleep(0.5)  # a large namespace: the deletion is still running
        real_rmtree(path, ignore_errors=ignore_errors)

    b = FileBackend(StorageConfig(namespace=NS), root=os.path.join(small_tmpfs, "kv"),
                    min_free_space="256KiB")  # fmt: skip
    try:
        keys = keys_of(300, seed=600)
        assert all(b.batch_set(keys, values(300, size=4096)))  # about 1.2 MiB of 2 MiB
        monkeypatch.setattr(fs.shutil, "rmtree", slow_rmtree)  # type: ignore[attr-defined]
        b.clear()
        big = keys_of(1, seed=999)[0]
        assert b.set(big, torch.ones(1 << 20, dtype=torch.uint8)) is True
    finally:
        b.close()


def test_an_interrupted_snapshot_write_leaves_no_temporary(tmp_path: Path) -> None:
    from hicache_storage.storekit.atomic import temp_path

    root = tmp_path / "kv"
    capped(root).close()
    leftover = temp_path(str(root))  # as _save_snapshot names its temporary
    Path(leftover).write_bytes(b"{")
    past = time.time() - 7200
    os.utime(leftover, (past, past))
    b = FileBackend(StorageConfig(namespace=NS), root=str(root), stale_temp_age=60)
    assert not os.path.exists(leftover)
    b.close()


def test_delete_of_a_key_that_is_not_a_string_is_a_typed_error(
    file_backend: FileBackend,
) -> None:
    from hicache_storage.errors import InvalidKeyError

    with pytest.raises(InvalidKeyError):
        file_backend.delete(1)  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError):
        file_backend.object_path(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["file", "mmap"])
def test_batch_exists_names_no_key_past_the_first_miss(tmp_path: Path, kind: str) -> None:
    """A prompt whose pages were never asked about misses early: keys well past the
    first miss are not named (validated, hashed, remembered), and keys this instance
    never named are still found when another instance stored them."""

    def make() -> Any:
        if kind == "file":
            return FileBackend(StorageConfig(namespace=NS), root=str(tmp_path / "kv"))
        return MmapBackend(StorageConfig(namespace=NS), path=str(tmp_path / "arena"),
                           max_size="8MiB", slot_size="4KiB", prefault=False)  # fmt: skip

    writer, reader = make(), make()
    try:
        keys = keys_of(40, seed=50)
        assert writer.batch_set(keys[:10], values(10)) == [True] * 10
        ask = [*keys[:5], keys[30], *keys[5:30]]  # stored x5, a miss, then 25 more
        assert reader.batch_exists(ask) == 5
        namer = reader.object_namer()
        assert namer.known_paths(ask[:6]) == [namer.path(k) for k in ask[:6]]
        assert namer.known_paths(ask[20:]) == [None] * 11  # never named (16 at a time)
        assert reader.batch_exists(ask[6:]) == 5  # keys[5:10]: named and found
        # Named now by another call, found by the fast pass: the same answers.
        assert reader.batch_exists(keys[:10]) == 10
        assert reader.batch_exists(keys[:12]) == 10
        assert writer.delete(keys[2]) is True
        assert reader.batch_exists(keys[:10]) == 2
    finally:
        writer.close()
        reader.close()


QUICK_PLANTS = [
    "symlink", "world-writable", "directory", "other-owner", "fifo",
    "flipped-byte", "swapped", "truncated", "newer-version", "wrong-size",
]  # fmt: skip


@pytest.mark.parametrize("plant", QUICK_PLANTS)
def test_file_quick_reads_send_every_unusual_object_to_the_careful_path(
    file_backend: FileBackend, plant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads into given targets take a short path (open, fstat, one preadv, checks).

    Each object planted here must still be a miss, counted where it is damage, and the
    others of the batch hits; the good ones must have gone the short way (else this test
    would test nothing)."""
    b = file_backend
    keys = keys_of(5)
    assert b.batch_set(keys, values(5)) == [True] * 5
    victim = path_of(b, keys[2])
    if plant == "symlink":  # to another key's good page of the same size
        os.unlink(victim)
        os.symlink(path_of(b, keys[0]), victim)
    elif plant == "world-writable":
        os.chmod(victim, 0o666)
    elif plant == "directory":
        os.unlink(victim)
        os.mkdir(victim)
    elif plant == "other-owner":
        if os.geteuid() != 0:
            pytest.fail("this check needs root (to give a file away); CI runs as root")
        os.chown(victim, 54321, 54321)
    elif plant == "fifo":
        os.unlink(victim)
        os.mkfifo(victim, 0o600)
    elif plant == "flipped-byte":
        with open(victim, "r+b") as f:
            f.seek(7)
            byte = f.read(1)
            f.seek(7)
            f.write(bytes([byte[0] ^ 1]))
    elif plant == "swapped":  # another key's intact object, renamed over this one
        os.replace(path_of(b, keys[4]), victim)
    elif plant == "truncated":
        os.truncate(victim, os.path.getsize(victim) - 1)
    elif plant == "newer-version":  # a well-formed trailer of a later format version
        import zlib

        from hicache_storage.storekit import header as h

        with open(victim, "r+b") as f:
            f.seek(-h.HEADER_SIZE, os.SEEK_END)
            fields = list(h._FMT.unpack(f.read(h._FMT.size)))
            fields[1] = h.VERSION + 1
            head = h._FMT.pack(*fields)
            f.seek(-h.HEADER_SIZE, os.SEEK_END)
            f.write(head + h._TAIL.pack(zlib.crc32(head), 0))
    used: list[bool | None] = []
    quick = b._read_quick

    def spy(name: Any, views: Any) -> bool | None:
        used.append(quick(name, views))
        return used[-1]

    monkeypatch.setattr(b, "_read_quick", spy)
    want = values(5)
    size = 63 if plant == "wrong-size" else 64
    targets = [torch.zeros(64, dtype=torch.uint8) for _ in range(5)]
    targets[2] = torch.zeros(size, dtype=torch.uint8)
    before = b.get_stats()
    got = b.batch_get(keys, targets)
    assert got[2] is None
    for i in (0, 1, 3) + (() if plant == "swapped" else (4,)):
        assert got[i] is targets[i] and torch.equal(targets[i], want[i])
    assert used.count(True) == (3 if plant == "swapped" else 4)  # the good ones: short way
    stats = b.get_stats()
    if plant == "wrong-size":
        assert stats.size_mismatches == before.size_mismatches + 1
        assert os.path.exists(victim)  # a size the caller got wrong is no damage
    elif plant == "truncated":  # (its size no longer matches the target's: told apart)
        assert stats.size_mismatches == before.size_mismatches + 1
    elif plant == "newer-version":
        assert stats.corrupt_objects == before.corrupt_objects
        assert os.path.exists(victim)  # kept for the newer release that wrote it
    else:
        assert stats.corrupt_objects >= before.corrupt_objects + 1
    if plant == "symlink":  # the link's target is untouched and still served
        assert torch.equal(b.get(keys[0]), want[0])
