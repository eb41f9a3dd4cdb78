"""The tiers over real backends (``memory``, ``file``): prefix results, write policies,
eviction, prefetch (threshold, termination, rate limiting), backup retries, faults."""

from __future__ import annotations

import hashlib
import logging
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
import torch
from typing_extensions import override

from hicache_storage import HostKVPool, KVCacheNamespace, StorageConfig
from hicache_storage.backends import FileBackend, MemoryBackend
from hicache_storage.conformance.wrappers import FaultyBackend, LatencyBackend
from hicache_storage.errors import ConfigError, NotSupportedError
from hicache_storage.ratelimit import RateLimitedLog
from hicache_storage.tier import DevicePool, TierConfig, TieredCache, host_page_layer
from hicache_storage.wrapper import WrapperBackend

PS = 4  # tokens per page


def make_host(pages: int = 32, layout: str = "page_first") -> HostKVPool:
    return HostKVPool(num_pages=pages, page_size=PS, layer_num=3, kv_heads=2, head_dim=8,
                      dtype=torch.bfloat16, layout=layout)  # fmt: skip


def expected_kv(
    key: str, shape: tuple[int, ...], dtype: torch.dtype, layer: int, half: int
) -> torch.Tensor:
    seed = int.from_bytes(
        hashlib.blake2b(f"{key}/{layer}/{half}".encode(), digest_size=8).digest(), "little"
    )
    g = torch.Generator().manual_seed(seed & (2**63 - 1))
    return torch.randn(shape, generator=g).to(dtype)


def filler(cache: TieredCache, keys: list[str]) -> Callable[[int, int], None]:
    def compute(i: int, page: int) -> None:
        for layer in range(cache.device.layer_num):
            for half, t in enumerate(cache.device.page_layer(page, layer)):
                t.copy_(expected_kv(keys[i], tuple(t.shape), t.dtype, layer, half))

    return compute


def check_device(cache: TieredCache, keys: list[str], pages: list[int]) -> int:
    """Pages whose device KV is not what the stand-in model computes."""
    bad = 0
    for key, page in zip(keys, pages, strict=True):
        for layer in range(cache.device.layer_num):
            for half, t in enumerate(cache.device.page_layer(page, layer)):
                bad += not torch.equal(t, expected_kv(key, tuple(t.shape), t.dtype, layer, half))
    return bad


def prompt(n_tokens: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n_tokens,), generator=g).tolist()


@pytest.fixture
def store() -> Iterator[Callable[[HostKVPool], MemoryBackend]]:
    name = f"tier-{uuid.uuid4().hex[:8]}"
    made: list[MemoryBackend] = []

    def build(host: HostKVPool) -> MemoryBackend:
        ns = KVCacheNamespace.for_pool(host, model_id="tier-test")
        b = MemoryBackend(StorageConfig(namespace=ns), store=name)
        made.append(b)
        return b

    yield build
    if made:
        made[0].clear()
    for b in made:
        b.close()


def new_cache(backend: Any, host: HostKVPool, device_pages: int = 16, **config: Any) -> TieredCache:
    return TieredCache(backend, host, DevicePool(host, device_pages), TierConfig(**config))


def run(cache: TieredCache, tokens: list[int], prefetch: bool = True) -> tuple[int, int, int]:
    """One request as an engine runs it: match, prefetch, acquire (load or compute),
    check, release. Returns (reused pages, device-ready pages, wrong pages)."""
    keys = cache.keys_of(tokens)
    match = cache.match_prefix(keys)
    op = cache.prefetch(match) if prefetch else None
    if op is not None:
        cache.finish_prefetch(op)
    lease = cache.acquire(keys, filler(cache, keys), prefetched=op)
    if lease.progress is not None:
        assert lease.progress.wait(cache.device.layer_num - 1, timeout=10)
    bad = check_device(cache, keys, lease.device_pages)
    cache.release(lease)
    return lease.reused, match.device_pages, bad


def test_write_through_shares_pages_through_storage(store: Callable[..., MemoryBackend]) -> None:
    host_a, host_b = make_host(), make_host()
    a = new_cache(store(host_a), host_a, prefetch_threshold=0)
    tokens = prompt(10 * PS)
    assert run(a, tokens) == (0, 0, 0)
    assert a.flush(10)
    assert a.stats.backup_tokens == 10 * PS and a.stats.backup_failed_tokens == 0
    assert run(a, tokens) == (10, 10, 0)  # all on the device now
    # A second instance (other pools, same namespace): storage hits, loaded byte-exact.
    b = new_cache(store(host_b), host_b, prefetch_threshold=0)
    keys = b.keys_of(tokens)
    m = b.match_prefix(keys)
    assert (m.device_pages, m.host_pages, m.logical_pages) == (0, 0, 10)
    assert run(b, tokens) == (10, 0, 0)
    assert b.stats.prefetched_tokens == 10 * PS and b.stats.computed_tokens == 0
    a.close()
    b.close()


def test_device_and_logical_prefixes_are_never_conflated(
    store: Callable[..., MemoryBackend],
) -> None:
    host = make_host(pages=32)
    c = new_cache(store(host), host, device_pages=8, prefetch_threshold=0)
    first, second = prompt(6 * PS, 1), prompt(6 * PS, 2)
    run(c, first)
    run(c, second)  # evicts most of the first prompt's device pages
    m = c.match_prefix(c.keys_of(first))
    assert m.device_pages < m.host_pages == 6 and m.logical_pages == 6
    assert c.stats.evicted_device_pages >= 4
    reused, ready, bad = run(c, first)
    assert (reused, bad) == (6, 0) and ready == m.device_pages
    c.close()


def test_write_back_reaches_storage_only_on_eviction(store: Callable[..., MemoryBackend]) -> None:
    host = make_host(pages=8)
    backend = store(host)
    c = new_cache(backend, host, device_pages=4, write_policy="write_back", prefetch_threshold=0)
    keys = c.keys_of(prompt(4 * PS, 3))
    run(c, prompt(4 * PS, 3))
    assert c.flush(10) and backend.batch_exists(keys) == 0  # nothing written yet
    assert c.index.match(keys).host_pages == 4
    for s in range(4, 9):  # other prompts push it off the device, then off the host
        run(c, prompt(4 * PS, s))
    assert c.flush(10)
    assert backend.batch_exists(keys) == 4
    assert c.stats.backup_failed_tokens == 0
    c.close()


def test_write_through_selective_waits_for_hits(store: Callable[..., MemoryBackend]) -> None:
    host = make_host()
    backend = store(host)
    c = new_cache(backend, host, write_policy="write_through_selective", selective_hits=2)
    tokens = prompt(3 * PS, 9)
    keys = c.keys_of(tokens)
    run(c, tokens)
    assert c.flush(10) and backend.batch_exists(keys) == 0
    run(c, tokens)  # second use
    assert c.flush(10) and backend.batch_exists(keys) == 3
    c.close()


def test_prefetch_threshold_and_rate_limit(store: Callable[..., MemoryBackend]) -> None:
    host_a, host_b = make_host(), make_host(pages=16)
    a = new_cache(store(host_a), host_a, prefetch_threshold=0)
    tokens = prompt(6 * PS, 11)
    run(a, tokens)
    a.flush(10)
    b = new_cache(store(host_b), host_b, prefetch_threshold=7 * PS)
    m = b.match_prefix(b.keys_of(tokens))
    assert m.logical_pages == 6 and b.prefetch(m) is None  # 24 tokens < 28
    c = new_cache(store(host_b), make_host(pages=16), prefetch_threshold=0,
                  prefetch_host_fraction=0.25, prefetch_policy="wait_complete")  # fmt: skip
    m = c.match_prefix(c.keys_of(tokens))
    op = c.prefetch(m)  # 6 pages hit, 4 may be held by prefetches: cut to 4
    assert op is not None and len(op.keys) == 4 and op.keys == m.keys[:4]
    assert c.prefetch(m) is None  # no room left while the first runs
    assert c.stats.prefetch_dropped == 1
    assert c.finish_prefetch(op) == 4
    assert c.finish_prefetch(op) == 0  # once per op
    assert c.index.match(m.keys).host_pages == 4
    assert all(c.index.entries[k].pins == 1 for k in m.keys[:4])  # held for the request
    c.release_prefetch(op)
    assert all(c.index.entries[k].pins == 0 for k in m.keys[:4])
    for x in (a, b, c):
        x.close()


def test_terminating_a_prefetch_keeps_the_pages_that_arrived(
    store: Callable[..., MemoryBackend],
) -> None:
    host_a, host_b = make_host(), make_host()
    a = new_cache(store(host_a), host_a)
    tokens = prompt(12 * PS, 12)
    run(a, tokens)
    a.flush(10)
    slow = LatencyBackend(store(host_b), latency=0.3)
    b = new_cache(slow, host_b, prefetch_threshold=0, batch_pages=3, io_workers=1,
                  prefetch_policy="timeout", prefetch_timeout_base=0.5,
                  prefetch_timeout_per_ki_token=0.0)  # fmt: skip
    keys = b.keys_of(tokens)
    m = b.match_prefix(keys)
    op = b.prefetch(m)
    assert op is not None
    taken = b.finish_prefetch(op)
    b.release_prefetch(op)
    assert 0 < taken < 12 and taken % 3 == 0
    assert b.stats.prefetch_terminated == 1
    assert b.index.match(keys).host_pages == taken
    assert op.wait(10)  # the batch that was running when the prefetch was cut
    assert host_b.available_size() == (32 - taken) * PS  # the rest went back
    reused, _, bad = run(b, tokens, prefetch=False)
    assert (reused, bad) == (taken, 0)
    a.close()
    b.close()


def test_a_failing_backend_degrades_to_misses_and_bounded_retries(
    store: Callable[..., MemoryBackend],
) -> None:
    host = make_host()
    broken = FaultyBackend(store(host), failure_rate=1.0, seed=1, partial=False)
    c = new_cache(broken, host, backup_retries=2, prefetch_threshold=0)
    tokens = prompt(5 * PS, 13)
    assert run(c, tokens) == (0, 0, 0)  # computed: the request did not fail
    assert c.flush(10)
    assert c.stats.backup_failed_tokens == 5 * PS
    assert c.stats.backup_retries == 2
    assert c.match_prefix(c.keys_of(prompt(5 * PS, 14))).logical_pages == 0
    assert c._backup_thread.is_alive()
    assert run(c, tokens)[0] == 5  # still served from the device and host
    c.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_loads_arrive_layer_by_layer_in_every_layout(layout: str, tmp_path: Path) -> None:
    host = make_host(layout=layout)
    ns = KVCacheNamespace.for_pool(host, model_id="tier-test")
    backend = FileBackend(StorageConfig(namespace=ns), root=str(tmp_path))
    c = new_cache(backend, host, device_pages=4, prefetch_threshold=0)
    first = prompt(3 * PS, 20)
    run(c, first)
    run(c, prompt(3 * PS, 21))  # first's pages leave the device, stay on the host
    keys = c.keys_of(first)
    lease = c.acquire(keys, filler(c, keys))
    assert lease.reused == 3 and lease.progress is not None
    for layer in range(host.layer_num):
        assert lease.progress.wait(layer, timeout=10)
    assert check_device(c, keys, lease.device_pages) == 0
    # The host copy is the same bytes, in the host layout.
    entry = c.index.entries[keys[0]]
    assert entry.host is not None
    for layer in range(host.layer_num):
        for half, t in enumerate(host_page_layer(host, entry.host, layer)):
            assert torch.equal(t, expected_kv(keys[0], tuple(t.shape), t.dtype, layer, half))
    c.release(lease)
    c.close()
    backend.close()


def test_concurrent_requests_on_two_threads(store: Callable[..., MemoryBackend]) -> None:
    host = make_host(pages=64)
    c = new_cache(store(host), host, device_pages=24, prefetch_threshold=0)
    errors: list[str] = []

    def worker(w: int) -> None:
        for s in range(6):
            _, _, bad = run(c, prompt(4 * PS, 100 + s % 3))
            if bad:
                errors.append(f"worker {w}: {bad} wrong pages")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    c.close()


def test_bad_config_is_refused() -> None:
    with pytest.raises(ConfigError):
        TierConfig(write_policy="write_sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TierConfig(prefetch_host_fraction=0)


def test_a_compute_that_fails_leaves_no_page_behind(store: Callable[..., MemoryBackend]) -> None:
    host = make_host()
    backend = store(host)
    c = new_cache(backend, host, prefetch_threshold=0)
    tokens = prompt(8 * PS, 30)
    keys = c.keys_of(tokens)
    good = filler(c, keys)

    def fails_at_page_3(i: int, page: int) -> None:
        if i == 3:
            c.device.page_layer(page, 0)[0].fill_(1.0)  # half-written, then the model fails
            raise RuntimeError("model failed")
        good(i, page)

    with pytest.raises(RuntimeError, match="model failed"):
        c.acquire(keys, fails_at_page_3)
    assert c.index.match(keys).host_pages == 0  # nothing looks filled
    assert all(e.pins == 0 for e in c.index.entries.values())
    assert c.device.free_pages == c.device.num_pages
    assert c.flush(10) and backend.batch_exists(keys) == 0  # nothing bad reached storage
    assert run(c, tokens)[2] == 0  # computed again, right
    c.close()


class LongResults:
    """A duck-typed store (no HiCacheStorage subclass, so no result checks) whose reads
    answer more bools than pages asked: the tier must use only its own batch's."""

    def __init__(self, inner: MemoryBackend) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def batch_get_v1(self, keys: list[str], idx: Any, extra: Any = None) -> list[bool]:
        return [*self.inner.batch_get_v1(keys, idx), True, True, True]


def test_a_store_answering_too_many_results_cannot_plant_pages(
    store: Callable[..., MemoryBackend],
) -> None:
    host_a, host_b = make_host(), make_host()
    a = new_cache(store(host_a), host_a, prefetch_threshold=0)
    tokens = prompt(6 * PS, 31)
    run(a, tokens)
    assert a.flush(10)
    inner = store(host_b)
    keys = a.keys_of(tokens)
    inner.delete(keys[3])  # the second batch misses its first page
    b = new_cache(LongResults(inner), host_b, prefetch_threshold=0, batch_pages=3,
                  prefetch_policy="wait_complete")  # fmt: skip
    op = b.prefetch(b.match_prefix(keys[:3] + keys[3:]))
    assert op is None or b.finish_prefetch(op) <= 3
    if op is not None:
        b.release_prefetch(op)
    reused, _, bad = run(b, tokens, prefetch=False)
    assert bad == 0 and reused <= 3
    a.close()
    b.close()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_device_pages_balance_after_many_requests(
    store: Callable[..., MemoryBackend], policy: str
) -> None:
    host = make_host(pages=48)
    c = new_cache(store(host), host, device_pages=12, write_policy=policy, prefetch_threshold=0)
    for s in range(30):
        assert run(c, prompt((3 + s % 4) * PS, 40 + s % 7))[2] == 0
    assert c.flush(10)
    on_device = sum(e.device is not None for e in c.index.entries.values())
    assert c.device.free_pages + on_device == 12
    assert all(e.pins == 0 for e in c.index.entries.values())
    c.close()


def test_a_full_pool_makes_a_request_wait_not_fail(store: Callable[..., MemoryBackend]) -> None:
    host = make_host(pages=64)
    c = new_cache(store(host), host, device_pages=10, prefetch_threshold=0)
    first = c.acquire(c.keys_of(prompt(6 * PS, 50)), lambda i, p: None)
    errors: list[str] = []

    def second() -> None:
        keys = c.keys_of(prompt(6 * PS, 51))
        try:
            c.release(c.acquire(keys, filler(c, keys), timeout=10))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(repr(exc))

    t = threading.Thread(target=second)
    t.start()
    t.join(0.3)
    assert t.is_alive()  # waiting for the first request's pages
    c.release(first)
    c.release(first)  # a second release does nothing
    t.join(10)
    assert errors == [] and not t.is_alive()
    with pytest.raises(ConfigError, match="cannot fit"):
        c.acquire(c.keys_of(prompt(11 * PS, 52)), lambda i, p: None)
    c.close()


def test_a_hung_store_bounds_the_request_and_close(store: Callable[..., MemoryBackend]) -> None:
    host_a, host_b = make_host(), make_host()
    a = new_cache(store(host_a), host_a, prefetch_threshold=0)
    tokens = prompt(6 * PS, 60)
    run(a, tokens)
    assert a.flush(10)
    slow = LatencyBackend(store(host_b), latency=1.5)
    b = new_cache(slow, host_b, prefetch_threshold=0, exists_timeout=0.2, close_timeout=0.3,
                  prefetch_policy="timeout", prefetch_timeout_base=0.2,
                  prefetch_timeout_per_ki_token=0.0)  # fmt: skip
    t0 = time.monotonic()
    reused, _, bad = run(b, tokens)  # the existence query times out: a miss, computed
    assert (reused, bad) == (0, 0)
    assert time.monotonic() - t0 < 1.4
    run(b, prompt(4 * PS, 61))  # a second request: its backup queues behind the first
    t0 = time.monotonic()
    b.close()  # the first backup is in flight on the slow store, the second still queued
    assert time.monotonic() - t0 < 1.4 + 1.6
    assert b.stats.backup_failed_tokens == 4 * PS  # the queued one, counted, not stored
    a.close()


def test_pages_another_request_reads_are_never_computed_over(
    store: Callable[..., MemoryBackend],
) -> None:
    """A request that recomputes past an agreed reuse limit gets pages of its own for the
    pages another live request holds; its failure cannot free or change those."""
    host = make_host()
    c = new_cache(store(host), host, prefetch_threshold=0)
    keys = c.keys_of(prompt(8 * PS, 70))
    b = c.acquire(keys, filler(c, keys))
    calls: list[int] = []

    def fails_late(i: int, page: int) -> None:
        calls.append(page)
        if len(calls) == 4:
            raise RuntimeError("model failed")
        filler(c, keys)(i, page)

    with pytest.raises(RuntimeError):
        c.acquire(keys, fails_late, reuse_limit=2)
    assert not set(calls) & set(b.device_pages)  # computed into pages of its own
    assert check_device(c, keys, b.device_pages) == 0  # b's pages untouched
    d = c.acquire(keys, filler(c, keys), reuse_limit=2)
    assert d.device_pages[:2] == b.device_pages[:2]
    assert not set(d.device_pages[2:]) & set(b.device_pages)
    assert check_device(c, keys, d.device_pages) == 0
    c.release(d)
    c.release(b)
    assert c.device.free_pages + sum(e.device is not None for e in c.index.entries.values()) == 16
    c.close()
    with pytest.raises(Exception, match="closed"):
        c.acquire(keys, filler(c, keys))


def test_waiting_for_a_page_being_filled_is_bounded(store: Callable[..., MemoryBackend]) -> None:
    host = make_host()
    c = new_cache(store(host), host, prefetch_threshold=0)
    keys = c.keys_of(prompt(2 * PS, 71))
    started, stop = threading.Event(), threading.Event()

    def slow(i: int, page: int) -> None:
        started.set()
        stop.wait(10)

    t = threading.Thread(target=lambda: c.release(c.acquire(keys, slow)))
    t.start()
    assert started.wait(5)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="busy"):
        c.acquire(keys, filler(c, keys), timeout=0.3)
    assert time.monotonic() - t0 < 2
    stop.set()
    t.join(10)
    c.close()


def test_a_hung_existence_query_does_not_stall_the_next(
    store: Callable[..., MemoryBackend],
) -> None:
    host = make_host()
    slow = LatencyBackend(store(host), latency=1.0)
    c = new_cache(slow, host, exists_timeout=0.1, prefetch_threshold=0)
    keys = c.keys_of(prompt(4 * PS, 72))
    t0 = time.monotonic()
    for _ in range(5):
        assert c.match_prefix(keys).logical_pages == 0
    assert time.monotonic() - t0 < 1.0  # one timeout, then misses at once while it hangs
    c.close()


class HungReads(WrapperBackend):
    """A store whose ``batch_get_v1`` does not return until the test lets it go."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.let_go = threading.Event()
        self.reads = 0

    @override
    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        self.reads += 1
        self.let_go.wait()
        return super().batch_get_v1(keys, host_indices, extra_info)


def test_a_prefetch_behind_a_hung_read_is_a_miss_at_once(
    store: Callable[..., MemoryBackend],
) -> None:
    host_a, host_b = make_host(), make_host()
    a = new_cache(store(host_a), host_a, prefetch_threshold=0)
    first, second = prompt(6 * PS, 80), prompt(6 * PS, 81)
    run(a, first)
    run(a, second)
    assert a.flush(10)
    hung = HungReads(store(host_b))
    b = new_cache(hung, host_b, prefetch_threshold=0, prefetch_policy="wait_complete",
                  prefetch_max_wait=0.5)  # fmt: skip
    try:
        op = b.prefetch(b.match_prefix(b.keys_of(first)))
        assert op is not None and b.finish_prefetch(op) == 0  # waited the cap once
        match = b.match_prefix(b.keys_of(second))
        assert match.logical_pages == 6  # the existence query still answers
        assert b.prefetch(match) is None  # the first read still hangs: a miss, no wait
        assert b.stats.prefetch_hung == 1 and hung.reads == 1
        tier = ("hicache-prefetch", "hicache-exists", "hicache-backup")
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith(tier))
        hung.let_go.set()
        assert op.wait(10)  # the store answers again: prefetches read again
        again = b.prefetch(match)
        assert again is not None and b.finish_prefetch(again) == 6
        b.release_prefetch(again)
    finally:
        hung.let_go.set()
        b.close()
        a.close()


HUNG_PROCESS = """
import threading

import torch

from hicache_storage import HostKVPool, KVCacheNamespace, StorageConfig
from hicache_storage.backends import MemoryBackend
from hicache_storage.tier import DevicePool, TierConfig, TieredCache
from hicache_storage.wrapper import WrapperBackend


class Hung(WrapperBackend):
    def batch_get_v1(self, keys, host_indices, extra_info=None):
        threading.Event().wait()  # never returns

    def batch_exists(self, keys, extra_info=None):
        if self.hang_exists:
            threading.Event().wait()
        return super().batch_exists(keys, extra_info)


def cache(hang_exists=False, hung=True):
    host = HostKVPool(num_pages=32, page_size=4, layer_num=2, kv_heads=2, head_dim=8,
                      dtype=torch.bfloat16, layout="page_first")
    backend = MemoryBackend(StorageConfig(namespace=KVCacheNamespace.for_pool(host, model_id="m")))
    if hung:
        backend = Hung(backend)
        backend.hang_exists = hang_exists
    config = TierConfig(prefetch_threshold=0, prefetch_policy="best_effort", exists_timeout=0.1)
    return TieredCache(backend, host, DevicePool(host, 16), config)


writer = cache(hung=False)
keys = writer.keys_of(list(range(24)))
writer.release(writer.acquire(keys, lambda i, page: None))
assert writer.flush(10)
reader = cache()  # reads hang
op = reader.prefetch(reader.match_prefix(keys))
assert op is not None
reader.finish_prefetch(op)
asker = cache(hang_exists=True)  # existence queries hang
assert asker.match_prefix(keys).logical_pages == 0
for c in (writer, reader, asker):
    c.close()
print("closed", flush=True)
"""


def test_a_process_with_hung_store_reads_exits_after_close(tmp_path: Path) -> None:
    """Threads stuck in a store never keep the interpreter alive (nor are they joined)."""
    script = tmp_path / "hung.py"
    script.write_text(textwrap.dedent(HUNG_PROCESS))
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["closed"]


class FailingReads(WrapperBackend):
    """A store whose ``batch_get_v1`` raises past the guard (an instance used after fork)."""

    @override
    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        raise NotSupportedError("this backend instance was created in another process")


def test_failing_prefetch_batches_are_logged_at_a_bounded_rate(
    store: Callable[..., MemoryBackend], caplog: pytest.LogCaptureFixture
) -> None:
    host_a, host_b = make_host(), make_host()
    a = new_cache(store(host_a), host_a, prefetch_threshold=0)
    tokens = prompt(6 * PS, 90)
    run(a, tokens)
    assert a.flush(10)
    b = new_cache(FailingReads(store(host_b)), host_b, prefetch_threshold=0, batch_pages=1,
                  prefetch_policy="wait_complete")  # fmt: skip
    match = b.match_prefix(b.keys_of(tokens))
    caplog.set_level(logging.WARNING, logger="hicache_storage.tier")
    t0 = time.monotonic()
    for _ in range(40):
        op = b.prefetch(match)
        assert op is not None and b.finish_prefetch(op) == 0
    elapsed = time.monotonic() - t0
    failures = b.stats.storage_errors
    logged = [r for r in caplog.records if r.name.startswith("hicache_storage.tier")]
    assert failures >= 40
    # At most one record per interval of the rate limiter (and one to start with).
    assert 1 <= len(logged) <= 1 + int(elapsed // RateLimitedLog().interval) + 1
    assert "prefetch batch failed" in logged[0].getMessage()
    b.close()
    a.close()


def test_admission_stores_a_page_only_from_its_nth_use(
    store: Callable[..., MemoryBackend],
) -> None:
    """``admit_after=2``: a prompt used once is not written to L3; its second use writes
    it; and with write-back, a page that leaves the host before it is admitted is dropped
    (counted), never written and never kept pinned."""
    host = make_host()
    backend = store(host)
    c = new_cache(backend, host, admit_after=2, prefetch_threshold=0)
    tokens = prompt(3 * PS, 21)
    keys = c.keys_of(tokens)
    run(c, tokens)
    assert c.flush(10) and backend.batch_exists(keys) == 0
    assert c.stats.bytes_written == 0
    run(c, tokens)
    assert c.flush(10) and backend.batch_exists(keys) == 3
    c.close()

    host = make_host(pages=8)
    backend = store(host)
    c = new_cache(
        backend, host, device_pages=4, write_policy="write_back", admit_after=2,
        prefetch_threshold=0,
    )  # fmt: skip
    once = c.keys_of(prompt(4 * PS, 30))
    run(c, prompt(4 * PS, 30))
    for s in range(31, 36):  # others push it off the device, then off the host
        run(c, prompt(4 * PS, s))
    assert c.flush(10)
    assert backend.batch_exists(once) == 0
    assert c.stats.not_admitted_pages >= 4
    assert c.index.match(once).host_pages == 0  # dropped, not held
    # A prompt used twice before it leaves is written on eviction as write-back does.
    twice = c.keys_of(prompt(4 * PS, 40))
    run(c, prompt(4 * PS, 40))
    run(c, prompt(4 * PS, 40))
    for s in range(41, 46):
        run(c, prompt(4 * PS, s))
    assert c.flush(10) and backend.batch_exists(twice) == 4
    assert c.stats.backup_failed_tokens == 0
    c.close()


def test_a_failed_existence_query_is_no_proof_a_page_is_gone(
    store: Callable[..., MemoryBackend],
) -> None:
    """The tier forgets that storage holds a page only when the store answered that it
    does not (a restarted store lost it): a query that failed leaves the pages it knows
    stored alone, so they are not written again; a real miss makes them written again."""
    host = make_host(pages=16)
    backend = store(host)
    c = new_cache(backend, host, device_pages=8, prefetch_threshold=0)
    p = prompt(4 * PS, 7)
    keys = c.keys_of(p)
    run(c, p)
    assert c.flush(10) and backend.batch_exists(keys) == 4
    for s in range(60, 66):  # push p off the device and the host (stored: evictable)
        run(c, prompt(4 * PS, s))
    assert c.flush(10) and c.index.match(keys).host_pages == 0
    written = c.stats.bytes_written
    real = backend.batch_exists

    def blip(ks: list[str], extra_info: object = None) -> int:
        raise RuntimeError("blip")

    backend.batch_exists = blip  # type: ignore[assignment]
    assert c.match_prefix(keys).logical_pages == 0  # a failed query: a miss
    backend.batch_exists = real  # type: ignore[method-assign]
    c.release(c.acquire(keys, filler(c, keys)))
    assert c.flush(10) and c.stats.bytes_written == written  # nothing written again
    # The store loses them (a restart): its answer clears the flag, and they are stored.
    for s in range(70, 76):
        run(c, prompt(4 * PS, s))
    backend.clear()
    assert c.match_prefix(keys).logical_pages == 0
    c.release(c.acquire(keys, filler(c, keys)))
    assert c.flush(10) and backend.batch_exists(keys) == 4
    c.close()
