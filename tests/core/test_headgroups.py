"""Head-group pages (hicache_storage.headgroups): a page stored by TP a is read by TP b,
byte-exact, in every MHA host layout, and never assembled from two writers' groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_storage import HostKVPool, KVCacheNamespace, StorageConfig
from hicache_storage.backends import FileBackend
from hicache_storage.errors import ConfigError, InvalidKeyError
from hicache_storage.headgroups import HeadGroupStore, rank_heads
from hicache_storage.registry import create_backend

H, PS, LAYERS, DIM, PAGES = 8, 4, 3, 4, 6
HEAD_AXIS = {"layer_first": 3, "page_first": 3, "page_first_direct": 4, "page_head": 2}
MHA_LAYOUTS = tuple(HEAD_AXIS)


def model_pool(layout: str, seed: int = 0) -> HostKVPool:
    """Every head of the model: what each rank's heads are cut from."""
    pool = HostKVPool(PAGES, PS, LAYERS, H, DIM, dtype=torch.float16, layout=layout)
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen, dtype=torch.float32))
    return pool


def rank_pool(layout: str, tp_rank: int, tp_size: int, source: HostKVPool | None) -> HostKVPool:
    lo, hi = rank_heads(H, tp_rank, tp_size)
    pool = HostKVPool(PAGES, PS, LAYERS, hi - lo, DIM, dtype=torch.float16, layout=layout)
    if source is not None:
        pool.kv_buffer.copy_(source.kv_buffer.narrow(HEAD_AXIS[layout], lo, hi - lo))
    return pool


def store(root: Path, layout: str, tp_rank: int, tp_size: int, groups: int = H,
          writer: str = "w", **ns: Any) -> HeadGroupStore:  # fmt: skip
    fields: dict[str, Any] = {"model_id": "m", "dtype": "float16", "page_size": PS, "object_layout": layout,
              "total_kv_heads": H} | ns  # fmt: skip
    config = StorageConfig(
        namespace=KVCacheNamespace(**fields),
        tp_rank=tp_rank,
        tp_size=tp_size,
        extra_config={"head_groups": groups, "writer_id": writer},
    )
    backend = create_backend("file", config, root=str(root))
    assert isinstance(backend, HeadGroupStore)
    return backend


KEYS = [f"{i:064x}" for i in range(PAGES)]
IDX = torch.arange(PAGES * PS)


def write(root: Path, layout: str, tp: int, model: HostKVPool, **kw: Any) -> None:
    for r in range(tp):
        s = store(root, layout, r, tp, **kw)
        s.register_mem_pool_host(rank_pool(layout, r, tp, model))
        assert s.batch_set_v1(KEYS, IDX) == [True] * PAGES
        s.close()


def read(root: Path, layout: str, tp: int, **kw: Any) -> list[tuple[list[bool], HostKVPool]]:
    out = []
    for r in range(tp):
        s = store(root, layout, r, tp, **kw)
        pool = rank_pool(layout, r, tp, None)
        s.register_mem_pool_host(pool)
        out.append((s.batch_get_v1(KEYS, IDX), pool))
        s.close()
    return out


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 8), (8, 1), (2, 4), (4, 2), (2, 2)])
def test_a_page_written_at_one_tp_size_is_read_at_another(
    tmp_path: Path, layout: str, writer_tp: int, reader_tp: int
) -> None:
    model = model_pool(layout)
    write(tmp_path, layout, writer_tp, model)
    for r, (got, pool) in enumerate(read(tmp_path, layout, reader_tp)):
        assert got == [True] * PAGES
        assert torch.equal(pool.kv_buffer, rank_pool(layout, r, reader_tp, model).kv_buffer)


def test_more_ranks_than_heads_read_their_replicated_head(tmp_path: Path) -> None:
    model = model_pool("page_head")
    write(tmp_path, "page_head", 2, model)
    for r, (got, pool) in enumerate(read(tmp_path, "page_head", 16)):
        assert got == [True] * PAGES
        assert torch.equal(pool.kv_buffer, rank_pool("page_head", r, 16, model).kv_buffer)


@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_groups_of_two_writers_never_make_one_page(tmp_path: Path, layout: str) -> None:
    a, b = model_pool(layout, 1), model_pool(layout, 2)
    # Writer A at TP 2 stores rank 0's heads only; writer B at TP 2 stores rank 1's.
    s = store(tmp_path, layout, 0, 2, writer="A")
    s.register_mem_pool_host(rank_pool(layout, 0, 2, a))
    assert all(s.batch_set_v1(KEYS, IDX))
    s = store(tmp_path, layout, 1, 2, writer="B")
    s.register_mem_pool_host(rank_pool(layout, 1, 2, b))
    assert all(s.batch_set_v1(KEYS, IDX))
    # TP 2 readers each see one writer's whole groups: hits.
    halves = read(tmp_path, layout, 2, writer="R")
    assert [got for got, _ in halves] == [[True] * PAGES] * 2
    # TP 1 would join A's heads to B's: every page is a miss, and counted.
    reader = store(tmp_path, layout, 0, 1, writer="R")
    pool = rank_pool(layout, 0, 1, None)
    reader.register_mem_pool_host(pool)
    assert reader.batch_exists(KEYS) == PAGES  # every object is there...
    assert reader.batch_get_v1(KEYS, IDX) == [False] * PAGES  # ...but no page is one write
    assert reader.get_stats().corrupt_objects == PAGES
    # The reader removed those pages' groups: plain misses now, so the next backup (B's,
    # whole) stores them again, and they read as B's.
    assert reader.batch_exists(KEYS) == 0
    write(tmp_path, layout, 1, b, writer="B")
    assert reader.batch_get_v1(KEYS, IDX) == [True] * PAGES
    assert torch.equal(pool.kv_buffer, b.kv_buffer)


def test_delete_removes_every_group(tmp_path: Path) -> None:
    write(tmp_path, "page_first", 1, model_pool("page_first"))
    s = store(tmp_path, "page_first", 0, 1)
    assert s.delete(KEYS[0]) is True
    assert not list(tmp_path.rglob(f"{KEYS[0]}.*"))
    assert s.batch_exists_each(KEYS[:2]) == [False, True]


def test_side_pools_and_mla_are_never_split(tmp_path: Path) -> None:
    mla = KVCacheNamespace("m", "bf16", PS, rank_replicated=True)
    config = StorageConfig(namespace=mla, extra_config={"head_groups": 2})
    assert not isinstance(create_backend("file", config, root=str(tmp_path)), HeadGroupStore)


def test_every_rank_takes_the_same_keys(tmp_path: Path) -> None:
    limits = {store(tmp_path, "page_first", r, 8)._max_key for r in range(8)}
    assert len(limits) == 1
    with pytest.raises(InvalidKeyError, match="must not end with"):
        store(tmp_path, "page_first", 0, 1).batch_exists(["abc."])


def test_a_missing_group_is_a_miss_for_the_ranks_that_need_it(tmp_path: Path) -> None:
    model = model_pool("page_first")
    write(tmp_path, "page_first", 4, model)
    for path in tmp_path.rglob(f"{KEYS[2]}.h6-6"):
        path.unlink()
    reader = read(tmp_path, "page_first", 2)
    assert reader[0][0] == [True] * PAGES
    assert reader[1][0] == [True, True, False, True, True, True]
    s = store(tmp_path, "page_first", 0, 1)
    assert s.batch_exists(KEYS) == 2
    assert s.batch_exists_each(KEYS) == [True, True, False, True, True, True]


@pytest.mark.parametrize(
    "changed", [{"dtype": "bfloat16"}, {"page_size": 8}, {"model_id": "other"}, {"groups": 4}]
)
def test_other_bytes_are_misses(tmp_path: Path, changed: dict[str, Any]) -> None:
    write(tmp_path, "page_head", 2, model_pool("page_head"))
    s = store(tmp_path, "page_head", 0, 2, **changed)
    assert s.batch_exists(KEYS) == 0


def test_a_page_by_value_round_trips_through_get_and_set(tmp_path: Path) -> None:
    model = model_pool("layer_first")
    write(tmp_path, "layer_first", 4, model)
    s = store(tmp_path, "layer_first", 0, 1)
    s.register_mem_pool_host(rank_pool("layer_first", 0, 1, None))
    whole = s.get(KEYS[1])
    assert whole is not None and len(whole) == model.page_bytes
    assert whole == b"".join(
        bytes(b.memoryview) for b in model.page_buffers(IDX[PS : 2 * PS], 1)[0].segments
    )
    assert s.set("another", whole) is True
    assert s.get("another") == whole


@pytest.mark.parametrize(
    ("tp_size", "groups", "match"),
    [(4, 2, "not whole groups"), (2, 3, "does not divide"), (3, 8, "does not divide")],
)
def test_groups_that_do_not_fit_are_refused(
    tmp_path: Path, tp_size: int, groups: int, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        store(tmp_path, "page_head", 0, tp_size, groups=groups)


def test_a_pool_of_other_heads_and_mla_are_refused(tmp_path: Path) -> None:
    s = store(tmp_path, "page_first", 0, 2)
    with pytest.raises(ConfigError, match="holds 8 KV heads"):
        s.register_mem_pool_host(rank_pool("page_first", 0, 1, None))
    with pytest.raises(ConfigError, match="MLA"):
        HeadGroupStore(
            StorageConfig(namespace=KVCacheNamespace("m", "bf16", PS, rank_replicated=True)),
            lambda c: FileBackend(c, root=str(tmp_path)),
            2,
        )


def test_a_key_too_long_for_the_group_suffix_is_refused(tmp_path: Path) -> None:
    s = store(tmp_path, "page_first", 0, 1)
    with pytest.raises(InvalidKeyError, match="head groups"):
        s.batch_exists(["k" * 198])


def test_a_batch_larger_than_the_staging_memory_moves_in_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache_storage import headgroups

    model = model_pool("page_first")
    monkeypatch.setattr(headgroups, "STAGING_BYTES", 2 * model.page_bytes)  # 2 pages a run
    write(tmp_path, "page_first", 2, model)
    [(got, pool)] = read(tmp_path, "page_first", 1)
    assert got == [True] * PAGES
    assert torch.equal(pool.kv_buffer, model.kv_buffer)
