"""``watch_removals``: each backend tells a listener of the objects of its namespace it
removes itself (evicted, deleted, cleared), by key, and of nothing else."""

from __future__ import annotations

import time
from pathlib import Path

from hicache_storage import KVCacheNamespace, StorageConfig
from hicache_storage.backends import FileBackend, MemoryBackend, MmapBackend, ShmBackend
from hicache_storage.storekit.header import HEADER_SIZE


def ns(tenant: str) -> KVCacheNamespace:
    return KVCacheNamespace(model_id="m", dtype="bf16", page_size=4, tenant=tenant)


class Heard:
    def __init__(self) -> None:
        self.calls: list[list[str] | None] = []

    def __call__(self, keys: list[str] | None) -> None:
        self.calls.append(None if keys is None else list(keys))

    @property
    def keys(self) -> list[str]:
        return [k for c in self.calls if c is not None for k in c]


PAGE = b"p" * 1000


def test_file_reports_evictions_deletes_and_clears(tmp_path: Path) -> None:
    b = FileBackend(StorageConfig(namespace=ns("f")), root=str(tmp_path),
                    max_size=3 * (HEADER_SIZE + len(PAGE)), eviction_ratio=1.0)  # fmt: skip
    heard = Heard()
    assert b.watch_removals(heard) and b.reports_removals == {"evict", "delete", "clear"}
    for i in range(5):
        assert b.set(f"k{i}", PAGE)
    assert heard.keys == ["k0", "k1"]  # the two oldest, evicted for k3 and k4
    assert b.delete("k2") and not b.delete("k2")
    assert heard.keys == ["k0", "k1", "k2"]  # (a delete of nothing is not a removal)
    b.clear()
    assert heard.calls[-1] is None
    b.close()


def test_shm_reports_its_own_namespace_and_any_shard_not_another_tenants(
    shm_dir: str,
) -> None:
    """One budget for the root: a writer evicting another tenant's page reports nothing
    (not its key), and its own namespace's pages of any shard are reported by key."""
    page = HEADER_SIZE + len(PAGE)
    other = ShmBackend(StorageConfig(namespace=ns("other")), root=shm_dir, max_size=4 * page,
                       recycle=False, eviction_ratio=1.0)  # fmt: skip
    assert other.set("theirs", PAGE)
    rank1 = ShmBackend(StorageConfig(namespace=ns("mine"), tp_rank=1, tp_size=2), root=shm_dir,
                       max_size=4 * page, recycle=False, eviction_ratio=1.0)  # fmt: skip
    assert rank1.set("shared", PAGE)
    me = ShmBackend(StorageConfig(namespace=ns("mine"), tp_rank=0, tp_size=2), root=shm_dir,
                    max_size=4 * page, eviction_ratio=1.0)  # fmt: skip
    heard = Heard()
    assert me.watch_removals(heard)
    for i in range(4):
        assert me.set(f"k{i}", PAGE)
    # Evicted for k2, k3: "theirs" (another tenant: not reported), then rank 1's
    # "shared" (this namespace, another shard: its key, the block is gone).
    assert heard.keys == ["shared"]
    assert not other.exists("theirs")
    for b in (me, rank1, other):
        b.close()


def test_shm_recycling_reports_the_page_it_overwrote(shm_dir: str) -> None:
    page = HEADER_SIZE + len(PAGE)
    b = ShmBackend(StorageConfig(namespace=ns("r")), root=shm_dir, max_size=2 * page)
    heard = Heard()
    b.watch_removals(heard)
    for i in range(4):
        assert b.set(f"k{i}", PAGE)
    assert heard.keys == ["k0", "k1"] and b.get_stats().evictions == 2
    b.close()


def test_mmap_reports_its_evictions(tmp_path: Path) -> None:
    b = MmapBackend(StorageConfig(namespace=ns("m")), path=str(tmp_path / "arena"),
                    max_size="1MiB", slot_size="64KiB", reuse_delay=0,
                    low_free_slots=0)  # fmt: skip
    heard = Heard()
    assert b.watch_removals(heard)
    slots = b.slots_for(1000)
    keys = [f"k{i}" for i in range(slots)]
    assert b.batch_set(keys, [PAGE] * slots) == [True] * slots
    time.sleep(0.01)
    assert b.get("k0") is not None  # k0 is the most recently used now
    assert b.set("new", PAGE)
    assert heard.keys == ["k1"]
    assert b.delete("new")
    b.clear()
    assert heard.keys == ["k1", "new"] and heard.calls[-1] is None
    b.close()


def test_remote_style_stores_report_what_this_instance_deletes_and_clears() -> None:
    b = MemoryBackend(StorageConfig(namespace=ns("mem")), store=f"rm-{time.time_ns()}")
    heard = Heard()
    assert b.watch_removals(heard) and b.reports_removals == {"delete", "clear"}
    assert b.set("a", PAGE) and b.delete("a")
    b.clear()
    assert heard.calls == [["a"], None]
    b.close()


def test_a_failing_listener_never_fails_the_removal(tmp_path: Path) -> None:
    b = FileBackend(StorageConfig(namespace=ns("x")), root=str(tmp_path))

    def broken(keys: list[str] | None) -> None:
        raise RuntimeError("listener bug")

    heard = Heard()
    b.watch_removals(broken)
    b.watch_removals(heard)
    assert b.set("a", PAGE) and b.delete("a") is True
    assert heard.calls == [["a"]]
    b.close()
