"""The adapter with SGLang's own host pools and SGLang's own controller code.

The pools are SGLang's ``MHATokenToKVPoolHost`` (in its four layouts) and
``MLATokenToKVPoolHost`` (three), built on CPU (tests/workers/sglang_pools.py). The
controller is SGLang's ``HiCacheController``: its storage methods (``_storage_hit_query``,
``_page_transfer``, ``_page_backup``, the zero-copy and the tensor page functions) run
unchanged on an instance that holds only what they read (the adapter, the host pool,
the page size, a queue), so the calls, batches and result handling are SGLang's own.
"""

from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_servers import backend_options
from sglang.srt.managers.cache_controller import (
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang_pools import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    controller,
    fill_random,
    first_indices,
    mha_pool,
    mla_pool,
    page_bytes,
    prompt,
    transfer,
)
from typing_extensions import override

from hicache_storage.errors import ConfigError, NamespaceMismatchError
from hicache_storage.integrations.sglang import SGLangStorage
from hicache_storage.protocol import HiCacheStorage
from hicache_storage.wrapper import WrapperBackend

MODULE = "hicache_storage.integrations.sglang"
BACKENDS = ["file", "shm", "mmap", "memory"]
KINDS = [(layout, False) for layout in MHA_LAYOUTS] + [(layout, True) for layout in MLA_LAYOUTS]
KIND_IDS = [f"{layout}-{'mla' if mla else 'mha'}" for layout, mla in KINDS]


def build(
    name: str, tmp_path: Path, *, v1: bool = True, mla: bool = False, tp_rank: int = 0,
    tp_size: int = 1, **options: Any,
) -> SGLangStorage:  # fmt: skip
    """The adapter, built by SGLang's own factory from the controller's kind of config."""
    extra = {"backend_name": name, "module_path": MODULE, "class_name": "SGLangStorage",
             "interface_v1": v1, **backend_options(name, tmp_path), **options}  # fmt: skip
    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=True, model_name="acme/pool-test", extra_config=extra,
    )  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert isinstance(backend, SGLangStorage)
    return backend


def pool_for(layout: str, mla: bool, **geometry: Any) -> Any:
    return mla_pool(layout, **geometry) if mla else mha_pool(layout, **geometry)


def pages_at(pool: Any, indices: torch.Tensor, page_size: int) -> list[bytes]:
    """The bytes of each page of ``indices``, by SGLang's tensor path."""
    return [page_bytes(pool, i) for i in first_indices(indices, page_size)]


# --------------------------------------------------------------------------- pages


@pytest.mark.parametrize(("layout", "mla"), KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("name", BACKENDS)
def test_sglangs_pools_round_trip_v1_byte_exact(
    name: str, layout: str, mla: bool, tmp_path: Path
) -> None:
    pool = pool_for(layout, mla)
    b = build(name, tmp_path, mla=mla)
    b.register_mem_pool_host(pool)
    ps = pool.page_size
    keys = [f"{i:064x}" for i in range(1, 9)]
    src, dst = pool.alloc(8 * ps), pool.alloc(8 * ps)
    want = [page_bytes(pool, i) for i in first_indices(src, ps)]
    before = pool.kv_buffer.view(-1).view(torch.uint8).clone()
    assert b.batch_set_v1(keys, src) == [True] * 8
    assert b.batch_exists([*keys, "f" * 64]) == 8
    assert b.batch_get_v1(keys, dst) == [True] * 8
    assert [page_bytes(pool, i) for i in first_indices(dst, ps)] == want
    # Only the destination pages changed.
    after = pool.kv_buffer.view(-1).view(torch.uint8)
    changed = (before != after).nonzero().view(-1).tolist()
    assert changed, "the destination pages held other random bytes before the read"
    inside: set[int] = set()
    base = pool.kv_buffer.data_ptr()
    ptrs, sizes = pool.get_page_buffer_meta(dst)
    for p, n in zip(ptrs, sizes, strict=True):
        inside.update(range(p - base, p - base + n))
    assert set(changed) <= inside
    # The stored object is the page as SGLang's tensor path sees it: one byte order.
    whole = b.get(keys[3])
    assert whole is not None and bytes(whole.view(torch.uint8).numpy()) == want[3]
    b.close()


@pytest.mark.parametrize(("layout", "mla"), KINDS, ids=KIND_IDS)
def test_the_tensor_path_and_v1_read_each_others_pages(
    layout: str, mla: bool, tmp_path: Path
) -> None:
    """A deployment that switches interface_v1 on or off keeps its pages (same namespace,
    same bytes): SGLang's tensor-path backup read back through v1, and the reverse."""
    pool = pool_for(layout, mla)
    tensor, v1 = build("file", tmp_path, v1=False, mla=mla), build("file", tmp_path, mla=mla)
    for b in (tensor, v1):
        b.register_mem_pool_host(pool)
    assert tensor.namespace_for(pool) == v1.namespace_for(pool)
    ps = pool.page_size
    src = pool.alloc(6 * ps)
    want = [page_bytes(pool, i) for i in first_indices(src, ps)]
    tokens, keys = prompt(6, ps)
    c_tensor, c_v1 = controller(tensor, pool, v1=False), controller(v1, pool)
    c_tensor._page_backup(StorageOperation(src[: 3 * ps], tokens[: 3 * ps], hash_value=keys[:3]))
    c_v1._page_backup(StorageOperation(src[3 * ps :], tokens[3 * ps :], hash_value=keys[3:]))
    for c in (c_tensor, c_v1):
        dst = pool.alloc(6 * ps)
        assert transfer(c, tokens, keys, dst) == 6
        assert pages_at(pool, dst, ps) == want
    tensor.close()
    v1.close()


# --------------------------------------------------------------------------- controller


class FailFrom(WrapperBackend):
    """Stores (``kind="set"``) or reads (``"get"``) the first ``ok`` pages it is asked
    for, through the page or the tensor path, then fails every page."""

    def __init__(self, inner: HiCacheStorage, kind: str, ok: int) -> None:
        super().__init__(inner)
        self.kind, self.left = kind, ok

    def _take(self, kind: str, n: int) -> int:
        if kind != self.kind:
            return n
        granted = max(0, min(self.left, n))
        self.left -= granted
        return granted

    def _pages(self, kind: str, keys: list[str], pages: Any) -> list[bool]:
        inner = getattr(self.inner, f"batch_{kind}_pages")
        n = self._take(kind, len(keys))
        head: list[bool] = inner(keys[:n], pages[:n]) if n else []
        return head + [False] * (len(keys) - n)

    @override
    def batch_get_pages(self, keys: list[str], pages: Any) -> list[bool]:
        return self._pages("get", keys, pages)

    @override
    def batch_set_pages(self, keys: list[str], pages: Any) -> list[bool]:
        return self._pages("set", keys, pages)

    @override
    def get(self, key: str, target: Any = None) -> Any:
        return self.inner.get(key, target) if self._take("get", 1) else None

    @override
    def set(self, key: str, value: Any) -> bool:
        return bool(self._take("set", 1)) and self.inner.set(key, value)

    @override
    def batch_get(self, keys: list[str], targets: Any = None) -> list[Any]:
        return [self.get(k, t) for k, t in zip(keys, targets or [None] * len(keys), strict=True)]

    @override
    def batch_set(self, keys: list[str], values: Any) -> list[bool]:
        return [self.set(k, v) for k, v in zip(keys, values, strict=True)]


def test_the_controllers_prefetch_and_backup_threads_on_one_adapter(tmp_path: Path) -> None:
    """SGLang's backup thread work (3 batches of up to 128 pages) and its prefetch thread
    work (existence query stopping at the first miss, then the transfer) run at once on
    one adapter; every page the prefetch loads is the page that was backed up."""
    pool = mha_pool("page_first", device_tokens=2400, ratio=1.0)  # 600 pages
    b = build("file", tmp_path)
    b.register_mem_pool_host(pool)
    ps, n = pool.page_size, 300
    assert n > 2 * STORAGE_BATCH_SIZE
    tokens, keys = prompt(n, ps)
    src = pool.alloc(n * ps)
    want = [page_bytes(pool, i) for i in first_indices(src, ps)]
    c = controller(b, pool)
    errors: list[str] = []
    loaded: list[int] = []
    backup = StorageOperation(src, tokens, hash_value=keys)

    backed_up = threading.Event()

    def prefetch() -> None:
        dst = pool.alloc(n * ps)
        last = False
        while not last:  # until a pass that started after the backup had finished
            last = backed_up.is_set()
            op = PrefetchOperation("req", tokens)
            hashes, hit_tokens = c._storage_hit_query(op)
            if hit_tokens != len(hashes) * ps or hashes != keys[: len(hashes)]:
                errors.append(f"hit query: {hit_tokens} tokens for {len(hashes)} keys")
            op.hash_value, op.host_indices = hashes, dst[: len(hashes) * ps]
            got = c._page_transfer(op)
            loaded.append(got)
            for i, first in enumerate(first_indices(dst[: got * ps], ps)):
                if page_bytes(pool, first) != want[i]:
                    errors.append(f"page {i} loaded wrong bytes")

    def run_backup() -> None:
        try:
            c._page_backup(backup)
        finally:
            backed_up.set()

    t_backup = threading.Thread(target=run_backup)
    t_prefetch = threading.Thread(target=prefetch)
    t_backup.start()
    t_prefetch.start()
    t_backup.join()
    t_prefetch.join()
    assert errors == []
    assert backup.completed_tokens == n * ps
    assert loaded == sorted(loaded) and loaded[-1] == n  # the leading run only grows
    op = PrefetchOperation("req", tokens)
    assert c._storage_hit_query(op) == (keys, n * ps)
    # SGLang's prefetch acks: one per batch of each transfer, then the counts it saw.
    acks = []
    while not c.prefetch_sync_queue.empty():
        acks.append(c.prefetch_sync_queue.get())
    assert acks and all(a.completed_tokens % ps == 0 for a in acks)
    b.close()


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "tensor"])
def test_a_backend_failing_mid_batch(v1: bool, tmp_path: Path) -> None:
    """Page 200 of 300 on (the second batch): SGLang's backup stops after the first batch
    it saw fail, the existence query stops at the first page not stored, and a prefetch
    whose reads fail from page 150 loads exactly the 150 pages before it, byte-exact."""
    pool = mha_pool("page_first_direct", device_tokens=2400, ratio=1.0)
    b = build("memory", tmp_path, v1=v1)
    b.register_mem_pool_host(pool)
    ps, n = pool.page_size, 300
    tokens, keys = prompt(n, ps, seed=1)
    src = pool.alloc(n * ps)
    want = [page_bytes(pool, i) for i in first_indices(src, ps)]
    assert b.backend is not None
    b.backend = FailFrom(b.backend, "set", ok=200)
    c = controller(b, pool, v1=v1)
    backup = StorageOperation(src, tokens, hash_value=keys)
    c._page_backup(backup)
    assert backup.completed_tokens == STORAGE_BATCH_SIZE * ps  # batch 2 failed: stop
    assert c._storage_hit_query(PrefetchOperation("req", tokens)) == (keys[:200], 200 * ps)
    b.backend = FailFrom(b.backend.inner, "get", ok=150)
    dst = pool.alloc(200 * ps)
    assert transfer(c, tokens, keys[:200], dst) == 150
    assert pages_at(pool, dst[: 150 * ps], ps) == want[:150]
    b.close()


def test_mla_writer_election_and_direct_calls_on_every_rank(tmp_path: Path) -> None:
    """SGLang's controller backs up MLA pages from the elected writer only
    (``is_storage_writer``); every rank reads them, and a rank that is not the writer
    still stores pages when called directly."""
    pools = [mla_pool("page_first"), mla_pool("page_first")]
    ranks = [build("file", tmp_path, mla=True, tp_rank=r, tp_size=2) for r in (0, 1)]
    for b, pool in zip(ranks, pools, strict=True):
        b.register_mem_pool_host(pool)
    ctrls = [controller(b, pool) for b, pool in zip(ranks, pools, strict=True)]
    assert [c.storage_config.is_storage_writer for c in ctrls] == [True, False]
    ps = pools[0].page_size
    tokens, keys = prompt(4, ps, seed=2)
    src = [pool.alloc(4 * ps) for pool in pools]
    pools[1].kv_buffer.view(-1).copy_(pools[0].kv_buffer.view(-1))  # MLA: same on every rank
    want = [page_bytes(pools[0], i) for i in first_indices(src[0], ps)]
    ops = [StorageOperation(s, tokens, hash_value=keys) for s in src]
    for c, op in zip(ctrls, ops, strict=True):
        if not c.backup_skip:  # SGLang's backup thread does exactly this
            c._page_backup(op)
    assert [op.completed_tokens for op in ops] == [4 * ps, 0]
    dst = pools[1].alloc(4 * ps)
    assert transfer(ctrls[1], tokens, keys, dst) == 4  # rank 1 reads rank 0's pages
    assert pages_at(pools[1], dst, ps) == want
    more = [f"{i:064x}" for i in range(100, 102)]
    assert ranks[1].batch_set_v1(more, src[1][: 2 * ps]) == [True, True]
    assert ranks[0].batch_exists(more) == 2
    for b in ranks:
        b.close()


@pytest.mark.parametrize("config_mla", [True, False])
def test_a_pool_that_contradicts_is_mla_model_fails_the_attach(
    config_mla: bool, tmp_path: Path
) -> None:
    """MLA-ness comes from the pool, not from SGLang's config: an MHA pool at TP 2 under
    ``is_mla_model=True`` would be one replicated namespace, and rank 1 would load rank
    0's heads as a hit. Both contradictions fail the attach; nothing is stored."""
    pool = mha_pool("page_first") if config_mla else mla_pool("page_first")
    b = build("file", tmp_path, mla=config_mla, tp_rank=1, tp_size=2)
    with pytest.raises(NamespaceMismatchError, match="is_mla_model"):
        b.register_mem_pool_host(pool)
    assert b.backend is None
    assert b.batch_exists([f"{1:064x}"]) == 0
    b.close()


class Hung(WrapperBackend):
    """``inner`` whose existence queries, clears and closes wait for ``release``."""

    def __init__(self, inner: HiCacheStorage) -> None:
        super().__init__(inner)
        self.release = threading.Event()

    @override
    def batch_exists(self, keys: list[str], extra_info: object = None) -> int:
        self.release.wait()
        return self.inner.batch_exists(keys)

    @override
    def clear(self) -> None:
        self.release.wait()
        self.inner.clear()


def test_sglangs_scheduler_and_hit_queries_never_wait_past_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that hangs: SGLang's hit query is a miss after the deadline, and at once
    while it still hangs; a clear returns; an attach that hangs returns, and the backend
    is installed when it attaches (or closed, if the adapter was closed meanwhile)."""
    pool = mha_pool("page_first")
    b = build("file", tmp_path, engine_timeout=0.3)
    b.register_mem_pool_host(pool)
    ps = pool.page_size
    tokens, keys = prompt(4, ps, seed=9)
    src = pool.alloc(4 * ps)
    assert b.batch_set_v1(keys, src) == [True] * 4
    c = controller(b, pool)
    assert c._storage_hit_query(PrefetchOperation("req", tokens)) == (keys, 4 * ps)
    assert b.backend is not None
    hung = Hung(b.backend)
    b.backend = hung
    assert hung.circuit == "closed"
    assert c._storage_hit_query(PrefetchOperation("req", tokens))[1] == 0
    assert b.exists(keys[0]) is False and b.batch_exists(keys) == 0  # at once: still hung
    assert hung.circuit == "closed"  # (3 failures so far: the default opens at 5)
    assert b.batch_exists(keys) == 0 and b.batch_exists(keys) == 0
    # The deadline passed and the queries refused while it hangs count against the
    # store's read breaker: it opens, so SGLang's prefetch reads answer at once too.
    assert hung.circuit == "open"
    assert hung.get_stats(reset=False).breaker_opens == 1
    b.clear()  # returns after the deadline; the clear goes on once the store answers
    hung.release.set()
    hung.inner.close()

    import hicache_storage.integrations.sglang as adapter
    from hicache_storage.registry import create_backend

    forever = threading.Event()
    monkeypatch.setattr(
        adapter, "create_backend", lambda *a, **k: (forever.wait(), create_backend(*a, **k))[1]
    )
    # An attach that hangs returns (SGLang, which attaches at start on its scheduler
    # thread, runs on with misses), and the backend is installed once it attaches.
    b2 = build("file", tmp_path, engine_timeout=0.3)
    b2.register_mem_pool_host(mha_pool("page_first"))
    assert b2.backend is None and b2.batch_exists(keys) == 0
    forever.set()

    def attached() -> bool:
        return b2.backend is not None

    for _ in range(1000):
        if attached():
            break
        time.sleep(0.01)
    assert attached() and b2.batch_exists(keys) == 4  # the pages stored above
    b2.close()
    # Closed (or attached again) before the late attach ends: what it built is closed.
    forever.clear()
    built: list[HiCacheStorage] = []

    def slow(*a: Any, **k: Any) -> HiCacheStorage:
        forever.wait()
        built.append(create_backend(*a, **k))
        return built[-1]

    monkeypatch.setattr(adapter, "create_backend", slow)
    b3 = build("file", tmp_path, engine_timeout=0.3)
    b3.register_mem_pool_host(mha_pool("page_first"))
    b3.close()
    forever.set()
    for _ in range(1000):
        if built and built[0].closed:
            break
        time.sleep(0.01)
    assert built and built[0].closed and b3.backend is None


def test_the_adapters_own_options_are_checked(tmp_path: Path) -> None:
    for value in (-1, "soon", float("nan"), 1e10):  # (1e10: past what a wait can take)
        with pytest.raises(ConfigError, match="engine_timeout"):
            build("file", tmp_path, engine_timeout=value)
    # null is unset, as it was before the options were checked
    b = build("file", tmp_path, tenant=None, weights_fingerprint=None, engine_timeout=None)
    assert (b.options.tenant, b.options.engine_timeout) == ("", 5.0)


# --------------------------------------------------------------------------- v2 and stats


def test_v2_moves_the_kv_pool_through_v1(tmp_path: Path) -> None:
    """The KV pool's transfers are v1 calls (the side pools: test_sglang_v2.py)."""
    pool = mha_pool("page_head")
    b = build("shm", tmp_path)
    b.register_mem_pool_host(pool)
    b.register_mem_host_pool_v2(pool, PoolName.KV)
    b.on_host_pools_registered()
    ps = pool.page_size
    keys = [f"{i:064x}" for i in range(1, 4)]
    src, dst = pool.alloc(3 * ps), pool.alloc(3 * ps)
    want = [page_bytes(pool, i) for i in first_indices(src, ps)]
    out = b.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=src, keys=keys)])
    assert out == {PoolName.KV: [True] * 3}
    hit = b.batch_exists_v2([*keys, "f" * 64])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (3, [1, 2, 3])
    assert hit.extra_pool_hit_pages == {PoolName.KV: 3}
    got = b.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=dst, keys=keys)])
    assert got == {PoolName.KV: [True] * 3}
    assert [page_bytes(pool, i) for i in first_indices(dst, ps)] == want
    assert b.batch_get_v2("not transfers") == {}  # malformed: a failure, not an exception
    assert b.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys)]) == {
        PoolName.KV: [False] * 3
    }  # (no host indices)
    b.close()


def test_sglangs_pool_gives_the_namespace_its_facts(tmp_path: Path) -> None:
    """Page size, dtype, layout, heads and layer range come from SGLang's pool."""
    pool = mha_pool("page_head", heads=4, page_size=8, dtype=torch.float16, start_layer=5,
                    device_tokens=128)  # fmt: skip
    b = build("memory", tmp_path, tp_size=2)
    ns = b.namespace_for(pool)
    assert (ns.page_size, ns.dtype, ns.object_layout) == (8, "float16", "page_head")
    assert (ns.total_kv_heads, ns.kv_heads_per_shard, ns.layer_range) == (8, 4, (5, 8))
    b.register_mem_pool_host(pool)
    src = pool.alloc(16)
    assert b.batch_set_v1(["a" * 64, "b" * 64], src) == [True, True]
    m = b.get_stats()
    assert m.backup_pgs == [2] and m.backup_bandwidth[0] > 0  # SGLang pool's page size read
    b.close()


def test_pointer_form_against_sglangs_pool(tmp_path: Path) -> None:
    pool = mha_pool("page_first")
    b = build("memory", tmp_path)
    b.register_mem_pool_host(pool)
    src, dst = pool.alloc(pool.page_size), pool.alloc(pool.page_size)
    ptrs_src, sizes = pool.get_page_buffer_meta(src)
    ptrs_dst, _ = pool.get_page_buffer_meta(dst)
    assert ctypes.string_at(ptrs_dst[0], sizes[0]) != ctypes.string_at(ptrs_src[0], sizes[0])
    assert b.set("k", None, ptrs_src[0], sizes[0]) is True
    assert b.get("k", ptrs_dst[0], sizes[0]) == ptrs_dst[0]
    assert ctypes.string_at(ptrs_dst[0], sizes[0]) == ctypes.string_at(ptrs_src[0], sizes[0])
    end = pool.kv_buffer.data_ptr() + pool.kv_buffer.nbytes
    assert b.get("k", end - 8, sizes[0]) is None  # would run past the pool's end
    b.close()


# --------------------------------------------------------------------------- review round


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_host_indices_outside_sglangs_pool_fail_and_touch_nothing(
    layout: str, tmp_path: Path
) -> None:
    """SGLang's get_page_buffer_meta computes addresses from any indices it is given; the
    adapter checks them: past the pool's end, not page-aligned, or not whole pages, the
    call fails, nothing is stored, nothing in the pool changes."""
    pool = mha_pool(layout)
    b = build("memory", tmp_path)
    b.register_mem_pool_host(pool)
    ps, size = pool.page_size, pool.size
    before = pool.kv_buffer.view(-1).view(torch.uint8).clone()
    good = pool.alloc(ps)
    key = "c" * 64
    assert b.batch_set_v1([key], good) == [True]
    bad = {
        "past the end": torch.arange(size, size + ps),
        "unaligned": torch.arange(size - ps - 2, size - 2),
        "not a run": torch.tensor([0, 1, 2, 5] if ps == 4 else list(range(ps))[::-1]),
        "part of a page": torch.arange(0, ps - 1),
    }
    for what, idx in bad.items():
        assert b.batch_set_v1([f"{len(what):064x}"], idx) == [False], what
        assert b.batch_get_v1([key], idx) == [False], what
    assert b.batch_exists([f"{len(w):064x}" for w in bad]) == 0
    assert torch.equal(pool.kv_buffer.view(-1).view(torch.uint8), before)
    b.close()


def _mha_info(layers: int, tokens: int = 64) -> MHABufferInfo:
    k = tuple(torch.zeros(tokens, 2, 16, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(tokens, 2, 16, dtype=torch.bfloat16) for _ in range(layers))
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64) for ts in (k, v)]
    return MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1],
                          layout=KVBufferLayout.NHD),
        page_size=4, head_num=2, head_dim=16, v_head_dim=16, dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )  # fmt: skip


def test_a_draft_models_layers_get_their_own_namespace(tmp_path: Path) -> None:
    """Speculative decoding packs the draft model's layers into the host pool: its pages
    are other bytes than the same model's without a draft."""
    pools = [
        fill_random(
            MHATokenToKVPoolHost(
                _mha_info(3),
                host_to_device_ratio=2.0,
                host_size=0,
                page_size=4,
                layout="page_first",
                pin_memory=False,
                device="cpu",
                device_capacity_tokens=64,
                start_layer=0,
                end_layer=3,
                draft_buffer_infos=tuple(_mha_info(1) for _ in range(d)),
            ),
            seed=d,
        )
        for d in (0, 1)
    ]
    assert [p.layer_num for p in pools] == [3, 4]
    plain, spec = build("file", tmp_path), build("file", tmp_path)
    assert plain.namespace_for(pools[0]) != spec.namespace_for(pools[1])
    plain.register_mem_pool_host(pools[0])
    spec.register_mem_pool_host(pools[1])
    keys = [f"{i:064x}" for i in range(1, 3)]
    assert plain.batch_set_v1(keys, pools[0].alloc(8)) == [True, True]
    assert spec.batch_exists(keys) == 0
    src = pools[1].alloc(8)
    assert spec.batch_set_v1(keys, src) == [True, True]  # stored, not blocked
    dst = pools[1].alloc(8)
    assert spec.batch_get_v1(keys, dst) == [True, True]
    assert page_bytes(pools[1], int(dst[0])) == page_bytes(pools[1], int(src[0]))
    plain.close()
    spec.close()


def test_a_pool_without_one_kv_buffer_fails_the_attach(tmp_path: Path) -> None:
    """SGLang's K-only and split-buffer pools keep no single kv_buffer tensor (the MLA
    pool's split form sets it to None): their pages could not be bounds-checked."""
    pool = mha_pool("page_first")
    pool.kv_buffer = None
    b = build("memory", tmp_path)
    with pytest.raises(ConfigError, match="kv_buffer"):
        b.register_mem_pool_host(pool)
    assert b.backend is None
    b.close()


def _dcp_pool(layout: str) -> Any:
    """SGLang's MLA pool of one decode-context-parallel rank (2 ranks): it holds
    page_size / 2 tokens of each 8-token logical page."""
    layers, width = 3, 24
    bufs = tuple(torch.zeros(64, 1, width, dtype=torch.bfloat16) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=8,
        kv_lora_rank=16, qk_rope_head_dim=8, kv_cache_dim=width, dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )  # fmt: skip
    return fill_random(MLATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=8, layout=layout,
        pin_memory=False, device="cpu", device_capacity_tokens=64, start_layer=0,
        end_layer=layers, target_layer_num=layers, dcp_size=2, dcp_rank=1,
    ))  # fmt: skip


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_decode_context_parallel_pools_use_the_tensor_path(layout: str, tmp_path: Path) -> None:
    """With dcp_size > 1 SGLang's zero-copy metadata counts physical pages while the
    controller's host indices count logical ones: v1 fails the attach (naming the way
    out), and the tensor path backs up and prefetches byte-exact."""
    pool = _dcp_pool(layout)
    assert pool.logical_page_size == 8 and pool.page_size == 4
    v1 = build("memory", tmp_path, mla=True)
    v1.storage_config.dcp_rank, v1.storage_config.dcp_size = 1, 2
    with pytest.raises(ConfigError, match="interface_v1 to false"):
        v1.register_mem_pool_host(pool)
    b = build("memory", tmp_path, v1=False, mla=True)
    b.storage_config.dcp_rank, b.storage_config.dcp_size = 1, 2
    b.register_mem_pool_host(pool)
    c = controller(b, pool, v1=False)
    c.page_size = lps = pool.logical_page_size  # SGLang's controller counts logical pages
    src = pool.alloc(3 * lps)
    tokens, keys = prompt(3, lps)
    want = [page_bytes(pool, i) for i in first_indices(src, lps)]
    op = StorageOperation(src, tokens, hash_value=keys)
    c._page_backup(op)
    assert op.completed_tokens == 3 * lps
    dst = pool.alloc(3 * lps)
    assert transfer(c, tokens, keys, dst) == 3
    assert pages_at(pool, dst, lps) == want
    v1.close()
    b.close()
