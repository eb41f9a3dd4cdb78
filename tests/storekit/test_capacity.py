"""LRU capacity accounting and the metadata cache."""

from __future__ import annotations

import time

import pytest

from hicache_storage.errors import ConfigError
from hicache_storage.storekit.capacity import CapacityTracker
from hicache_storage.storekit.metacache import MetadataCache


class Store:
    """Records evictions (the thing under test is the tracker's bookkeeping)."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.evicted: list[str] = []
        self.fail = fail or set()

    def evict(self, name: str) -> bool:
        if name in self.fail:
            return False
        self.evicted.append(name)
        return True


def fill(t: CapacityTracker, names: list[str], size: int) -> None:
    for n in names:
        r = t.reserve(n, size)
        assert r is not None
        r.commit()


def test_lru_eviction_down_to_the_watermark() -> None:
    s = Store()
    t = CapacityTracker(100, s.evict, eviction_ratio=0.5)
    fill(t, ["a", "b", "c", "d", "e"], 20)
    t.touch("a")  # a becomes most recent: order b c d e a
    r = t.reserve("f", 20)
    assert r is not None
    # 100 + 20 > 100: evict until used + reserved + 20 <= 50 -> b, c, d, e go.
    assert s.evicted == ["b", "c", "d", "e"]
    r.commit()
    assert t.used_bytes == 40
    assert t.names_oldest_first() == ["a", "f"]
    assert t.evictions == 4


def test_oversize_and_unevictable_are_refused() -> None:
    s = Store()
    t = CapacityTracker(100, s.evict)
    assert t.reserve("huge", 101) is None
    held = t.reserve("inflight", 90)  # a write in flight is never evicted
    assert held is not None
    assert t.reserve("x", 20) is None
    held.release()
    assert t.reserved_bytes == 0
    assert t.reserve("x", 20) is not None


def test_reservation_released_on_exception() -> None:
    t = CapacityTracker(100, Store().evict)
    with pytest.raises(OSError):
        with t.reserve("a", 60) as r:  # type: ignore[union-attr]
            assert t.reserved_bytes == 60
            raise OSError("disk full")
    assert r is not None
    assert t.reserved_bytes == 0
    assert t.used_bytes == 0
    assert len(t) == 0


def test_failed_eviction_stops_without_lying() -> None:
    s = Store(fail={"a"})
    t = CapacityTracker(100, s.evict)
    fill(t, ["a", "b"], 50)
    assert t.reserve("c", 50) is None  # a cannot be removed
    assert t.used_bytes == 100
    assert "a" in t


def test_free_space_floor() -> None:
    free = [30]
    s = Store()

    def evict(name: str) -> bool:
        free[0] += 10
        return s.evict(name)

    t = CapacityTracker(None, evict, min_free_bytes=20, free_space=lambda: free[0])
    fill(t, ["a", "b", "c"], 10)  # the callback does not lower `free`; only the floor matters
    r = t.reserve("d", 25)  # needs 30 + 10k - 25 >= 20: two evictions (k = 2)
    assert r is not None
    assert s.evicted == ["a", "b"]
    free[0] = 0
    t2 = CapacityTracker(None, lambda n: False, min_free_bytes=20, free_space=lambda: free[0])
    assert t2.reserve("z", 1) is None


def test_load_orders_by_recency_and_discard() -> None:
    t = CapacityTracker(1000, Store().evict)
    t.load([("new", 10, 3.0), ("old", 20, 1.0), ("mid", 30, 2.0)])
    assert t.names_oldest_first() == ["old", "mid", "new"]
    assert t.used_bytes == 60
    t.discard("mid")
    assert t.used_bytes == 30
    t.clear()
    assert t.used_bytes == 0
    assert len(t) == 0


def test_load_ordered_keeps_the_given_order_and_refuses_a_name_twice() -> None:
    store = Store()
    t = CapacityTracker(100, store.evict, eviction_ratio=1.0, quota_prefix="a/", quota_bytes=80)
    t.load_ordered(["a/old", "b/mid", "a/new"], [30, 20, 10])
    assert t.names_oldest_first() == ["a/old", "b/mid", "a/new"]
    assert (t.used_bytes, t.quota_used_bytes, t.quota_objects) == (60, 40, 2)
    r = t.reserve("b/x", 50)  # over the cap: the oldest goes first
    assert r is not None and r.commit()
    assert store.evicted == ["a/old"]
    with pytest.raises(ValueError, match="twice"):
        CapacityTracker(100, store.evict).load_ordered(["x", "y", "x"], [1, 2, 3])
    with pytest.raises(ValueError):
        CapacityTracker(100, store.evict).load_ordered(["x"], [1, 2])
    # Not strict (a directory listing that repeats a name): the later entry counts.
    lenient = CapacityTracker(100, store.evict)
    lenient.load_ordered(["x", "y", "x"], [1, 2, 3], strict=False)
    assert lenient.items_oldest_first() == [("y", 2), ("x", 3)]
    assert lenient.used_bytes == 5
    # Into a tracker that holds objects already: added as the newest, in order.
    t.load_ordered(["c/1", "c/2"], [1, 2])
    assert t.names_oldest_first()[-2:] == ["c/1", "c/2"]
    assert t.used_bytes == 60 - 30 + 50 + 3


def test_invalid_settings() -> None:
    with pytest.raises(ConfigError):
        CapacityTracker(0, Store().evict)
    with pytest.raises(ConfigError):
        CapacityTracker(10, Store().evict, eviction_ratio=0)
    with pytest.raises(ConfigError):
        CapacityTracker(10, Store().evict, min_free_bytes=5)


def test_disabled_tracker_admits_everything() -> None:
    t = CapacityTracker(None, Store().evict)
    assert not t.enabled
    r = t.reserve("a", 10**15)
    assert r is not None
    r.commit()
    assert t.used_bytes == 0


def test_metadata_cache_ttl() -> None:
    c = MetadataCache(0.05)
    c.add("k")
    assert c.contains("k")
    time.sleep(0.06)
    assert not c.contains("k")
    c.add("k")
    c.discard("k")
    assert not c.contains("k")
    off = MetadataCache(0)
    off.add("k")
    assert not off.contains("k")
    assert len(off) == 0
    small = MetadataCache(10, max_entries=2)
    for k in "abc":
        small.add(k)
    assert not small.contains("a")
    assert small.contains("c")


def test_free_space_floor_counts_writes_in_flight_and_never_evicts_in_vain() -> None:
    free = [1_000_000]
    s = Store()
    t = CapacityTracker(None, s.evict, min_free_bytes=600_000, free_space=lambda: free[0])
    first = t.reserve("a", 300_000)
    assert first is not None
    # Not on disk yet, but it will be: 1 MB - 300 kB - 300 kB < 600 kB.
    assert t.reserve("b", 300_000) is None
    first.commit()
    fill(t, ["c", "d"], 10)
    free[0] = 100_000  # someone else filled the disk: evicting our 300 kB cannot help
    assert t.reserve("e", 10) is None
    assert s.evicted == []
    assert len(t) == 3


def test_commit_after_clear_is_not_counted() -> None:
    t = CapacityTracker(100, Store().evict)
    r = t.reserve("a", 10)
    assert r is not None
    t.clear()
    assert r.commit() is False
    assert t.used_bytes == 0
    assert t.reserved_bytes == 0
    t.add("a", 10)
    assert t.used_bytes == 10


def test_in_flight_reservations_block_without_evicting() -> None:
    s = Store()
    t = CapacityTracker(100, s.evict)
    fill(t, ["a"], 10)
    held = t.reserve("big", 80)
    assert held is not None
    assert t.reserve("x", 30) is None  # 80 in flight + 30 > 100 whatever is evicted
    assert s.evicted == []


def test_reserve_reusing_hands_the_oldest_objects_bytes_over_only_when_full() -> None:
    s = Store()
    t = CapacityTracker(60, s.evict)
    fill(t, ["a", "b"], 20)
    assert t.reserve_reusing("x", 20) is None  # room left: a new object, nothing evicted
    fill(t, ["c"], 20)
    t.touch("a")  # LRU order: b c a
    got = t.reserve_reusing("x", 20)
    assert got is not None
    r, victim = got
    assert victim == "b" and "b" not in t and s.evicted == []  # the caller removes b
    assert (t.used_bytes, t.reserved_bytes) == (40, 20)  # no net change: never over the cap
    assert t.evictions == 1
    assert r.commit()
    assert t.names_oldest_first() == ["c", "a", "x"] and t.used_bytes == 60


def test_reserve_reusing_declines_another_size_and_a_released_reuse_frees_the_bytes() -> None:
    s = Store()
    t = CapacityTracker(60, s.evict)
    fill(t, ["a", "b", "c"], 20)
    assert t.reserve_reusing("x", 10) is None  # the oldest has 20 bytes, not 10
    assert t.names_oldest_first() == ["a", "b", "c"]
    got = t.reserve_reusing("x", 20)
    assert got is not None
    got[0].release()  # the write failed: the evicted object's bytes are gone for good
    assert (t.used_bytes, t.reserved_bytes, len(t)) == (40, 0, 2)


def test_reserve_reusing_under_a_free_space_floor_and_after_clear() -> None:
    free = [100]
    s = Store()
    t = CapacityTracker(None, s.evict, min_free_bytes=50, free_space=lambda: free[0])
    fill(t, ["a", "b"], 20)
    assert t.reserve_reusing("x", 20) is None  # 100 - 20 >= 50: room
    free[0] = 60
    got = t.reserve_reusing("x", 20)  # 60 - 20 < 50: full, reuse a
    assert got is not None and got[1] == "a"
    t.clear()
    assert not got[0].commit()  # cleared meanwhile: the caller re-checks its object
    assert t.reserved_bytes == 0 and len(t) == 0
    assert CapacityTracker(None, s.evict).reserve_reusing("x", 20) is None  # no bound at all


def test_a_namespace_quota_evicts_only_that_namespaces_oldest() -> None:
    """One root, two namespaces: ``a/`` capped at 60 bytes. Its writes past the quota
    evict its own oldest objects (down to the watermark), never ``b/``'s, though those
    are older; the root cap still applies to everything."""
    s = Store()
    t = CapacityTracker(1000, s.evict, eviction_ratio=0.5, quota_prefix="a/", quota_bytes=60)
    fill(t, ["b/1", "b/2"], 20)
    fill(t, ["a/1", "a/2", "a/3"], 20)
    assert (t.quota_used_bytes, t.quota_objects, t.used_bytes) == (60, 3, 100)
    t.touch("a/1")  # order of a's: a/2 a/3 a/1
    # 60 + 20 > 60: down to 30 with the new object counted, so all three go, oldest first.
    fill(t, ["a/4"], 20)
    assert s.evicted == ["a/2", "a/3", "a/1"]
    assert (t.quota_used_bytes, t.quota_objects) == (20, 1)
    assert "b/1" in t and "b/2" in t
    fill(t, ["b/3", "b/4"], 20)  # other namespaces are not held to it
    assert t.quota_used_bytes == 20 and t.used_bytes == 100
    assert t.reserve("a/big", 61) is None  # larger than the quota itself
    # Writes in flight count: two 30-byte reservations fill it; a third waits.
    r1, r2 = t.reserve("a/x", 30), t.reserve("a/y", 30)
    assert r1 is not None and r2 is not None and t.reserve("a/z", 1) is None
    r1.release()
    r2.commit()
    # Replacing the view (a re-scan, a load, a clear) counts the namespace again.
    t.clear(prefix="a/")
    assert (t.quota_used_bytes, t.quota_objects) == (0, 0)
    t.load([("a/q", 5, 1.0), ("b/q", 7, 2.0)])
    assert (t.quota_used_bytes, t.quota_objects) == (5, 1)
    t.discard("a/q")
    assert t.quota_used_bytes == 0


def test_reuse_under_a_quota_never_grows_the_namespace_past_it() -> None:
    """A recycling store (reserve_reusing) at its root cap: a namespace at its quota
    does not take another namespace's object; it evicts one of its own instead."""
    s = Store()
    t = CapacityTracker(80, s.evict, eviction_ratio=1.0, quota_prefix="a/", quota_bytes=40)
    fill(t, ["b/1", "b/2", "a/1", "a/2"], 20)
    assert t.reserve_reusing("a/3", 20) is None  # b/1 is oldest, but a is at its quota
    r = t.reserve("a/3", 20)
    assert r is not None and s.evicted == ["a/1"]
    r.commit()
    assert t.quota_used_bytes == 40 and "b/1" in t
    got = t.reserve_reusing("c/1", 20)  # another namespace may still recycle b/1
    assert got is not None and got[1] == "b/1"
    assert t.quota_used_bytes == 40


def test_a_bad_quota_is_refused() -> None:
    with pytest.raises(ConfigError, match="quota"):
        CapacityTracker(None, Store().evict, quota_prefix="a/", quota_bytes=0)
    with pytest.raises(ConfigError, match="quota"):
        CapacityTracker(None, Store().evict, quota_bytes=10)


def test_a_namespace_over_its_quota_shrinks_instead_of_recycling() -> None:
    """Over its quota (a re-scan found other ranks' writes, a smaller quota after a
    restart), a namespace's write never swaps one of its pages for another: it goes
    through reserve, which evicts its own down to the watermark."""
    s = Store()
    t = CapacityTracker(100, s.evict, eviction_ratio=1.0, quota_prefix="a/", quota_bytes=40)
    t.load([("a/1", 20, 1.0), ("a/2", 20, 2.0), ("a/3", 20, 3.0), ("b/1", 20, 4.0),
            ("b/2", 20, 5.0)])  # fmt: skip
    assert t.quota_used_bytes == 60 and t.used_bytes == 100
    assert t.reserve_reusing("a/4", 20) is None
    r = t.reserve("a/4", 20)
    assert r is not None and s.evicted == ["a/1", "a/2"]
    r.commit()
    assert t.quota_used_bytes == 40
