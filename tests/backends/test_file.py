"""The ``file`` backend against a real filesystem: the conformance kit first (the same
checks vendors run), then semantics, zero-copy, faults and capacity."""

from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import HiCacheStorage, KVCacheNamespace, StorageConfig, page_hashes
from hicache_storage.backends import FileBackend
from hicache_storage.conformance import BackendConformance, BackendSpec
from hicache_storage.conformance.data import make_pool, pool_namespace, tree_files
from hicache_storage.errors import ConfigError, InvalidKeyError
from hicache_storage.layouts import LAYOUTS, POOL_KIND_IDS, POOL_KINDS
from hicache_storage.storekit.atomic import TEMP_PREFIX
from hicache_storage.storekit.header import HEADER_SIZE

WORKERS = Path(__file__).parents[1] / "workers"
sys.path.insert(0, str(WORKERS))

from kvcontent import KEY_UNIVERSE, content, namespace, page_pool

Factory = Callable[..., FileBackend]


class TestFileConformance(BackendConformance):
    @pytest.fixture
    def backend_spec(self, tmp_path: Path) -> BackendSpec:
        return BackendSpec("file", {"root": str(tmp_path / "store")})

    @pytest.fixture
    def break_store(
        self, broken_directory: Callable[[HiCacheStorage], Any]
    ) -> Callable[[HiCacheStorage], Any]:
        return broken_directory


class TestFileConformanceFsyncOneThread(TestFileConformance):
    """The same checks with fsync on, a single I/O thread and a capacity limit."""

    @pytest.fixture
    def backend_spec(self, tmp_path: Path) -> BackendSpec:
        opts = {
            "root": str(tmp_path / "store"),
            "fsync": True,
            "max_concurrency": 1,
            "max_size": "1GiB",
        }
        return BackendSpec("file", opts)


def stored_files(b: FileBackend) -> list[str]:
    return [p for p in tree_files(b.directory) if not os.path.basename(p).startswith(".")]


# ------------------------------------------------------------------ semantics


def test_set_get_exists_round_trip(file_backend: FileBackend) -> None:
    b = file_backend
    t = torch.arange(100, dtype=torch.int32)
    assert b.set("tensor", t) is True
    assert b.set("bytes", b"hello") is True
    assert b.exists("tensor")
    assert b.exists("bytes")
    assert not b.exists("missing")
    got = b.get("tensor")
    assert got.dtype == torch.uint8
    assert torch.equal(got.view(torch.int32), t)
    target = torch.zeros(100, dtype=torch.int32)
    assert b.get("tensor", target) is target
    assert torch.equal(target, t)
    buf = bytearray(5)
    assert b.get("bytes", buf) is buf
    assert buf == b"hello"


def test_miss_and_size_mismatch_leave_the_target_untouched(file_backend: FileBackend) -> None:
    b = file_backend
    b.set("k", b"12345678")
    for target in (bytearray(b"\xaa" * 7), bytearray(b"\xaa" * 9)):
        before = bytes(target)
        assert b.get("k", target) is None
        assert bytes(target) == before
    missing = bytearray(b"\xbb" * 8)
    assert b.get("nope", missing) is None
    assert missing == b"\xbb" * 8
    assert b.get_stats().size_mismatches == 2


def test_set_existing_is_a_no_op(file_backend: FileBackend) -> None:
    b = file_backend
    assert b.set("k", b"first")
    assert b.set("k", b"second, longer")
    assert bytes(b.get("k").numpy()) == b"first"


def test_zero_length_value(file_backend: FileBackend) -> None:
    b = file_backend
    assert b.set("empty", b"")
    assert b.exists("empty")
    assert b.get("empty").numel() == 0
    assert b.get("empty", bytearray()) is not None


def test_delete(file_backend: FileBackend) -> None:
    b = file_backend
    b.set("k", b"v")
    assert b.delete("k") is True
    assert b.delete("k") is False
    assert not b.exists("k")
    assert b.get("k") is None
    assert b.set("k", b"again")
    assert bytes(b.get("k").numpy()) == b"again"


@pytest.mark.parametrize("n", [0, 1, 5])
def test_batch_shapes(file_backend: FileBackend, n: int) -> None:
    b = file_backend
    keys = [f"b{i}" for i in range(n)]
    vals = [bytes([i]) * 10 for i in range(n)]
    assert b.batch_set(keys, vals) == [True] * n
    assert b.batch_exists(keys) == n
    out = b.batch_get([*keys, "missing"])
    assert len(out) == n + 1
    assert out[-1] is None
    assert [bytes(t.numpy()) for t in out[:n]] == vals
    if n:
        b.delete(keys[0])
        assert b.batch_exists(keys) == 0


# ------------------------------------------------------------------ zero-copy v1


@pytest.mark.parametrize(("layout", "mla"), POOL_KINDS, ids=POOL_KIND_IDS)
def test_v1_round_trip_every_layout(make_file_backend: Factory, layout: str, mla: bool) -> None:
    pool = make_pool(layout, mla)
    b = make_file_backend(pool_namespace(pool))
    b.register_mem_pool_host(pool)
    ps = pool.page_size
    keys = page_hashes(list(range(5 * ps)), ps)
    src, dst = pool.alloc(5 * ps), pool.alloc(5 * ps)
    assert src is not None
    assert dst is not None
    assert b.batch_set_v1(keys, src) == [True] * 5
    assert b.batch_get_v1(keys, dst) == [True] * 5
    assert [p.tobytes() for p in pool.page_buffers(src)] == [
        p.tobytes() for p in pool.page_buffers(dst)
    ]
    # The file holds the header plus exactly the page's bytes.
    assert all(os.path.getsize(p) == HEADER_SIZE + pool.page_bytes for p in stored_files(b))
    # v1 and the legacy path agree on the bytes of a page.
    whole = b.get(keys[2])
    assert bytes(whole.numpy()) == pool.page_buffers(src)[2].tobytes()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_reads_land_only_in_the_page_ranges(make_file_backend: Factory, layout: str) -> None:
    pool = make_pool(layout)
    b = make_file_backend(pool_namespace(pool))
    b.register_mem_pool_host(pool)
    ps = pool.page_size
    keys = page_hashes(list(range(2 * ps)), ps)
    assert b.batch_set_v1(keys, torch.arange(2 * ps)) == [True, True]
    before = pool.kv_buffer.clone()
    dst = torch.arange(4 * ps, 6 * ps)
    assert b.batch_get_v1(keys, dst) == [True, True]
    changed = (
        (pool.kv_buffer.view(torch.uint8) != before.view(torch.uint8)).view(-1).nonzero().view(-1)
    )
    allowed = torch.zeros(pool.kv_buffer.numel() * pool.itemsize, dtype=torch.bool)
    base = pool.kv_buffer.data_ptr()
    for page in pool.page_buffers(dst):
        for s in page.segments:
            allowed[s.ptr - base : s.ptr - base + s.nbytes] = True
    assert bool(allowed[changed].all())


def test_v1_misaligned_indices_write_nothing(make_file_backend: Factory) -> None:
    pool = make_pool()
    b = make_file_backend(pool_namespace(pool))
    b.register_mem_pool_host(pool)
    ps = pool.page_size
    keys = ["a", "b"]
    assert b.batch_set_v1(keys, torch.arange(1, 2 * ps + 1)) == [False, False]
    assert b.batch_set_v1(keys, torch.arange(3 * ps)) == [False, False]
    assert stored_files(b) == []


def test_v1_partial_hits(make_file_backend: Factory) -> None:
    pool = make_pool()
    b = make_file_backend(pool_namespace(pool))
    b.register_mem_pool_host(pool)
    ps = pool.page_size
    keys = page_hashes(list(range(4 * ps)), ps)
    b.batch_set_v1([keys[0], keys[2]], torch.cat([torch.arange(ps), torch.arange(2 * ps, 3 * ps)]))
    assert b.batch_exists(keys) == 1
    assert b.batch_get_v1(keys, torch.arange(4 * ps, 8 * ps)) == [True, False, True, False]


# ------------------------------------------------------------------ keys and isolation


@pytest.mark.parametrize(
    "key", ["../escape", "/etc/passwd", "a/b", "..", "x\x00y", "é", "", "k" * 300]
)
def test_bad_keys_raise_and_write_nothing(
    file_backend: FileBackend, tmp_path: Path, key: str
) -> None:
    b = file_backend
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(InvalidKeyError):
        b.set(key, b"v")
    with pytest.raises(InvalidKeyError):
        b.get(key)
    with pytest.raises(InvalidKeyError):
        b.batch_set_v1([key], [])
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    "other",
    [
        {"dtype": "float8_e4m3fn"},
        {"model_id": "other-model"},
        {"tenant": "tenant-b"},
        {"object_layout": "layer_first"},
        {"page_size": 8},
    ],
)
def test_namespaces_never_read_each_other(
    make_file_backend: Factory, other: dict[str, object]
) -> None:
    base = {"model_id": "m", "dtype": "bfloat16", "page_size": 4, "object_layout": "page_first"}
    a = make_file_backend(KVCacheNamespace(**base))  # type: ignore[arg-type]
    b = make_file_backend(KVCacheNamespace(**{**base, **other}))  # type: ignore[arg-type]
    a.set("shared-key", b"from a")
    assert not b.exists("shared-key")
    assert b.get("shared-key") is None
    assert b.batch_exists(["shared-key"]) == 0
    b.set("shared-key", b"from b")
    assert bytes(a.get("shared-key").numpy()) == b"from a"
    assert bytes(b.get("shared-key").numpy()) == b"from b"
    b.clear()
    assert not b.exists("shared-key")
    assert bytes(a.get("shared-key").numpy()) == b"from a"
    assert b.set("after-clear", b"ok")
    assert b.exists("after-clear")


def test_ranks_store_different_shards(root: str) -> None:
    ns = KVCacheNamespace(model_id="m", dtype="bf16", page_size=4, total_kv_heads=8)
    r0 = FileBackend(StorageConfig(namespace=ns, tp_rank=0, tp_size=2), root=root)
    r1 = FileBackend(StorageConfig(namespace=ns, tp_rank=1, tp_size=2), root=root)
    r0.set("k", b"heads 0-3")
    assert not r1.exists("k")
    r1.set("k", b"heads 4-7")
    assert bytes(r0.get("k").numpy()) == b"heads 0-3"
    assert sorted(os.path.basename(p) for p in tree_files(root)) == ["k~h0-3", "k~h4-7"]


def test_persistence_and_permissions(make_file_backend: Factory, root: str) -> None:
    b = make_file_backend()
    b.set("k", b"persisted")
    b.close()
    again = make_file_backend()
    assert bytes(again.get("k").numpy()) == b"persisted"
    (path,) = stored_files(again)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    d = os.path.dirname(path)
    while d != root:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
        d = os.path.dirname(d)


def test_fsync_option(make_file_backend: Factory) -> None:
    b = make_file_backend(fsync=True)
    assert b.set("k", b"durable")
    assert bytes(b.get("k").numpy()) == b"durable"


def test_invalid_options(root: str) -> None:
    for bad in (
        {"max_concurrency": 0},
        {"eviction_ratio": 1.5},
        {"checksum": "md5"},
        {"max_size": "lots"},
    ):
        with pytest.raises(ConfigError):
            FileBackend(StorageConfig(), root=root, **bad)
    with pytest.raises(ConfigError, match="cannot create"):
        FileBackend(StorageConfig(), root="/proc/definitely/not/here")


def test_a_restarted_rank_does_not_evict_other_ranks_pages(root: str) -> None:
    ns = KVCacheNamespace(model_id="m", dtype="bf16", page_size=4, total_kv_heads=4)
    obj = HEADER_SIZE + 1000

    def rank(r: int) -> FileBackend:
        cfg = StorageConfig(namespace=ns, tp_rank=r, tp_size=2)
        return FileBackend(cfg, root=root, max_size=5 * obj, eviction_ratio=1.0)

    r0, r1 = rank(0), rank(1)
    for i in range(5):
        assert r0.set(f"k{i}", b"0" * 1000)
        assert r1.set(f"k{i}", b"1" * 1000)
    r0.close()
    again = rank(0)
    assert again.usage()["objects"] == 5  # only its own shard
    assert again.set("new", b"0" * 1000)
    assert all(r1.exists(f"k{i}") for i in range(5))
    r1.close()
    again.close()


def test_directories_stay_0700_after_a_clear_elsewhere(
    make_file_backend: Factory, root: str
) -> None:
    a = make_file_backend()
    b = make_file_backend()
    a.set("k1", b"v")
    b.clear()  # another instance (think: another process) removes the namespace
    assert a.set("k2", b"v")
    assert stat.S_IMODE(os.stat(a.directory).st_mode) == 0o700
    for path in stored_files(a):
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


def test_metadata_cache_is_positive_only_and_safe(make_file_backend: Factory) -> None:
    b = make_file_backend(metadata_cache_ttl=60)
    other = make_file_backend()
    assert not b.exists("k")
    other.set("k", b"v")
    assert b.exists("k")  # no negative caching: another writer's page is seen at once
    other.delete("k")
    assert b.exists("k")  # stale positive within the TTL ...
    assert b.get("k") is None  # ... but a read misses cleanly
    assert not b.exists("k")  # and the miss evicted the stale entry
    other.set("j", b"v")
    assert b.exists("j")
    other.delete("j")
    assert b.set("j", b"again")  # a write never trusts the cache: it stores the page
    assert bytes(other.get("j").numpy()) == b"again"


# ------------------------------------------------------------------ corruption


@pytest.mark.parametrize("damage", ["truncate", "flip-payload", "flip-header", "garbage", "empty"])
def test_corrupt_objects_read_as_misses(file_backend: FileBackend, damage: str) -> None:
    b = file_backend
    payload = bytes(range(256)) * 8
    b.set("k", payload)
    (path,) = stored_files(b)
    raw = bytearray(Path(path).read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) - 100]
    elif damage == "flip-payload":
        raw[HEADER_SIZE + 1000] ^= 0x40
    elif damage == "flip-header":
        raw[9] ^= 0x01
    elif damage == "garbage":
        raw = bytearray(os.urandom(len(raw)))
    else:
        raw = bytearray()
    Path(path).write_bytes(raw)
    assert b.get("k") is None
    assert b.get_stats().corrupt_objects == 1
    assert not os.path.exists(path)  # removed, so a good copy can be stored again
    assert b.set("k", payload)
    assert bytes(b.get("k").numpy()) == payload


def test_checksum_none_still_catches_truncation(make_file_backend: Factory) -> None:
    b = make_file_backend(checksum="none")
    b.set("k", b"x" * 1000)
    (path,) = stored_files(b)
    with open(path, "r+b") as f:
        f.truncate(HEADER_SIZE + 10)
    assert b.get("k") is None


# ------------------------------------------------------------------ capacity


def dir_bytes(b: FileBackend) -> int:
    return sum(os.path.getsize(p) for p in tree_files(b.directory))


def test_directory_never_exceeds_max_size_and_lru_holds(make_file_backend: Factory) -> None:
    obj = HEADER_SIZE + 1000
    b = make_file_backend(max_size=10 * obj, eviction_ratio=0.5)
    for i in range(10):
        assert b.set(f"k{i}", bytes([i]) * 1000)
    assert b.get("k0") is not None  # k0 becomes the most recently used
    assert b.set("k10", b"x" * 1000)  # over the cap: evict LRU down to 5 objects
    assert b.exists("k0")
    assert b.exists("k10")
    assert not any(b.exists(f"k{i}") for i in range(1, 7))
    assert all(b.exists(f"k{i}") for i in range(7, 10))
    for i in range(11, 40):
        assert b.set(f"k{i}", bytes([i % 256]) * 1000)
        assert dir_bytes(b) <= 10 * obj
    assert b.get_stats().evictions > 0
    # set-existing refreshes recency too.
    b2 = make_file_backend(
        KVCacheNamespace(model_id="m", dtype="bytes", page_size=1, tenant="t2"), max_size=10 * obj
    )
    for i in range(10):
        b2.set(f"a{i}", b"z" * 1000)
    b2.set("a0", b"ignored")
    b2.set("a10", b"z" * 1000)
    assert b2.exists("a0")
    assert not b2.exists("a1")


def test_capacity_survives_a_restart(make_file_backend: Factory) -> None:
    obj = HEADER_SIZE + 1000
    b = make_file_backend(max_size=5 * obj, eviction_ratio=1.0)
    for i in range(5):
        b.set(f"k{i}", b"x" * 1000)
        time.sleep(0.01)  # distinct mtimes: the restart scan orders by them
    b.close()
    again = make_file_backend(max_size=5 * obj, eviction_ratio=1.0)
    assert again.usage()["used_bytes"] == 5 * obj
    again.set("new", b"y" * 1000)
    assert dir_bytes(again) <= 5 * obj
    assert not again.exists("k0")
    assert again.exists("k4")
    assert again.exists("new")


def test_oversize_value_is_refused(make_file_backend: Factory) -> None:
    b = make_file_backend(max_size=1000)
    assert b.set("big", b"x" * 2000) is False
    assert not b.exists("big")
    assert b.usage()["reserved_bytes"] == 0
    assert b.get_stats().op("set").errors == 1


def test_full_disk_fails_cleanly_and_leaks_nothing(small_tmpfs: str) -> None:
    b = FileBackend(StorageConfig(), root=small_tmpfs, max_size="64MiB")  # cap above the disk
    results = [b.set(f"k{i}", bytes([i]) * 300_000) for i in range(12)]
    assert True in results
    assert False in results
    assert b.usage()["reserved_bytes"] == 0
    assert not any(os.path.basename(p).startswith(TEMP_PREFIX) for p in tree_files(small_tmpfs))
    for i, ok in enumerate(results):
        got = b.get(f"k{i}")
        if ok:
            assert bytes(got.numpy()) == bytes([i]) * 300_000
        else:
            assert got is None
            assert not b.exists(f"k{i}")
    b.close()


def test_min_free_space_evicts_instead_of_filling_the_disk(small_tmpfs: str) -> None:
    b = FileBackend(StorageConfig(), root=small_tmpfs, min_free_space="1MiB")
    for i in range(20):
        assert b.set(f"k{i}", bytes([i]) * 200_000), i
        st = os.statvfs(small_tmpfs)
        assert st.f_bavail * st.f_frsize >= 2**20 - 8192  # tmpfs rounds to pages
    assert b.exists("k19")
    assert not b.exists("k0")
    b.close()


# ------------------------------------------------------------------ concurrency and crashes


def start_writer(root: str, seed: int, mode: str, rounds: int = -1) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKERS / "file_writer.py"), root, str(seed), "64", mode, str(rounds)],
        stdout=subprocess.PIPE,
        text=True,
    )


def check_every_visible_page(b: FileBackend, nbytes: int) -> int:
    """Every key that exists reads back byte-exact; return how many exist."""
    present = 0
    for key in KEY_UNIVERSE:
        if b.exists(key):
            got = b.get(key)
            assert got is not None, f"{key} exists but does not read back"
            assert bytes(got.numpy()) == content(key, nbytes), f"{key} holds wrong bytes"
            present += 1
    return present


def test_reader_writer_threads_and_a_second_process(root: str) -> None:
    pool = page_pool(8)
    b = FileBackend(StorageConfig(namespace=namespace(pool)), root=root, max_concurrency=2)
    other = start_writer(root, seed=7, mode="set", rounds=40)
    errors: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        target = bytearray(pool.page_bytes)
        while not stop.is_set():
            key = random.choice(KEY_UNIVERSE)
            if b.get(key, target) is not None and bytes(target) != content(key, pool.page_bytes):
                errors.append(key)

    def writer() -> None:
        rng = random.Random(1)
        for _ in range(300):
            key = rng.choice(KEY_UNIVERSE)
            if not b.set(key, content(key, pool.page_bytes)):
                errors.append("set failed " + key)

    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    threads[1].join()
    assert other.wait(timeout=120) == 0
    assert other.stdout is not None
    other.stdout.close()
    stop.set()
    threads[0].join()
    assert errors == []
    assert check_every_visible_page(b, pool.page_bytes) > 0
    assert b.get_stats().op("get").errors == 0
    b.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["v1", "set"])
def test_writers_killed_mid_batch_leave_only_intact_objects(root: str, mode: str) -> None:
    rng = random.Random(42)
    for round_ in range(3):
        procs = [start_writer(root, seed=round_ * 10 + i, mode=mode) for i in range(3)]
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.3))
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
            assert p.stdout is not None
            p.stdout.close()
            assert p.returncode == -signal.SIGKILL
    pool = page_pool(8)
    b = FileBackend(StorageConfig(namespace=namespace(pool)), root=root)  # the "restart"
    assert not any(os.path.basename(p).startswith(TEMP_PREFIX) for p in tree_files(root))
    assert check_every_visible_page(b, pool.page_bytes) > 0
    b.close()


def test_a_write_killed_inside_writev_is_invisible_and_cleaned(root: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(WORKERS / "file_writer.py"), root, "0", "256", "big"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    temps: list[str] = []
    while not temps and time.monotonic() < deadline:
        temps = [p for p in tree_files(root) if os.path.basename(p).startswith(TEMP_PREFIX)]
    assert temps, "the writer never started a write"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert any(os.path.exists(t) for t in temps)  # the torn temporary is still there
    b = FileBackend(StorageConfig(), root=root)  # restart
    assert not any(os.path.basename(p).startswith(TEMP_PREFIX) for p in tree_files(root))
    for path in stored_files(b):  # objects published before the kill are complete
        assert os.path.getsize(path) == HEADER_SIZE + 256 * 2**20
    b.close()


def test_stale_leftovers_are_removed_at_startup(make_file_backend: Factory, root: str) -> None:
    b = make_file_backend()
    b.set("k", b"v")
    leftover = Path(b.directory) / "abc" / f"{TEMP_PREFIX}{'0' * 8}.1-1.ffff"
    leftover.parent.mkdir(exist_ok=True)
    leftover.write_bytes(b"partial")
    past = time.time() - 7200
    os.utime(leftover, (past, past))
    trash = Path(root) / f".trash.{b.namespace.digest}.0000"
    (trash / "x").mkdir(parents=True)
    b.close()
    again = make_file_backend()
    assert not leftover.exists()
    assert not trash.exists()
    assert bytes(again.get("k").numpy()) == b"v"


@pytest.mark.parametrize("kind", ["file", "shm"])
def test_a_page_moved_to_another_keys_name_is_a_miss(kind: str, root: str) -> None:
    """Issue 8, second attack: someone who controls a directory (another user after a
    tmp cleaner removed the root, an operator's copy) swaps two of this user's pages: each
    file still passes the ownership rule, but it was stored under the other name, so it
    reads as a miss (and is removed), never as the other key's page."""
    import shutil
    import uuid

    from hicache_storage.backends import ShmBackend

    shm_dir = f"/dev/shm/hicache-swap-{uuid.uuid4().hex[:8]}"
    b = (
        FileBackend(StorageConfig(), root=root)
        if kind == "file"
        else ShmBackend(StorageConfig(), root=shm_dir)
    )
    try:
        assert b.set("X", b"\x58" * 4096) and b.set("Y", b"\x59" * 4096)
        px, py = b._path(b.object_name("X")), b._path(b.object_name("Y"))
        tmp = px + ".swap"
        os.rename(px, tmp)
        os.rename(py, px)
        os.rename(tmp, py)
        assert b.get("X") is None and b.get("Y") is None
        assert b.get_stats().corrupt_objects == 2
        assert b.set("X", b"\x58" * 4096)
        assert bytes(b.get("X").numpy()) == b"\x58" * 4096
    finally:
        b.close()
        shutil.rmtree(shm_dir, ignore_errors=True)
