"""The adapter used the way SGLang's own storage tests use a backend, beside HiCacheFile.

SGLang's unit tests build a backend with its factory, often with no host pool, and call
``set``/``get``/``exists``/``batch_*`` with tensors; with a pool they attach it first.
Each script below runs on SGLang's ``HiCacheFile`` and on our adapter (over our ``file``
backend, and the other node-local ones where no server is needed), with the same calls,
and the answers must be the same. Where HiCacheFile is silently wrong (a target of
another size), ours must be a clean miss instead.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_servers import backend_options
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang_pools import mha_pool, mla_pool

from hicache_storage.backends import FileBackend
from hicache_storage.errors import ConfigError
from hicache_storage.integrations.sglang import SGLangStorage

MODULE = "hicache_storage.integrations.sglang"


def config(extra: dict[str, Any] | None, *, rank: int, size: int, mla: bool) -> Any:
    return HiCacheStorageConfig(
        tp_rank=rank, tp_size=size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="acme/own-tests", extra_config=extra,
    )  # fmt: skip


def ours(name: str, tmp_path: Path, **kw: Any) -> Any:
    extra = {"backend_name": name, "module_path": MODULE, "class_name": "SGLangStorage",
             **backend_options(name, tmp_path)}  # fmt: skip
    return StorageBackendFactory.create_backend("dynamic", config(extra, **kw), None)


def theirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Any:
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "theirs"))
    return StorageBackendFactory.create_backend("file", config(None, **kw), None)


def value(i: int, n: int = 96, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, generator=g).to(dtype)


def answer(x: Any) -> Any:
    """A call's answer in a form two stores can be compared by (tensors: their bytes)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", bytes(x.contiguous().view(torch.uint8).numpy()))
    if isinstance(x, list):
        return [answer(y) for y in x]
    return x


def tensor_script(rank0: Any, rank1: Any) -> list[Any]:
    """SGLang's pool-less tensor calls: two TP ranks on one store."""
    empty = [torch.empty(96, dtype=torch.bfloat16) for _ in range(4)]
    out: list[Any] = [
        rank0.set("k1", value(1)),
        rank0.exists("k1"),
        rank0.exists("k9"),
        rank0.get("k1", empty[0]),
        rank0.get("k9", empty[1]),
        rank0.batch_set(["k2", "k3"], [value(2), value(3)]),
        rank0.batch_exists(["k1", "k2", "k3", "k9", "k1"]),
        rank0.batch_get(["k2", "k3", "k9"], [empty[1], empty[2], empty[3]]),
        rank0.set("k1", value(7)),  # stored already: first writer wins
        rank0.get("k1", empty[0]),
        # A second rank: MHA pages are per rank, MLA pages are shared by all of them.
        rank1.exists("k1"),
        rank1.batch_exists(["k1", "k2"]),
        rank1.set("k4", value(4)),
        rank0.exists("k4"),
    ]
    return [answer(x) for x in out]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("name", ["file", "shm", "mmap", "memory"])
def test_pool_less_tensor_calls_answer_as_hicachefile(
    name: str, mla: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = tensor_script(
        theirs(tmp_path, monkeypatch, rank=0, size=2, mla=mla),
        theirs(tmp_path, monkeypatch, rank=1, size=2, mla=mla),
    )
    a, b = (
        ours(name, tmp_path, rank=0, size=2, mla=mla),
        ours(name, tmp_path, rank=1, size=2, mla=mla),
    )
    got = tensor_script(a, b)
    assert got == want
    assert want[10] is mla  # (the script tells the two cases apart)
    # Where HiCacheFile reads a page into a smaller tensor (its first bytes: wrong), and
    # raises for a larger one, ours is a clean miss.
    assert a.get("k1", torch.empty(95, dtype=torch.bfloat16)) is None
    assert a.get("k1", torch.empty(97, dtype=torch.bfloat16)) is None
    # The pages of these calls are bytes of their own namespace: a pool's never see them.
    assert a.tensor_namespace().dtype == "uint8"
    a.clear()
    assert a.exists("k2") is False
    a.close(), b.close()


def pool_script(store: Any, pool: Any, other: Any) -> list[Any]:
    """The tensor calls of a backend with a host pool: pages of the pool, as SGLang's
    legacy path moves them (``get_data_page``, ``set_from_flat_data_page``)."""
    ps = pool.page_size
    pages = [pool.get_data_page(i * ps, flat=True) for i in range(3)]
    dummy = [pool.get_dummy_flat_data_page() for _ in range(3)]
    out = [
        store.batch_set(["p0", "p1", "p2"], pages),
        store.batch_exists(["p0", "p1", "p2", "px"]),
        store.batch_get(["p0", "p1", "p2"], dummy),
        store.get("px", pool.get_dummy_flat_data_page()),
        other.batch_exists(["p0", "p1"]),
    ]
    return [answer(x) for x in out]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_with_a_host_pool_tensor_and_v1_calls_answer_as_hicachefile(
    mla: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def pool() -> Any:
        return mla_pool("page_first") if mla else mha_pool("page_first")

    them = [theirs(tmp_path, monkeypatch, rank=r, size=2, mla=mla) for r in (0, 1)]
    us = [ours("file", tmp_path, rank=r, size=2, mla=mla) for r in (0, 1)]
    pools = pool(), pool()
    for store in them:
        store.register_mem_pool_host(pools[0])
    for store, p in zip(us, pools, strict=True):
        store.register_mem_pool_host(p)
    assert all(type(store) is HiCacheFile for store in them)  # SGLang's own, from its factory
    want = pool_script(them[0], pools[0], them[1])
    got = pool_script(us[0], pools[0], us[1])
    assert got == want
    assert want[4] == (2 if mla else 0)
    # The zero-copy pair, which HiCacheFile does not have: pages round trip byte-exact.
    ps = pools[0].page_size
    src, dst = torch.arange(0, 2 * ps), torch.arange(4 * ps, 6 * ps)
    assert us[0].batch_set_v1(["v0", "v1"], src) == [True, True]
    assert us[0].batch_get_v1(["v0", "v1"], dst) == [True, True]
    for i in range(2):
        assert answer(pools[0].get_data_page(int(src[i * ps]), flat=True)) == answer(
            pools[0].get_data_page(int(dst[i * ps]), flat=True)
        )
    for store in us:
        store.close()


class PoolWithoutDtype:
    """A host-pool stand-in of the kind engines' tests write: no dtype."""

    page_size = 4
    layout = "page_first"
    kv_buffer = torch.zeros(1024, dtype=torch.uint8)


def test_a_pool_missing_what_the_adapter_reads_is_a_config_error_naming_it(
    tmp_path: Path,
) -> None:
    store = ours("file", tmp_path, rank=0, size=1, mla=False)
    with pytest.raises(ConfigError, match="no 'dtype'"):
        store.register_mem_pool_host(PoolWithoutDtype())
    store.close()
    assert isinstance(store, SGLangStorage)


def test_one_target_the_sdk_refuses_fails_alone_in_a_batch(tmp_path: Path) -> None:
    store = ours("file", tmp_path, rank=0, size=1, mla=False)
    good = [value(i) for i in range(3)]
    assert store.batch_set(["a", "b", "c"], good) is True
    odd = torch.empty(192, dtype=torch.bfloat16)[::2]  # not contiguous: refused
    targets = [torch.empty(96, dtype=torch.bfloat16), odd, torch.empty(96, dtype=torch.bfloat16)]
    got = store.batch_get(["a", "b", "c"], targets)
    assert got[0] is targets[0] and got[1] is None and got[2] is targets[2]
    assert answer(targets[2]) == answer(good[2])
    # A batch_set with one refused value stores the others, and is not done.
    assert store.batch_set(["d", "e"], [object(), value(5)]) is False
    assert store.exists("e") and not store.exists("d")
    store.close()


def test_a_refused_attach_ends_the_pool_less_calls(tmp_path: Path) -> None:
    """Pages of a refused pool (here: fp8 stored as uint8 with no kv_cache_dtype) must
    not go to the pool-less namespace, which knows no dtype."""
    store = ours("file", tmp_path, rank=0, size=1, mla=False)
    assert store.set("k", value(1)) is True
    with pytest.raises(ConfigError):
        store.register_mem_pool_host(mha_pool("page_first", dtype=torch.uint8))
    assert store.set("j", value(2)) is False
    assert store.batch_exists(["k"]) == 0
    store.close()


class SlowFile(FileBackend):
    """A file backend that takes 30 s to start (a store that hangs at connect)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(30)
        super().__init__(*args, **kwargs)


def test_a_pool_less_backend_that_hangs_at_start_costs_misses_within_the_deadline(
    tmp_path: Path,
) -> None:
    extra = {"backend_name": f"{__name__}:SlowFile", "module_path": MODULE,
             "class_name": "SGLangStorage", "engine_timeout": 0.5, "root": str(tmp_path)}  # fmt: skip
    store = StorageBackendFactory.create_backend(
        "dynamic", config(extra, rank=0, size=1, mla=False), None
    )
    t0 = time.monotonic()
    assert store.set("k", value(1)) is False
    assert store.exists("k") is False  # (no second build while the first is pending)
    store.close()
    assert time.monotonic() - t0 < 5
