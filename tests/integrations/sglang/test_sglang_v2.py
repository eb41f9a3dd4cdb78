"""SGLang's v2 pool transfers through the adapter: a hybrid model's pools in every backend.

The pools are SGLang's own host pool classes built on CPU (tests/workers/sglang_pools.py):
the KV pool and an SWA pool (``MHATokenToKVPoolHost``), a Mamba state pool
(``MambaPoolHost``), and a KV-indexed side pool (a draft model's KV: its own host pool,
read at the KV pool's indices). They are registered the way SGLang's
``HybridCacheController`` registers them, and moved with the transfers it builds: a
Mamba state per radix node (the node's last page), the node's trailing SWA pages, a
KV-indexed pool page for page. SGLang's own file backend (``HiCacheFile``) answers the
same calls beside the adapter, and the answers are compared.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_servers import backend_options
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang_pools import mamba_pool, mha_pool, mla_pool, page_bytes

from hicache_storage.errors import ConfigError
from hicache_storage.integrations.sglang import SGLangStorage

MODULE = "hicache_storage.integrations.sglang"
BACKENDS = ["file", "shm", "mmap", "memory", "redis", "s3", "mooncake", "nixl"]
TRAILING, ALL = PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES
PS = 4  # tokens per KV (and SWA) page


def config(extra: dict[str, Any], *, mla: bool = False, tp_rank: int = 0) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="acme/hybrid-test", extra_config=extra,
    )  # fmt: skip


def build(
    name: str, tmp_path: Path, *, mla: bool = False, tp_rank: int = 0, **options: Any
) -> SGLangStorage:
    extra = {"backend_name": name, "module_path": MODULE, "class_name": "SGLangStorage",
             "interface_v1": True, **backend_options(name, tmp_path), **options}  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", config(extra, mla=mla,
                                                   tp_rank=tp_rank), None)  # fmt: skip
    assert isinstance(backend, SGLangStorage)
    return backend


class Hybrid:
    """A hybrid model's host pools (KV, SWA, Mamba, a KV-indexed draft pool)."""

    def __init__(self, mla: bool = False, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.kv = mla_pool("page_first") if mla else mha_pool("page_first")
        self.swa = mha_pool("page_first", layers=2, heads=1)
        self.mamba = mamba_pool()
        self.draft = mha_pool("page_first", layers=1, heads=2, head_dim=8)
        self.pools = {PoolName.KV: self.kv, PoolName.SWA: self.swa,
                      PoolName.MAMBA: self.mamba, PoolName.DRAFT: self.draft}  # fmt: skip

    def attach(self, storage: Any) -> Any:
        """Register the pools as SGLang's HybridCacheController does."""
        storage.register_mem_pool_host(self.kv)
        for name, pool in self.pools.items():
            storage.register_mem_host_pool_v2(pool, name)
        storage.on_host_pools_registered()
        return storage

    def node(self, keys: list[str], kv_idx: torch.Tensor) -> list[PoolTransfer]:
        """A radix node's backup transfers: its Mamba state, its last two SWA pages
        (fresh host slots of each pool), its draft pages (at the KV indices)."""
        return [
            PoolTransfer(PoolName.MAMBA, host_indices=self.mamba.alloc(1), keys=keys[-1:],
                         hit_policy=TRAILING),
            PoolTransfer(PoolName.SWA, host_indices=self.swa.alloc(2 * PS), keys=keys[-2:],
                         hit_policy=TRAILING),
            PoolTransfer(PoolName.DRAFT, host_indices=kv_idx, keys=keys),
        ]  # fmt: skip


def pool_pages(pool: Any, indices: torch.Tensor) -> list[bytes]:
    ps = int(pool.page_size)
    return [page_bytes(pool, int(i)) for i in indices[::ps]]


def keys_of(n: int, salt: int = 0) -> list[str]:
    return [f"{salt:08x}{i:056x}" for i in range(1, n + 1)]


@pytest.mark.parametrize("name", BACKENDS)
def test_every_pool_round_trips_byte_exact(name: str, tmp_path: Path) -> None:
    src, dst = Hybrid(seed=1), Hybrid(seed=2)
    writer = src.attach(build(name, tmp_path))
    keys = keys_of(3, salt=7)
    kv_idx = src.kv.alloc(3 * PS)
    assert writer.batch_set_v1(keys, kv_idx) == [True] * 3
    transfers = src.node(keys, kv_idx)
    stored = writer.batch_set_v2(transfers)
    assert stored == {PoolName.MAMBA: [True], PoolName.SWA: [True, True],
                      PoolName.DRAFT: [True] * 3}  # fmt: skip
    reader = dst.attach(build(name, tmp_path))
    hit = reader.batch_exists_v2(keys, [
        PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING),
        PoolTransfer(PoolName.SWA, keys=["__placeholder__"] * 2, hit_policy=TRAILING),
        PoolTransfer(PoolName.DRAFT, keys=None),
    ])  # fmt: skip
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (3, [3])
    kv_dst = dst.kv.alloc(3 * PS)
    loads = [
        PoolTransfer(PoolName.MAMBA, host_indices=dst.mamba.alloc(1), keys=keys[-1:]),
        PoolTransfer(PoolName.SWA, host_indices=dst.swa.alloc(2 * PS), keys=keys[-2:]),
        PoolTransfer(PoolName.DRAFT, host_indices=kv_dst, keys=keys),
    ]
    got = reader.batch_get_v2(loads)
    assert got == stored
    for sent, came in zip(transfers, loads, strict=True):
        a, b = src.pools[sent.name], dst.pools[came.name]
        assert pool_pages(b, came.host_indices) == pool_pages(a, sent.host_indices), sent.name
    assert reader.batch_get_v1(keys, kv_dst) == [True] * 3
    assert pool_pages(dst.kv, kv_dst) == pool_pages(src.kv, kv_idx)
    writer.clear()
    writer.close()
    reader.close()


def test_a_page_of_one_pool_is_never_read_as_another_pools(tmp_path: Path) -> None:
    h = Hybrid()
    s = h.attach(build("file", tmp_path))
    keys = keys_of(2, salt=1)
    # The same keys, stored in the SWA pool only: no other pool finds them.
    assert s.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=h.swa.alloc(2 * PS),
                                        keys=keys)]) == {PoolName.SWA: [True, True]}  # fmt: skip
    got = s.batch_get_v2([
        PoolTransfer(PoolName.DRAFT, host_indices=h.kv.alloc(2 * PS), keys=keys),
        PoolTransfer(PoolName.MAMBA, host_indices=h.mamba.alloc(1), keys=keys[:1]),
    ])  # fmt: skip
    assert got == {PoolName.DRAFT: [False, False], PoolName.MAMBA: [False]}
    assert s.batch_get_v1(keys, h.kv.alloc(2 * PS)) == [False, False]  # nor the KV pool
    # A pool of another geometry under the same name (a different model config): apart.
    other = Hybrid()
    other.swa = mha_pool("page_first", layers=3, heads=1)
    other.pools[PoolName.SWA] = other.swa
    t = other.attach(build("file", tmp_path))
    assert t.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=other.swa.alloc(2 * PS),
                                        keys=keys)]) == {PoolName.SWA: [False, False]}  # fmt: skip
    s.close()
    t.close()


def test_transfers_with_wrong_indices_fail_and_nothing_moves(tmp_path: Path) -> None:
    h = Hybrid()
    s = h.attach(build("file", tmp_path))
    keys = keys_of(2, salt=2)
    before = h.swa.kv_buffer.view(torch.uint8).clone()  # (bytes: random bf16 has NaNs)
    bad = [
        PoolTransfer(PoolName.SWA, host_indices=h.swa.alloc(PS), keys=keys),  # one page short
        PoolTransfer(PoolName.SWA, host_indices=None, keys=keys),
        PoolTransfer(PoolName.INDEXER, host_indices=h.kv.alloc(2 * PS), keys=keys),  # unknown
    ]
    for t in bad:
        assert s.batch_get_v2([t]) == {t.name: [False, False]}
        assert s.batch_set_v2([t]) == {t.name: [False, False]}
    assert torch.equal(h.swa.kv_buffer.view(torch.uint8), before)
    s.close()


# --------------------------------------------------------------------------- hit policies


def store_kv(storage: Any, h: Hybrid, keys: list[str], kv_idx: torch.Tensor) -> None:
    """The KV pages by v1 (the adapter), or by SGLang's tensor path (HiCacheFile has no v1)."""
    if isinstance(storage, SGLangStorage):
        assert storage.batch_set_v1(keys, kv_idx) == [True] * len(keys)
    else:
        pages = [h.kv.get_data_page(int(i), flat=True) for i in kv_idx[::PS]]
        assert storage.batch_set(keys, pages) is True


def backup(storage: Any, h: Hybrid, keys: list[str], ends: list[int]) -> None:
    """Back up ``keys`` as radix nodes ending at each page count in ``ends``, as SGLang does:
    the KV pages by v1, then each node's side pools by v2."""
    start = 0
    for end in ends:
        node = keys[start:end]
        kv_idx = h.kv.alloc(len(node) * PS)
        store_kv(storage, h, node, kv_idx)
        out = storage.batch_set_v2(h.node(node, kv_idx))
        assert all(all(v) for v in out.values()), out
        start = end


def query(storage: Any, keys: list[str], pools: tuple[str, ...] = ("mamba", "swa", "draft")) -> Any:
    transfers = {
        "mamba": PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING),
        "swa": PoolTransfer(PoolName.SWA, keys=["__placeholder__"] * 2, hit_policy=TRAILING),
        "draft": PoolTransfer(PoolName.DRAFT, keys=None, hit_policy=ALL),
    }
    return storage.batch_exists_v2(keys, [transfers[p] for p in pools])


def answer(result: Any) -> tuple[int, dict[str, int], list[int]]:
    verdicts = {str(getattr(k, "value", k)): v for k, v in result.extra_pool_hit_pages.items()}
    return result.kv_hit_pages, verdicts, list(result.restorable_prefix_pages or [])


def sglang_file(tmp_path: Path, h: Hybrid) -> Any:
    """SGLang's own file backend over the same pools."""
    theirs = HiCacheFile(config({}), file_path=str(tmp_path / "hicache-file"))
    return h.attach(theirs)


def both(tmp_path: Path) -> tuple[Hybrid, list[Any]]:
    h = Hybrid()
    return h, [h.attach(build("file", tmp_path)), sglang_file(tmp_path, h)]


def test_a_state_is_usable_only_where_it_was_stored(tmp_path: Path) -> None:
    """Nodes of 3 and 6 pages: a Mamba/SWA state exists at 3 and 6 only, so a 5-page
    query restores 3 pages, a 6-page one 3 or 6; SGLang's HiCacheFile says the same."""
    h, stores = both(tmp_path)
    keys = keys_of(8, salt=3)
    for s in stores:
        backup(s, h, keys, [3, 6])
    for s in stores:
        assert answer(query(s, keys[:5])) == (3, {"kv": 5, "mamba": 3, "swa": 3, "draft": 5},
                                              [3])  # fmt: skip
        assert answer(query(s, keys[:6])) == (6, {"kv": 6, "mamba": 6, "swa": 6, "draft": 6},
                                              [3, 6])  # fmt: skip
        assert answer(query(s, keys)) == (6, {"kv": 6, "mamba": 6, "swa": 6, "draft": 6},
                                          [3, 6])  # fmt: skip
        assert answer(query(s, keys[:2])) == (0, {"kv": 2}, [])  # (no state: stops there)
        # The KV pool alone (no side transfers): its leading run, every length usable.
        assert answer(query(s, keys[:5], ())) == (5, {"kv": 5}, [1, 2, 3, 4, 5])
    for s in stores:
        getattr(s, "close", lambda: None)()  # (HiCacheFile has no close)


def test_a_missing_state_shortens_the_hit_to_the_last_restorable_length(tmp_path: Path) -> None:
    h, stores = both(tmp_path)
    keys = keys_of(9, salt=4)
    for s in stores:
        backup(s, h, keys[:3], [3])
        # The node 3..6 has its KV and draft pages, but its state never got stored.
        kv_idx = h.kv.alloc(3 * PS)
        store_kv(s, h, keys[3:6], kv_idx)
        s.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=kv_idx, keys=keys[3:6])])
    for s in stores:
        assert answer(query(s, keys[:6])) == (3, {"kv": 6, "mamba": 3, "swa": 3, "draft": 6},
                                              [3])  # fmt: skip
    for s in stores:
        getattr(s, "close", lambda: None)()  # (HiCacheFile has no close)


def test_a_missing_indexed_page_shortens_the_hit_to_that_page(tmp_path: Path) -> None:
    """An ALL_PAGES pool (a KV-indexed sidecar) cuts the hit at its first missing page."""
    h, stores = both(tmp_path)
    keys = keys_of(6, salt=5)
    for s in stores:
        kv_idx = h.kv.alloc(6 * PS)
        store_kv(s, h, keys, kv_idx)
        draft = PoolTransfer(PoolName.DRAFT, host_indices=torch.cat([kv_idx[: 2 * PS],
                             kv_idx[3 * PS :]]), keys=keys[:2] + keys[3:])  # fmt: skip
        assert s.batch_set_v2([draft]) == {PoolName.DRAFT: [True] * 5}
    for s in stores:
        assert answer(query(s, keys, ("draft",))) == (2, {"kv": 6, "draft": 2}, [1, 2])
    for s in stores:
        getattr(s, "close", lambda: None)()  # (HiCacheFile has no close)


def test_the_restorable_sets_of_two_ranks_intersect(tmp_path: Path) -> None:
    """Each TP rank keeps its own Mamba states: SGLang intersects the ranks' restorable
    lengths, so a length is a hit only where every rank stored its state."""
    ranks = [Hybrid(seed=r) for r in range(2)]
    stores = [h.attach(build("file", tmp_path, tp_rank=r)) for r, h in enumerate(ranks)]
    keys = keys_of(6, salt=6)
    backup(stores[0], ranks[0], keys, [3, 6])
    backup(stores[1], ranks[1], keys, [6])
    sets = [set(answer(query(s, keys, ("mamba",)))[2]) for s in stores]
    assert sets == [{3, 6}, {6}] and sets[0] & sets[1] == {6}
    for s in stores:
        getattr(s, "close", lambda: None)()  # (HiCacheFile has no close)


def test_mamba_states_are_per_rank_even_in_an_mla_model(tmp_path: Path) -> None:
    """MLA KV pages are one copy for every rank; a Mamba state is each rank's own."""
    ranks = [Hybrid(mla=True, seed=r) for r in range(2)]
    stores = [h.attach(build("file", tmp_path, mla=True, tp_rank=r)) for r, h in
              enumerate(ranks)]  # fmt: skip
    keys = keys_of(3, salt=8)
    backup(stores[0], ranks[0], keys, [3])
    kv_hit, verdicts, _ = answer(query(stores[1], keys, ("mamba",)))
    assert verdicts.get("kv") == 3  # rank 0's KV pages serve rank 1
    assert kv_hit == 0 and "mamba" not in verdicts  # rank 0's states do not
    for s in stores:
        getattr(s, "close", lambda: None)()  # (HiCacheFile has no close)


# --------------------------------------------------------------------------- SGLang's controller


def controller(storage: Any, h: Hybrid, v1: bool) -> Any:
    """SGLang's HybridCacheController over ``storage`` and ``h``'s pools, holding only what
    its storage methods read (no threads, no device, no process groups to sync)."""
    import queue

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

    def ident(i: int) -> int:
        return i

    group = HostPoolGroup([
        PoolEntry(PoolName.KV, h.kv, None, ident, is_primary_index_anchor=True),
        PoolEntry(PoolName.SWA, h.swa, None, ident),
        PoolEntry(PoolName.MAMBA, h.mamba, None, ident),
    ])  # fmt: skip
    c = HybridCacheController.__new__(HybridCacheController)
    c.storage_backend, c.mem_pool_host, c.storage_host_pool = storage, group, h.kv
    c.page_size, c.storage_config, c.storage_backend_type = PS, config({}), "dynamic"
    c.prefetch_hits_sync_groups, c.prefetch_completion_sync_groups = [], []
    c.prefetch_sync_queue, c.host_mem_release_queue = queue.Queue(), queue.Queue()
    c.extra_host_mem_release_queues = {}
    c.page_get_func = c._page_get_zero_copy if v1 else c._generic_page_get
    c.page_set_func = c._page_set_zero_copy if v1 else c._generic_page_set
    return c


def test_sglangs_controller_backs_up_queries_and_loads_a_hybrid_prefix(tmp_path: Path) -> None:
    """SGLang's own HybridCacheController code: two radix nodes backed up (3 and 6 pages),
    then prefetches of 5 and 6 pages. Ours and HiCacheFile give the same hits and the
    same loads, and ours lands the stored bytes of every pool."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        PrefetchOperation,
        StorageOperation,
    )
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    h = Hybrid(seed=9)
    tokens = list(range(6 * PS))
    keys = get_storage_hash_str(tokens, None, page_size=PS)
    kv_src = h.kv.alloc(6 * PS)
    node_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for end in (3, 6):
        node_states[end] = (h.mamba.alloc(1), h.swa.alloc(2 * PS))
    seen: list[Any] = []
    for storage, v1 in ((h.attach(build("file", tmp_path)), True),
                        (sglang_file(tmp_path, h), False)):  # fmt: skip
        c = controller(storage, h, v1)
        for start, end in ((0, 3), (3, 6)):
            mamba_idx, swa_idx = node_states[end]
            op = StorageOperation(
                kv_src[start * PS : end * PS], tokens[start * PS : end * PS],
                hash_value=keys[start:end], prefix_keys=None, pool_transfers=[
                    PoolTransfer(PoolName.MAMBA, host_indices=mamba_idx, keys=[keys[end - 1]],
                                 hit_policy=TRAILING),
                    PoolTransfer(PoolName.SWA, host_indices=swa_idx, keys=keys[end - 2 : end],
                                 hit_policy=TRAILING),
                ])  # fmt: skip
            c._page_backup(op)
            assert op.completed_tokens == (end - start) * PS
        runs = []
        for pages in (5, 6):
            op = PrefetchOperation(SimpleNamespace(rid=f"r{pages}"), tokens[: pages * PS], None,
                                   prefix_keys=None, pool_transfers=[
                PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING),
                PoolTransfer(PoolName.SWA, keys=["__placeholder__"] * 2, hit_policy=TRAILING),
            ])  # fmt: skip
            hashes, count = c._storage_hit_query(op)
            hit = c._sync_prefetch_hit_query(op, count)
            op.hash_value, op.storage_hit_count = hashes[: hit // PS], hit
            op.host_indices = h.kv.alloc(hit)
            op.pool_transfers[0].host_indices = h.mamba.alloc(1)
            op.pool_transfers[1].host_indices = h.swa.alloc(2 * PS)
            c._page_transfer(op)
            acks = []
            while not c.prefetch_sync_queue.empty():
                a = c.prefetch_sync_queue.get()
                hits = {str(k): v for k, v in (a.pool_hits or {}).items()}
                acks.append((a.completed_tokens, hits))
            runs.append((hit, acks, [list(t.keys) for t in op.pool_transfers]))
            # What landed is what the node that ends at the hit stored.
            mamba_idx, swa_idx = node_states[hit // PS]
            assert pool_pages(h.mamba, op.pool_transfers[0].host_indices) == pool_pages(
                h.mamba, mamba_idx
            )
            assert pool_pages(h.swa, op.pool_transfers[1].host_indices) == pool_pages(
                h.swa, swa_idx
            )
            assert pool_pages(h.kv, op.host_indices) == pool_pages(h.kv, kv_src[:hit])
        seen.append(runs)
        getattr(storage, "close", lambda: None)()
    ours, theirs = seen
    assert ours == theirs
    assert [r[0] for r in ours] == [3 * PS, 6 * PS]  # 5 pages: the state at 3 only
    assert all(acks[-1][1] == {"mamba": 1, "swa": 2} for _, acks, _ in ours)  # every page


# --------------------------------------------------------------------------- review round


def test_an_mla_models_undeclared_pools_are_shared_by_every_rank(tmp_path: Path) -> None:
    """In an MLA model SGLang backs up the indexer and DeepSeek's pools on rank 0 only:
    every rank must read them (a pool that says nothing of its heads follows the KV
    pool). A DeepSeek V4 compressed pool stands in for the indexer."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    def indexer() -> Any:
        rows = [torch.randint(0, 256, (10, 96), dtype=torch.uint8) for _ in range(3)]
        return DeepSeekV4PagedHostPool("deepseek_v4_c4", rows, 96, 9, PS, layout="page_first",
                                       device="cpu", pin_memory=False)  # fmt: skip

    stores, pools = [], []
    for rank in range(2):
        h = Hybrid(mla=True, seed=rank)
        h.pools = {PoolName.KV: h.kv, PoolName.INDEXER: indexer()}
        pools.append(h.pools[PoolName.INDEXER])
        stores.append(h.attach(build("file", tmp_path, mla=True, tp_rank=rank)))
    keys = keys_of(3, salt=10)
    kv_idx = torch.arange(3 * PS)
    assert stores[0].batch_set_v1(keys, kv_idx) == [True] * 3
    t = PoolTransfer(PoolName.INDEXER, host_indices=kv_idx, keys=keys)
    assert stores[0].batch_set_v2([t]) == {PoolName.INDEXER: [True] * 3}  # rank 0 only
    hit = stores[1].batch_exists_v2(keys, [PoolTransfer(PoolName.INDEXER, keys=None)])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (3, [1, 2, 3])
    dst = torch.arange(4 * PS, 7 * PS)
    got = stores[1].batch_get_v2([PoolTransfer(PoolName.INDEXER, host_indices=dst, keys=keys)])
    assert got == {PoolName.INDEXER: [True] * 3}
    assert pool_pages(pools[1], dst) == pool_pages(pools[0], kv_idx)
    for s in stores:
        s.close()


def test_side_pools_keep_the_kv_dtype_and_the_draft_apart() -> None:
    """fp8 formats are uint8 in every pool: the side namespace keeps the KV pool's logical
    dtype, so an e4m3 deployment's states are never an e5m2 one's; a draft checkpoint's
    identity keeps two drafts of one shape apart."""
    from hicache_storage.keys import KVCacheNamespace
    from hicache_storage.sidepools import side_namespace

    pool = mamba_pool()
    kv = {d: KVCacheNamespace(model_id="m", dtype=d, page_size=PS)
          for d in ("float8_e4m3fn", "float8_e5m2")}  # fmt: skip
    a, b = (side_namespace(ns, "mamba", pool)[0] for ns in kv.values())
    assert a.digest != b.digest and a.dtype == "float8_e4m3fn"
    draft = mha_pool("page_first", layers=1)
    x = side_namespace(kv["float8_e4m3fn"], "draft", draft, "org/draft-a@main")[0]
    y = side_namespace(kv["float8_e4m3fn"], "draft", draft, "org/draft-b@main")[0]
    assert x.digest != y.digest


def test_clear_removes_every_pools_pages(tmp_path: Path) -> None:
    """After clear() a state stored again is the new one (first writer wins: an old state
    left behind would have won)."""
    h = Hybrid()
    s = h.attach(build("file", tmp_path))
    keys = keys_of(1, salt=11)
    old, new = h.mamba.alloc(1), h.mamba.alloc(1)
    assert pool_pages(h.mamba, old) != pool_pages(h.mamba, new)
    assert s.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=old, keys=keys)]) == {
        PoolName.MAMBA: [True]
    }
    s.clear()
    assert s.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=new, keys=keys)]) == {
        PoolName.MAMBA: [True]
    }
    dst = h.mamba.alloc(1)
    s.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=dst, keys=keys)])
    assert pool_pages(h.mamba, dst) == pool_pages(h.mamba, new)
    s.close()
    with pytest.raises(ConfigError, match="after close"):  # (SGLang's attach fails)
        s.register_mem_host_pool_v2(h.swa, PoolName.SWA)
    assert s.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=h.swa.alloc(PS),
                                        keys=keys)]) == {PoolName.SWA: [False]}  # fmt: skip


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_deepseek_v4_compressed_pools_round_trip_in_every_layout(
    tmp_path: Path, layout: str
) -> None:
    """SGLang's DeepSeek V4 paged pool (uint8 rows per layer; in layer_first a list of
    per-layer tensors, so a page is one segment per layer)."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    def pool() -> Any:
        rows = [torch.randint(0, 256, (10, 96), dtype=torch.uint8) for _ in range(3)]
        return DeepSeekV4PagedHostPool("deepseek_v4_c4", rows, 96, 9, PS, layout=layout,
                                       device="cpu", pin_memory=False)  # fmt: skip

    stores, pools = [], []
    for seed in (1, 2):
        h = Hybrid(mla=True, seed=seed)
        h.pools = {PoolName.KV: h.kv, PoolName.DEEPSEEK_V4_C4: pool()}
        pools.append(h.pools[PoolName.DEEPSEEK_V4_C4])
        stores.append(h.attach(build("shm", tmp_path, mla=True)))
    keys = keys_of(2, salt=12)
    src, dst = torch.arange(PS, 3 * PS), torch.arange(5 * PS, 7 * PS)
    out = stores[0].batch_set_v2([PoolTransfer(PoolName.DEEPSEEK_V4_C4, host_indices=src,
                                               keys=keys)])  # fmt: skip
    assert out == {PoolName.DEEPSEEK_V4_C4: [True, True]}
    got = stores[1].batch_get_v2([PoolTransfer(PoolName.DEEPSEEK_V4_C4, host_indices=dst,
                                               keys=keys)])  # fmt: skip
    assert got == out
    assert pool_pages(pools[1], dst) == pool_pages(pools[0], src)
    for s in stores:
        s.close()


def test_a_kv_pool_with_no_bytes_is_refused_at_attach(tmp_path: Path) -> None:
    """DeepSeek V4's logical KV anchor holds no bytes: refused, with the reason."""
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    s = build("file", tmp_path, mla=True, kv_cache_dtype="fp8_e4m3")  # (its dtype: uint8)
    with pytest.raises(ConfigError, match="no host memory"):
        s.register_mem_pool_host(LogicalHostPool(32, PS))
    s.close()
