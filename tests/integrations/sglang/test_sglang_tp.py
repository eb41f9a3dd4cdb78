"""Pages shared across TP sizes through the adapter, with SGLang's own MHA host pools.

A deployment at one TP size writes pages through the adapter (SGLang's config with
``tp_lcm_size``, the adapter built by SGLang's factory); a deployment at another TP size
reads them, through SGLang's own controller transfer, and gets its heads byte for byte,
in every MHA layout and on every local backend. The ranks of one engine agree on their
writer id through ``torch.distributed`` in SGLang; here, engine-free, the config names it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_servers import backend_options
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang_pools import (
    MHA_LAYOUTS,
    controller,
    mamba_pool,
    mha_pool,
    page_bytes,
    prompt,
    transfer,
)

from hicache_storage.errors import ConfigError
from hicache_storage.headgroups import HeadGroupStore
from hicache_storage.integrations.sglang import SGLangStorage

MODULE = "hicache_storage.integrations.sglang"
HEADS, PS, PAGES = 4, 4, 6
HEAD_AXIS = {"layer_first": 3, "page_first": 3, "page_first_direct": 4, "page_head": 2}


def adapter(name: str, tmp_path: Path, tp_rank: int, tp_size: int, lcm: int,
            writer: str, v1: bool = True, **more: Any) -> SGLangStorage:  # fmt: skip
    extra = {"backend_name": name, "module_path": MODULE, "class_name": "SGLangStorage",
             "interface_v1": v1, "writer_id": writer, **backend_options(name, tmp_path),
             **more}  # fmt: skip
    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=True, model_name="acme/tp-share", extra_config=extra,
        tp_lcm_size=lcm, should_split_heads=lcm > tp_size,
    )  # fmt: skip
    storage = StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert isinstance(storage, SGLangStorage)
    return storage


def rank_pool(layout: str, tp_rank: int, tp_size: int, model: Any | None) -> Any:
    per = HEADS // tp_size
    pool = mha_pool(layout, heads=per, device_tokens=PAGES * PS, ratio=1.0)
    if model is not None:
        pool.kv_buffer.copy_(model.kv_buffer.narrow(HEAD_AXIS[layout], tp_rank * per, per))
    else:
        pool.kv_buffer.zero_()
    return pool


def deployment(name: str, tmp_path: Path, layout: str, tp: int, model: Any | None,
               writer: str, v1: bool = True) -> list[tuple[SGLangStorage, Any]]:  # fmt: skip
    out = []
    for r in range(tp):
        storage = adapter(name, tmp_path, r, tp, 4, writer, v1)
        pool = rank_pool(layout, r, tp, model)
        storage.register_mem_pool_host(pool)
        out.append((storage, pool))
    return out


@pytest.mark.parametrize("name", ["file", "shm", "mmap", "memory"])
@pytest.mark.parametrize("layout", MHA_LAYOUTS)
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 4), (4, 2)])
def test_a_page_written_at_one_tp_size_loads_at_another(
    tmp_path: Path, name: str, layout: str, writer_tp: int, reader_tp: int
) -> None:
    model = mha_pool(layout, heads=HEADS, device_tokens=PAGES * PS, ratio=1.0)
    tokens, keys = prompt(PAGES, PS)
    idx = torch.arange(PAGES * PS)
    writers = deployment(name, tmp_path, layout, writer_tp, model, "deploy-a")
    for storage, _ in writers:
        assert isinstance(storage.backend, HeadGroupStore)
        assert storage.batch_set_v1(keys, idx) == [True] * PAGES
    readers = deployment(name, tmp_path, layout, reader_tp, None, "deploy-b")
    for r, (storage, pool) in enumerate(readers):
        assert storage.batch_exists(keys) == PAGES
        loaded = transfer(controller(storage, pool), tokens, keys, idx)  # SGLang's own code
        assert loaded == PAGES
        want = rank_pool(layout, r, reader_tp, model)
        assert [page_bytes(pool, i) for i in range(0, PAGES * PS, PS)] == [
            page_bytes(want, i) for i in range(0, PAGES * PS, PS)
        ]
    for storage, _ in writers + readers:
        storage.close()


def test_one_pages_heads_from_two_deployments_are_never_joined(tmp_path: Path) -> None:
    layout = "page_head"
    a = mha_pool(layout, heads=HEADS, device_tokens=PAGES * PS, ratio=1.0)
    b = mha_pool(layout, heads=HEADS, device_tokens=PAGES * PS, ratio=1.0)
    b.kv_buffer.add_(1)
    _, keys = prompt(PAGES, PS)
    idx = torch.arange(PAGES * PS)
    (a0, _), _ = deployment("file", tmp_path, layout, 2, a, "deploy-a")
    _, (b1, _) = deployment("file", tmp_path, layout, 2, b, "deploy-b")
    assert a0.batch_set_v1(keys, idx) == [True] * PAGES  # heads 0-1, from A
    assert b1.batch_set_v1(keys, idx) == [True] * PAGES  # heads 2-3, from B
    [(reader, _)] = deployment("file", tmp_path, layout, 1, None, "deploy-c")
    assert reader.batch_exists(keys) == PAGES
    assert reader.batch_get_v1(keys, idx) == [False] * PAGES


def test_without_tp_lcm_size_each_size_keeps_its_own_pages(tmp_path: Path) -> None:
    _, keys = prompt(PAGES, PS)
    idx = torch.arange(PAGES * PS)
    model = mha_pool("page_head", heads=HEADS, device_tokens=PAGES * PS, ratio=1.0)
    for r in range(2):
        storage = adapter("file", tmp_path, r, 2, 0, "a")
        storage.register_mem_pool_host(rank_pool("page_head", r, 2, model))
        assert not isinstance(storage.backend, HeadGroupStore)
        assert storage.batch_set_v1(keys, idx) == [True] * PAGES
    reader = adapter("file", tmp_path, 0, 1, 0, "b")
    reader.register_mem_pool_host(rank_pool("page_head", 0, 1, None))
    assert reader.batch_exists(keys) == 0  # another TP size: a miss, never a mix


@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_sglangs_tensor_path_shares_pages_too(tmp_path: Path, layout: str) -> None:
    """interface_v1 off: SGLang's controller moves pages as tensors (get_data_page)."""
    model = mha_pool(layout, heads=HEADS, device_tokens=PAGES * PS, ratio=1.0)
    tokens, keys = prompt(PAGES, PS)
    idx = torch.arange(PAGES * PS)
    for storage, pool in deployment("file", tmp_path, layout, 2, model, "a", v1=False):
        c = controller(storage, pool, v1=False)
        assert c.page_set_func(keys, idx) is True  # SGLang's own tensor backup
    [(reader, pool)] = deployment("file", tmp_path, layout, 1, None, "b", v1=False)
    assert transfer(controller(reader, pool, v1=False), tokens, keys, idx) == PAGES
    assert [page_bytes(pool, i) for i in range(0, PAGES * PS, PS)] == [
        page_bytes(model, i) for i in range(0, PAGES * PS, PS)
    ]


def test_a_hybrid_models_side_pools_attach_beside_head_groups(tmp_path: Path) -> None:
    storage = adapter("file", tmp_path, 0, 1, 2, "a")
    storage.register_mem_pool_host(mha_pool("page_first", heads=2))
    assert isinstance(storage.backend, HeadGroupStore)
    storage.register_mem_host_pool_v2(mamba_pool(), PoolName.MAMBA)
    storage.register_mem_host_pool_v2(mha_pool("page_first", layers=2, heads=1), PoolName.SWA)
    assert sorted(storage._sides) == ["mamba", "swa"]
    assert not any(isinstance(side.backend, HeadGroupStore) for side in storage._sides.values())
    storage.close()


def test_more_ranks_than_heads_share_whole_heads(tmp_path: Path) -> None:
    """4 KV heads, deployments at TP 8 (each head on two ranks) and TP 2, tp_lcm_size 8:
    4 groups of one head; TP 8 names the model's heads with total_kv_heads."""
    model = mha_pool("page_head", heads=HEADS, device_tokens=PAGES * PS, ratio=1.0)
    _, keys = prompt(PAGES, PS)
    idx = torch.arange(PAGES * PS)
    for r in range(8):
        storage = adapter("file", tmp_path, r, 8, 8, "a", total_kv_heads=HEADS)
        pool = mha_pool("page_head", heads=1, device_tokens=PAGES * PS, ratio=1.0)
        pool.kv_buffer.copy_(model.kv_buffer.narrow(HEAD_AXIS["page_head"], r // 2, 1))
        storage.register_mem_pool_host(pool)
        assert isinstance(storage.backend, HeadGroupStore)
        assert storage.backend.head_groups == HEADS
        assert storage.backend.writer_scope == "dp0"  # (SGLang's config names dp_rank 0)
        assert storage.batch_set_v1(keys, idx) == [True] * PAGES
    for r, (storage, pool) in enumerate(deployment("file", tmp_path, "page_head", 2, None, "b")):
        assert storage.batch_get_v1(keys, idx) == [True] * PAGES
        want = rank_pool("page_head", r, 2, model)
        assert [page_bytes(pool, i) for i in range(0, PAGES * PS, PS)] == [
            page_bytes(want, i) for i in range(0, PAGES * PS, PS)
        ]
    with pytest.raises(ConfigError, match="contradicts the host pool"):
        adapter("file", tmp_path, 0, 2, 8, "c", total_kv_heads=6).register_mem_pool_host(
            mha_pool("page_head", heads=2)
        )
